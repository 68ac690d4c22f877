#include "remotehead/server/group/head_mesh.h"

#include <openssl/rand.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "group/exchange.h"
#include "group/mesh_admission.h"
#include "group/mesh_decisions.h"
#include "group/retired_groups.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/liveness.h"

namespace remotehead::server {

HeadMesh::HeadMesh(int replica, int replicas, MeshOptions options,
                   std::unique_ptr<HeadGroup> fronts, std::unique_ptr<ProcessGroup> shard_peers)
    : replica_(replica),
      replicas_(replicas),
      options_(options),
      front_(fronts != nullptr),
      epoch_(MeshEpoch::First(replicas)),
      wanted_(epoch_),
      fronts_(std::move(fronts)),
      shard_peers_(std::move(shard_peers)),
      decisions_(std::make_unique<MeshDecisions>(this)) {}

HeadMesh::~HeadMesh() {
  if (liveness_ != nullptr && epoch_listener_ >= 0)
    liveness_->epochs().RemoveListener(epoch_listener_);
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    closing_ = true;
  }
  regrouped_.notify_all();
  admission_.reset();  // an admission under way ends (its wait for an epoch sees the mesh close)
  if (regrouping_.joinable()) regrouping_.join();
}

HeadGroup* HeadMesh::fronts() {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return fronts_.get();
}

const HeadGroup* HeadMesh::fronts() const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return fronts_.get();
}

ProcessGroup& HeadMesh::peers() {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return fronts_ != nullptr ? fronts_->collectives() : *shard_peers_;
}

const ProcessGroup& HeadMesh::peers() const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return fronts_ != nullptr ? fronts_->collectives() : *shard_peers_;
}

std::map<std::string, CollectiveBytes> HeadMesh::PeerBytes() const { return peers().Bytes(); }

absl::Status HeadMesh::health() const {
  if (const HeadGroup* log = fronts(); log != nullptr) return log->health();
  return liveness_ != nullptr ? liveness_->health() : absl::OkStatus();
}

void HeadMesh::set_liveness(Liveness* liveness, Regroup regroup) {
  liveness_ = liveness;
  if (liveness == nullptr || !liveness->epochs().evicts() || regroup == nullptr) return;
  regroup_ = std::move(regroup);
  retired_ = std::make_unique<RetiredGroups>(liveness->config().timeout);
  regrouping_ = std::thread([this] { RegroupLoop(); });
  epoch_listener_ = liveness->epochs().OnEpoch([this](const MeshEpoch& next) { Enter(next); });
  // On every front: whichever leads admits (mesh_admission.h).
  if (front_) admission_ = std::make_unique<MeshAdmission>(this);
}

void HeadMesh::Joined(const MeshEpoch& admitted) {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  epoch_ = admitted;
  wanted_ = admitted;
  healing_ = replica_;
}

void HeadMesh::MarkHealed() {
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    if (healing_ == replica_) healing_ = -1;
  }
  regrouped_.notify_all();
}

void HeadMesh::HealFailed(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  if (heal_failed_.ok()) heal_failed_ = why;
}

bool HeadMesh::heal_failed() const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return !heal_failed_.ok();
}

void HeadMesh::set_healer(MeshAdmission::Healer healer) {
  if (admission_ != nullptr) admission_->set_healer(std::move(healer));
}

void HeadMesh::BeginHeal(int replica) {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  healing_ = replica;
}

void HeadMesh::EndHeal() {
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    healing_ = -1;
  }
  regrouped_.notify_all();
}

bool HeadMesh::AwaitEpoch(int number, std::chrono::milliseconds patience) {
  std::unique_lock<std::mutex> lock(epoch_mu_);
  const auto entered = [&] { return closing_ || epoch_.number >= number; };
  if (patience == std::chrono::milliseconds::max()) {
    regrouped_.wait(lock, entered);  // now + max would overflow the clock
  } else {
    regrouped_.wait_for(lock, patience, entered);
  }
  return !closing_ && epoch_.number >= number;
}

bool HeadMesh::evicts() const { return liveness_ != nullptr && liveness_->epochs().evicts(); }

int HeadMesh::leader_replica() const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return epoch_.leader();
}

