#include "remotehead/server/group/head_mesh.h"

#include <openssl/rand.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "group/exchange.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/liveness.h"

namespace remotehead::server {

uint64_t HashTensors(const std::vector<torch::Tensor>& tensors) {
  // FNV-1a over 64-bit words (then the tail's bytes): any changed bit changes the hash; not
  // meant against adversaries, only to prove that replicas hold the same bytes.
  constexpr uint64_t kPrime = 1099511628211ULL;
  uint64_t h = 1469598103934665603ULL;
  for (const torch::Tensor& t : tensors) {
    if (!t.defined()) continue;
    const torch::Tensor cpu = t.contiguous().cpu();
    const auto* bytes = static_cast<const uint8_t*>(cpu.data_ptr());
    const size_t n = cpu.nbytes();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t word = 0;
      std::memcpy(&word, bytes + i, 8);
      h = (h ^ word) * kPrime;
    }
    for (; i < n; ++i) h = (h ^ bytes[i]) * kPrime;
  }
  return h;
}

HeadMesh::HeadMesh(int replica, int replicas, MeshOptions options,
                   std::unique_ptr<HeadGroup> fronts, std::unique_ptr<ProcessGroup> shard_peers)
    : replica_(replica),
      replicas_(replicas),
      options_(options),
      fronts_(std::move(fronts)),
      shard_peers_(std::move(shard_peers)) {}

ProcessGroup& HeadMesh::peers() {
  return fronts_ != nullptr ? fronts_->collectives() : *shard_peers_;
}

const ProcessGroup& HeadMesh::peers() const {
  return fronts_ != nullptr ? fronts_->collectives() : *shard_peers_;
}

std::map<std::string, CollectiveBytes> HeadMesh::PeerBytes() const { return peers().Bytes(); }

absl::Status HeadMesh::health() const {
  if (fronts_ != nullptr) return fronts_->health();
  return liveness_ != nullptr ? liveness_->health() : absl::OkStatus();
}

absl::Status HeadMesh::NotTheLeader(const std::string& method) const {
  const std::string leader = fronts_ != nullptr ? fronts_->front_address() : std::string();
  return core::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          "this server is the front of replica ", replica_, " of a mesh of ", replicas_,
          ", which takes the training calls of its own trainers; ", method,
          " changes every replica and is taken by the mesh's leader (replica 0's front) only: ",
          leader.empty() ? std::string("its address is not known here yet; retry shortly")
                         : absl::StrCat("dial ", leader))),
      core::reason::kNotTheLeader,
      {{"leader", leader}, {"replica", absl::StrCat(replica_)}, {"method", method}});
}

absl::Status HeadMesh::SumOverReplicas(torch::Tensor& t) {
  const auto start = std::chrono::steady_clock::now();
  torch::Tensor wire =
      t.scalar_type() == options_.reduce_dtype ? t : t.to(options_.reduce_dtype).contiguous();
  // Reduced on replica 0, then broadcast from it: every replica ends with replica 0's bits
  // (an all-reduce's result may differ in the last bit between ranks).
  RETURN_IF_ERROR(peers().ReduceSum(wire, 0));
  RETURN_IF_ERROR(peers().Broadcast(wire, 0));
  if (!wire.is_same(t)) t.copy_(wire);
  reduced_bytes_.fetch_add(static_cast<int64_t>(wire.nbytes()));
  reduce_nanoseconds_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  return absl::OkStatus();
}

absl::Status HeadMesh::SumOnLeader(torch::Tensor& t) {
  const torch::Device device = peers().config().device;
  torch::Tensor wire = t.to(device).contiguous();
  RETURN_IF_ERROR(peers().ReduceSum(wire, 0));
  t = wire.to(t.device());
  return absl::OkStatus();
}

namespace {
// A mesh step's commit decisions, as settled.
constexpr char kDecisionApply[] = "apply";
constexpr char kDecisionAbort[] = "abort";
}  // namespace

absl::StatusOr<std::string> HeadMesh::NewStepAttempt() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    return absl::InternalError("mesh step: no random bytes to name the step");
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status HeadMesh::Decide(const std::string& attempt) {
  if (liveness_ == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string decided,
                   liveness_->Settle(store_keys::MeshDecision(attempt), kDecisionApply));
  if (is_leader()) {
    std::lock_guard<std::mutex> lock(decided_mu_);
    if (!last_decided_.empty() && last_decided_ != attempt) {
      // Forgetting is housekeeping: a store that fails here fails the next step's settle too.
      liveness_->Unsettle(store_keys::MeshDecision(last_decided_)).IgnoreError();
    }
    last_decided_ = attempt;
  }
  if (decided == kDecisionApply) {
    ++applied_;
    return absl::OkStatus();
  }
  if (decided == kDecisionAbort) {
    ++aborted_;
    return absl::AbortedError(absl::StrCat(
        "mesh step ", attempt,
        ": settled to abort by another process (a replica was lost) before this one's "
        "decision: nothing applied; every trainer of the step sends its part again"));
  }
  return absl::DataLossError(absl::StrCat("mesh step ", attempt, ": the settled decision is \"",
                                          decided, "\", neither apply nor abort"));
}

absl::Status HeadMesh::CompareAcrossReplicas(const std::vector<torch::Tensor>& tensors,
                                             const std::string& what) {
  const uint64_t mine = HashTensors(tensors);
  torch::Tensor h = torch::empty({1}, torch::kInt64);
  std::memcpy(h.data_ptr<int64_t>(), &mine, sizeof(mine));
  if (peers().config().device.is_cuda()) h = h.to(peers().config().device);
  ASSIGN_OR_RETURN(torch::Tensor all, peers().AllGather(h));
  all = all.cpu();
  std::vector<int> differ;
  for (int r = 1; r < replicas_; ++r) {
    if (all[r].item<int64_t>() != all[0].item<int64_t>()) differ.push_back(r);
  }
  (differ.empty() ? matched_ : mismatched_).fetch_add(1);
  if (differ.empty()) return absl::OkStatus();
  return core::WithReason(
      absl::DataLossError(
          absl::StrCat("head mesh: ", what, " of replica(s) ", absl::StrJoin(differ, ", "),
                       " differ from replica 0's (checksums of shard ", peers().config().prefix,
                       "): the replicas diverged; restore every replica from one state")),
      core::reason::kReplicasDiverged, {{"replicas", absl::StrJoin(differ, ",")}});
}

absl::StatusOr<std::vector<absl::Status>> HeadMesh::ExchangeVerdicts(const absl::Status& mine) {
  ASSIGN_OR_RETURN(const std::vector<std::string> all,
                   AllGatherStrings(peers(), EncodeStatus(mine)));
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
                                .value = static_cast<double>(steps_resolved(apply))});
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
          std::move(resolved)};
}

}  // namespace remotehead::server