MeshEpoch HeadMesh::epoch() const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return epoch_;
}

int HeadMesh::ReplicaOf(int trainer) const { return epoch().ReplicaOf(trainer, replicas_); }

std::vector<int> HeadMesh::TrainersOf(int replica, int world_size) const {
  return epoch().TrainersOf(replica, world_size, replicas_);
}

absl::Status HeadMesh::Reconfiguring() const {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  if (wanted_.number != epoch_.number) return wanted_.ChangeStatus("");
  if (healing_ < 0) return absl::OkStatus();
  MeshEpoch healing = wanted_;
  if (healing.admitted != healing_) {  // admitted, epoch not entered yet (the leader's)
    healing = healing.With(healing_, absl::StrCat("replica ", healing_, " asked to join"));
  }
  return healing.ChangeStatus("");
}

absl::Status HeadMesh::AwaitSettled(std::chrono::steady_clock::time_point deadline) {
  {
    std::unique_lock<std::mutex> lock(epoch_mu_);
    regrouped_.wait_until(lock, deadline, [&] {
      return closing_ || (wanted_.number == epoch_.number && healing_ < 0);
    });
  }
  return Reconfiguring();
}

absl::Status HeadMesh::Restated(const absl::Status& status) const {
  if (status.ok() || !evicts()) return status;
  const bool reconfiguring = IsMeshReconfiguring(status);
  if (!reconfiguring && !liveness_->epochs().NamesEvicted(status)) return status;
  if (reconfiguring && status.code() == absl::StatusCode::kUnavailable) return status;
  MeshEpoch next;
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    next = wanted_;
  }
  if (next.evicted < 0 && next.admitted < 0) return status;
  return next.ChangeStatus("");
}

void HeadMesh::Enter(const MeshEpoch& next) {
  if (!next.serves(replica_)) return;  // evicted: liveness took this process down
  std::lock_guard<std::mutex> lock(epoch_mu_);
  if (next.number <= wanted_.number) return;
  if (next.evicted >= 0) ++evictions_;
  wanted_ = next;
  // The epoch left: its log answers nothing more (its follower and its waiting front let go).
  if (fronts_ != nullptr) fronts_->Retire(next.ChangeStatus("the mesh's log: "));
  regrouped_.notify_all();
}

void HeadMesh::RegroupLoop() {
  std::unique_lock<std::mutex> lock(epoch_mu_);
  for (;;) {
    regrouped_.wait(lock, [&] { return closing_ || wanted_.number > epoch_.number; });
    if (closing_) return;
    const MeshEpoch next = wanted_;
    lock.unlock();
    absl::StatusOr<EpochGroups> groups = regroup_(next);
    lock.lock();
    if (!groups.ok()) {
      if (wanted_.number > next.number || closing_) continue;  // another loss: the newer epoch
      lock.unlock();
      liveness_->DeclareDown(absl::UnavailableError(
          absl::StrCat("mesh: the groups of ", next.Describe(), " could not be built: ",
                       groups.status().message(), " — restart every process of the mesh")));
      lock.lock();
      epoch_ = next;  // down: nothing serves; the loop waits for nothing more
      regrouped_.notify_all();
      continue;
    }
    const std::string front_address = fronts_ != nullptr ? fronts_->front_address() : "";
    std::vector<RetiredGroups::Entry> expired = retired_->Retire(
        {.fronts = std::move(fronts_), .shard_peers = std::move(shard_peers_)}, epoch_.number);
    fronts_ = std::move(groups->fronts);
    shard_peers_ = std::move(groups->shard_peers);
    epoch_ = next;
    if (fronts_ != nullptr && !front_address.empty()) fronts_->set_front_address(front_address);
    regrouped_.notify_all();
    lock.unlock();
    RetiredGroups::Close(std::move(expired), std::cerr);
    lock.lock();
  }
}

void HeadMesh::TestOnlyPause(const std::string& point, int64_t version) const {
  const MeshOptions::TestOnlyPause& pause = options_.testonly_pause;
  if (pause.point != point || pause.version != version) return;
  std::cerr << "remotehead-server: testonly: replica " << replica_ << " pauses " << point
            << (point == "before_heal" ? " of epoch " : " of the mesh step to version ") << version
            << " for " << pause.pause.count() << " ms" << std::endl;
  std::this_thread::sleep_for(pause.pause);
}

HeadMesh::Peers HeadMesh::CurrentPeers() {
  std::lock_guard<std::mutex> lock(epoch_mu_);
  return {.group = fronts_ != nullptr ? &fronts_->collectives() : shard_peers_.get(),
          .epoch = epoch_.number};
}

absl::StatusOr<HeadMesh::Peers> HeadMesh::PeersOf(int epoch) {
  if (epoch >= 0) {
    // A command of an epoch this process has not entered yet (its beat reads the record a
    // moment after the leader's): its groups first, as the other ranks wait for them.
    AwaitEpoch(epoch,
               liveness_ != nullptr ? liveness_->config().timeout : std::chrono::milliseconds(0));
  }
  const Peers peers = CurrentPeers();
  if (epoch >= 0 && epoch != peers.epoch) return EpochLeft(epoch);
  return peers;
}

absl::Status HeadMesh::PeersFailed(const absl::Status& failure, int epoch) {
  if (failure.ok() || !evicts() || !IsGroupFailure(failure)) return failure;
  // A group of an epoch the mesh left fails as its evicted members go: nobody to blame (they
  // are no longer watched), and no verdict on the mesh, which went on without them.
  if (const int now = liveness_->epochs().current().number; now != epoch) {
    return core::WithReason(absl::AbortedError(absl::StrCat("a collective of mesh epoch ", epoch,
                                                            " failed after the mesh entered epoch ",
                                                            now, ": ", failure.message())),
                            core::reason::kMeshReconfiguring, {{"epoch", absl::StrCat(now)}});
  }
  const absl::Status blamed = NamesLostProcess(failure) ? failure : liveness_->Blame(failure);
  // Evicts the lost process's replica (or it was evicted meanwhile), or the mesh is down.
  liveness_->DeclareDown(blamed);
  if (!liveness_->epochs().NamesEvicted(blamed)) return blamed;
  return core::WithReason(absl::AbortedError(absl::StrCat(
                              "a collective across the replicas failed: ", blamed.message())),
                          core::reason::kMeshReconfiguring,
                          {{"epoch", absl::StrCat(liveness_->epochs().current().number)}});
}

void HeadMesh::PublishFrontAddress(const std::string& address) {
  if (!evicts()) return;
  if (const absl::Status s = liveness_->Publish(store_keys::MeshFront(replica_), address);
      !s.ok()) {
    std::cerr << "remotehead-server: mesh: replica " << replica_ << "'s front address " << address
              << " was not published: " << s.message() << std::endl;
  }
}

absl::Status HeadMesh::NotTheLeader(const std::string& method) const {
  const int leader_replica = this->leader_replica();
  std::string leader;
  if (evicts()) {
    const absl::StatusOr<std::optional<std::string>> published =
        liveness_->Read(store_keys::MeshFront(leader_replica));
    if (published.ok() && published->has_value()) leader = **published;
  }
  if (const HeadGroup* log = fronts(); leader.empty() && leader_replica == 0 && log != nullptr) {
    leader = log->front_address();
  }
  return core::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          "this server is the front of replica ", replica_, " of a mesh of ", replicas_,
          ", which takes the training calls of its own trainers; ", method,
          " changes every replica and is taken by the mesh's leader (replica ", leader_replica,
          "'s front) only: ",
          leader.empty() ? std::string("its address is not known here yet; retry shortly")
                         : absl::StrCat("dial ", leader))),
      core::reason::kNotTheLeader,
      {{"leader", leader},
       {"leader_replica", absl::StrCat(leader_replica)},
       {"replica", absl::StrCat(replica_)},
       {"method", method}});
}

absl::Status HeadMesh::EpochLeft(int epoch) const {
  return core::WithReason(
      absl::AbortedError(absl::StrCat("a mesh step of epoch ", epoch, ": the mesh is in ",
                                      this->epoch().Describe(), " now: nothing applied")),
      core::reason::kMeshReconfiguring, {{"epoch", absl::StrCat(this->epoch().number)}});
}

absl::Status HeadMesh::SumOverReplicas(torch::Tensor& t, int epoch) {
  const auto start = std::chrono::steady_clock::now();
  // The group of the step's epoch, or none: never another epoch's members.
  ASSIGN_OR_RETURN(const Peers peers, PeersOf(epoch));
  ProcessGroup* group = peers.group;
  torch::Tensor wire =
      t.scalar_type() == options_.reduce_dtype ? t : t.to(options_.reduce_dtype).contiguous();
  // Reduced on replica 0, then broadcast from it: every replica ends with replica 0's bits
  // (an all-reduce's result may differ in the last bit between ranks).
  RETURN_IF_ERROR(PeersFailed(group->ReduceSum(wire, 0), peers.epoch));
  RETURN_IF_ERROR(PeersFailed(group->Broadcast(wire, 0), peers.epoch));
  if (!wire.is_same(t)) t.copy_(wire);
  reduced_bytes_.fetch_add(static_cast<int64_t>(wire.nbytes()));
  reduce_nanoseconds_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  return absl::OkStatus();
}

absl::Status HeadMesh::BroadcastFromLeader(std::string& bytes, int epoch, bool joiner) {
  ASSIGN_OR_RETURN(const Peers peers, PeersOf(epoch));
  const torch::Device device = peers.group->config().device;
  torch::Tensor size =
      torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64).to(device);
  RETURN_IF_ERROR(PeersFailed(peers.group->Broadcast(size, 0), peers.epoch));
  const int64_t n = size.cpu().item<int64_t>();
  // Rank 0 of the epoch's groups: the leader's replica (MeshEpoch::leader).
  const bool source = peers.group->rank() == 0;
  torch::Tensor data = torch::empty({n}, torch::kUInt8);
  if (source) std::memcpy(data.data_ptr(), bytes.data(), static_cast<size_t>(n));
  data = data.to(device);
  RETURN_IF_ERROR(PeersFailed(peers.group->Broadcast(data, 0), peers.epoch));
  if (!source) {
    const torch::Tensor host = data.cpu().contiguous();
    bytes.assign(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
  }
  if (joiner || source) heal_bytes_.fetch_add(n);
  return absl::OkStatus();
}

absl::Status HeadMesh::SumOnLeader(torch::Tensor& t) {
  const Peers peers = CurrentPeers();
  torch::Tensor wire = t.to(peers.group->config().device).contiguous();
  RETURN_IF_ERROR(PeersFailed(peers.group->ReduceSum(wire, 0), peers.epoch));
  t = wire.to(t.device());
  return absl::OkStatus();
}

absl::StatusOr<std::string> HeadMesh::NewStepAttempt() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    return absl::InternalError("mesh step: no random bytes to name the step");
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status HeadMesh::Decide(const std::string& attempt, const absl::Status& summed, int epoch) {
  return decisions_->Decide(attempt, summed, epoch);
}

absl::Status HeadMesh::CompareAcrossReplicas(const std::vector<torch::Tensor>& tensors,
                                             const std::string& what) {
  const uint64_t mine = HashTensors(tensors);
  torch::Tensor h = torch::empty({1}, torch::kInt64);
  std::memcpy(h.data_ptr<int64_t>(), &mine, sizeof(mine));
  const Peers peers = CurrentPeers();
  if (peers.group->config().device.is_cuda()) h = h.to(peers.group->config().device);
  absl::StatusOr<torch::Tensor> gathered = peers.group->AllGather(h);
  RETURN_IF_ERROR(PeersFailed(gathered.status(), peers.epoch));
  const torch::Tensor all = gathered->cpu();
  // By index among the serving replicas (the epoch's shard groups): named by replica.
  const std::vector<int> live = epoch().live;
  std::vector<int> differ;
  for (int64_t i = 1; i < all.size(0); ++i) {
    if (all[i].item<int64_t>() != all[0].item<int64_t>()) {
      differ.push_back(static_cast<size_t>(i) < live.size() ? live[i] : static_cast<int>(i));
    }
  }
  (differ.empty() ? matched_ : mismatched_).fetch_add(1);
  if (differ.empty()) return absl::OkStatus();
  return core::WithReason(absl::DataLossError(absl::StrCat(
                              "head mesh: ", what, " of replica(s) ", absl::StrJoin(differ, ", "),
                              " differ from replica ", live.empty() ? 0 : live.front(),
                              "'s (checksums of shard ", peers.group->config().prefix,
                              "): the replicas diverged; restore every replica from one state")),
                          core::reason::kReplicasDiverged,
                          {{"replicas", absl::StrJoin(differ, ",")}});
}

absl::StatusOr<std::vector<absl::Status>> HeadMesh::ExchangeVerdicts(const absl::Status& mine) {
  const Peers peers = CurrentPeers();
  absl::StatusOr<std::vector<std::string>> gathered =
      AllGatherStrings(*peers.group, EncodeStatus(mine));
  RETURN_IF_ERROR(PeersFailed(gathered.status(), peers.epoch));
  const std::vector<std::string>& all = *gathered;
  std::vector<absl::Status> verdicts;
  for (const std::string& verdict : all) verdicts.push_back(DecodeStatus(verdict));
  return verdicts;
}

std::vector<MetricFamilySamples> HeadMesh::Metrics() const {
  MetricFamilySamples checks{.name = "remotehead_mesh_checksums_total",
                             .help = "Weight checksums compared across the replicas, by result",
                             .counter = true};
  for (const bool matched : {true, false}) {
    checks.samples.push_back({.labels = {{"result", matched ? "match" : "mismatch"}},
                              .value = static_cast<double>(checksums(matched))});
  }
  MetricFamilySamples resolved{
      .name = "remotehead_mesh_steps_resolved_total",
      .help = "Mesh steps this rank read the commit decision of, by decision (apply or abort)",
      .counter = true};
  for (const bool apply : {true, false}) {
    resolved.samples.push_back({.labels = {{"decision", apply ? "apply" : "abort"}},
                                .value = static_cast<double>(decisions_->resolved(apply))});
  }
  MetricFamilySamples heals{
      .name = "remotehead_mesh_heals_total",
      .help = "Heals of an admitted replica this rank took part in, by result (ok or failed)",
      .counter = true};
  for (const bool ok : {true, false}) {
    heals.samples.push_back(
        {.labels = {{"result", ok ? "ok" : "failed"}},
         .value = static_cast<double>((ok ? heals_ok_ : heals_failed_).load())});
  }
  return {{.name = "remotehead_mesh_info",
           .help = "1, labelled with this process's replica and the mesh's replicas",
           .samples = {{.labels = {{"replica", std::to_string(replica_)},
                                   {"replicas", std::to_string(replicas_)}},
                        .value = 1}}},
          OneValue("remotehead_mesh_up", "1 while the mesh's log works, 0 once it is down", false,
                   health().ok() ? 1 : 0),
          OneValue("remotehead_mesh_reduced_bytes_total",
                   "Bytes of dW (and db) this rank summed over the replicas at optimizer steps",
                   true, static_cast<double>(reduced_bytes())),
          OneValue("remotehead_mesh_reduce_seconds_total",
                   "Time this rank spent summing dW over the replicas (both collectives)", true,
                   reduce_seconds()),
          CollectiveBytesByOp("remotehead_mesh_collective_bytes_total",
                              "Bytes this rank's collectives with its shard peers in the other "
                              "replicas sent and received, by operation",
                              PeerBytes()),
          std::move(checks),
          std::move(resolved),
          OneValue("remotehead_mesh_epoch",
                   "The mesh's epoch whose groups serve here (0 until a replica is evicted)", false,
                   epoch().number),
          OneValue("remotehead_mesh_replicas_live", "The replicas serving in the mesh's epoch",
                   false, static_cast<double>(epoch().live.size())),
          OneValue("remotehead_mesh_evictions_total",
                   "Replicas this process saw evicted from the mesh (one per epoch entered)", true,
                   static_cast<double>(evictions())),
          std::move(heals),
          OneValue("remotehead_mesh_heal_bytes_total",
                   "Bytes of heads' sealed states this rank sent (replica 0) or received (a "
                   "joiner) to heal an admitted replica",
                   true, static_cast<double>(heal_bytes_.load()))};
}

}  // namespace remotehead::server
