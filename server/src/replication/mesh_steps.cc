#include "replication/mesh_steps.h"

#include <algorithm>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "replication/replicated_head_operations.h"
#include "translate/group_commands.h"
#include "translate/head_commands.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

// The leader's trainers' request as the command carries it; unset for an unsynchronized step.
absl::StatusOr<std::optional<SyncStepRequest>> LeadersRequest(const v1::MeshStep& step) {
  if (!step.step().has_synchronous()) return std::nullopt;
  ASSIGN_OR_RETURN(OptimizerStepSpec spec, FromWire(step.step()));
  return SyncStepRequest{.head_id = step.step().head_id(),
                         .step = step.step().synchronous().step(),
                         .rank = step.step().synchronous().rank(),
                         .world_size = step.step().synchronous().world_size(),
                         .spec = std::move(spec),
                         .expected_incarnation = ""};
}

// Whether this replica has trainers to wait for at `step`: a synchronous step of a world in
// which some trainer's rank mod R is this replica.
bool WaitsForTrainers(const v1::MeshStep& step, const HeadMesh& mesh) {
  return step.step().has_synchronous() &&
         !mesh.TrainersOf(mesh.replica(), step.step().synchronous().world_size()).empty();
}

// The step every replica applies: as sent, with grad_scale divided by the world size for a
// synchronous step (as SynchronousSteps does for one server).
absl::StatusOr<OptimizerStepSpec> AppliedSpec(const v1::MeshStep& step) {
  ASSIGN_OR_RETURN(OptimizerStepSpec spec, FromWire(step.step()));
  if (step.step().has_synchronous()) {
    spec.grad_scale /= step.step().synchronous().world_size();
  }
  return spec;
}

// Now, in ms since the epoch of the system clock: when a replica's trainers were answered, as
// the other fronts compare it with when their own try of the step began (fronts on different
// hosts: their clocks agree to well within a step's timeout).
int64_t SystemMillis(std::chrono::system_clock::time_point at = std::chrono::system_clock::now()) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(at.time_since_epoch()).count();
}

// How often a front waiting for its trainers at a started step looks whether the mesh drains.
constexpr std::chrono::milliseconds kDrainPoll{100};

// A step's answer to its trainers: a drain's refusal, ABORTED inside the mesh's command (where an
// UNAVAILABLE would take the mesh down), is UNAVAILABLE to them, as every front's drain answers
// the steps waiting there (reason SERVER_DRAINING: try again once the servers are back).
absl::StatusOr<HeadDescription> ToTrainers(absl::StatusOr<HeadDescription> result) {
  if (result.ok()) return result;
  const std::optional<core::ErrorReason> reason = core::GetReason(result.status());
  if (!reason.has_value() || reason->reason != core::reason::kServerDraining ||
      result.status().code() == absl::StatusCode::kUnavailable) {
    return result;
  }
  return core::WithSerializedReason(absl::UnavailableError(result.status().message()),
                                    core::SerializeReason(result.status()));
}

// `status` with its message after `prefix`, its reason kept.
absl::Status Prefixed(const absl::Status& status, const std::string& prefix) {
  return core::WithSerializedReason(
      absl::Status(status.code(), absl::StrCat(prefix, status.message())),
      core::SerializeReason(status));
}

}  // namespace

v1::MeshStep MeshStepCommand(const std::string& head_id,
                             const std::optional<SyncStepRequest>& first,
                             const OptimizerStepSpec& spec, const HeadDescription& head) {
  v1::MeshStep step;
  // The request as the trainers sent it: every replica divides by the world size alike.
  *step.mutable_step() = Encode(head_command::OptimizerStep{
                                    .id = head_id, .spec = first.has_value() ? first->spec : spec})
                             .optimizer_step();
  if (first.has_value()) {
    v1::SynchronousStep* sync = step.mutable_step()->mutable_synchronous();
    sync->set_step(first->step);
    sync->set_rank(first->rank);
    sync->set_world_size(first->world_size);
  }
  step.set_weight_version(head.weight_version);
  step.set_vocab_size(head.vocab_size);
  step.set_hidden_size(head.hidden_size);
  return step;
}

absl::StatusOr<HeadDescription> MeshSteps::Step(const std::string& head_id,
                                                const std::optional<SyncStepRequest>& first,
                                                const OptimizerStepSpec& spec) {
  if (first.has_value()) {
    // Every trainer of this replica came (SynchronousSteps told each arrival already; told
    // again here for whoever steps without it).
    Came(*first, mesh_->TrainersOf(mesh_->replica(), first->world_size));
  }
  if (!mesh_->is_leader()) {
    if (!first.has_value()) return mesh_->NotTheLeader("an unsynchronized OptimizerStep");
    return AwaitLeader(*first);
  }
  RETURN_IF_ERROR(mesh_->Reconfiguring());
  ASSIGN_OR_RETURN(const HeadDescription head, operations_->local().Describe(head_id));
  v1::GroupCommand command;
  *command.mutable_mesh_step() = MeshStepCommand(head_id, first, spec, head);
  ASSIGN_OR_RETURN(const std::string attempt, HeadMesh::NewStepAttempt());
  command.mutable_mesh_step()->set_attempt(attempt);
  command.mutable_mesh_step()->set_epoch(mesh_->epoch().number);
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, mesh_->fronts()->Enter());
  absl::StatusOr<HeadDescription> result = absl::UnknownError("not run");
  const absl::Status status = RunCommand(lane, command, [&] {
    result = RunOnThisReplica(command.mesh_step(), first);
    return result.status();
  });
  // Applied here: the step's decision was "apply", so every serving replica applied it too; a
  // replica lost meanwhile (its front's reply missing) does not undo that.
  const absl::Status failed = mesh_->Restated(status);
  if (result.ok() && (failed.ok() || IsMeshReconfiguring(failed))) return result;
  // A step a lost replica aborted is to be asked again, once the mesh goes on without it.
  return ToTrainers(!failed.ok() ? failed : mesh_->Restated(result.status()));
}

absl::Status MeshSteps::Follow(const v1::MeshStep& step) {
  const Key key{step.step().head_id(), step.step().synchronous().step()};
  std::optional<SyncStepRequest> mine;
  if (WaitsForTrainers(step, *mesh_)) {
    const auto deadline = std::chrono::steady_clock::now() + wait_;
    std::unique_lock<std::mutex> lock(mu_);
    auto came = [&] {
      auto it = ready_.find(key);
      return !down_.ok() || draining_ ||
             (it != ready_.end() && !it->second.taken && !it->second.result);
    };
    // Waited in slices: between them the store says whether the leader drains (a drain that
    // began after the leader started this step must not wait for this replica's trainers).
    while (!came() && std::chrono::steady_clock::now() < deadline) {
      lock.unlock();
      const bool drains = LeaderDrains();
      lock.lock();
      if (drains) {
        draining_ = true;
        break;
      }
      changed_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() + kDrainPoll),
                          came);
    }
    if (auto it = ready_.find(key);
        it != ready_.end() && !it->second.taken && !it->second.result && down_.ok()) {
      it->second.taken = true;
      mine = it->second.first;
    }
  }
  const absl::StatusOr<HeadDescription> result = RunOnThisReplica(step, mine);
  if (mine.has_value()) {
    std::lock_guard<std::mutex> lock(mu_);
    // Gone if AbortWaiting answered its trainers already.
    if (auto it = ready_.find(key); it != ready_.end()) it->second.result = result;
    changed_.notify_all();
  }
  return result.status();
}

void MeshSteps::Drain() {
  if (!operations_->local().placement().is_replica_front()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
  }
  changed_.notify_all();
  if (!mesh_->is_leader() || mesh_->liveness() == nullptr) return;
  if (const absl::Status told = mesh_->liveness()->Publish(store_keys::kMeshDraining, "draining");
      !told.ok()) {
    operations_->local().LogEvent(absl::StrCat(
        "mesh: the drain not told to the other fronts (a step they wait at ends at its "
        "timeout): ",
        told.message()));
  }
}

bool MeshSteps::LeaderDrains() {
  Liveness* liveness = mesh_->liveness();
  if (liveness == nullptr) return false;
  const absl::StatusOr<std::optional<std::string>> told = liveness->Read(store_keys::kMeshDraining);
  return told.ok() && told->has_value();
}

absl::Status MeshSteps::DrainingVerdict(const v1::MeshStep& step) const {
  const std::string& head_id = step.step().head_id();
  const int64_t n = step.step().synchronous().step();
  return core::WithReason(
      absl::AbortedError(
          absl::StrCat("synchronous optimizer step ", n, " of head \"", head_id,
                       "\": the mesh is draining, and replica ", mesh_->replica(),
                       " stopped waiting for its trainers: nothing applied on any replica")),
      core::reason::kServerDraining,
      {{"head", head_id}, {"step", absl::StrCat(n)}, {"replica", absl::StrCat(mesh_->replica())}});
}

void MeshSteps::AbortWaiting(const absl::Status& status, bool started) {
  std::lock_guard<std::mutex> lock(mu_);
  if (started && down_.ok()) down_ = status;
  for (auto& [key, ready] : ready_) {
    if ((started || !ready.taken) && !ready.result.has_value()) ready.result = status;
  }
  changed_.notify_all();
}

std::vector<int> MeshSteps::Ranks(int world_size) const {
  return mesh_->TrainersOf(mesh_->replica(), world_size);
}

absl::Status MeshSteps::CheckRank(const SyncStepRequest& r) const {
  return CheckTrainer(r.rank, "synchronous.rank");
}

absl::Status MeshSteps::CheckTrainer(int rank, const std::string& field) const {
  const int replica = mesh_->replica();
  const int replicas = mesh_->replicas();
  const MeshEpoch epoch = mesh_->epoch();
  const int serves = epoch.ReplicaOf(rank, replicas);
  if (serves == replica) return absl::OkStatus();
  const std::string rule = epoch.number == 0
                               ? absl::StrCat("each trainer dials fronts[rank mod ", replicas, "]")
                               : absl::StrCat("in ", epoch.Describe(), " ", epoch.Moves(replicas));
  return core::WithReason(
      absl::InvalidArgumentError(
          absl::StrCat(field, ": expected a trainer of replica ", replica, " of ", replicas,
                       "; got rank ", rank, ", which replica ", serves, "'s front serves: ", rule)),
      core::reason::kWrongReplica,
      {{"rank", absl::StrCat(rank)},
       {"replica", absl::StrCat(serves)},
       {"epoch", absl::StrCat(epoch.number)}});
}

void MeshSteps::Came(const SyncStepRequest& first, const std::vector<int>& ranks) {
  Tell(first, ranks, 0);
}

void MeshSteps::Left(const SyncStepRequest& first, const std::vector<int>& ranks,
                     std::chrono::system_clock::time_point answered) {
  Tell(first, ranks, std::max<int64_t>(1, SystemMillis(answered)));
}

void MeshSteps::Tell(const SyncStepRequest& first, const std::vector<int>& ranks, int64_t left_ms) {
  Liveness* liveness = mesh_->liveness();
  if (liveness == nullptr) return;
  const absl::Status told =
      liveness->Publish(store_keys::MeshArrivals(first.head_id, mesh_->replica()),
                        absl::StrCat(first.step, " ", first.world_size, " ",
                                     absl::StrJoin(ranks, ","), " ", left_ms));
  if (!told.ok()) {
    operations_->local().LogEvent(absl::StrCat(
        "mesh: replica ", mesh_->replica(), "'s trainers at step ", first.step,
        left_ms == 0 ? "" : " (answered)", " not told to the other fronts: ", told.message()));
  }
}

absl::Status MeshSteps::Missing(const SyncStepRequest& first, const std::vector<int>& /*came*/,
                                std::chrono::milliseconds waited) {
  // Not only this replica's trainers that came here: every replica's, as the fronts told them.
  // This try of the step began `waited` ago: a replica's trainers answered before that came to
  // an earlier try (aborted: the step is asked again), not to this one.
  const int64_t began_ms = SystemMillis() - waited.count();
  std::set<int> came;
  std::vector<std::string> unknown;
  Liveness* liveness = mesh_->liveness();
  const MeshEpoch epoch = mesh_->epoch();
  for (int r : epoch.live) {
    if (liveness == nullptr) break;
    if (epoch.TrainersOf(r, first.world_size, mesh_->replicas()).empty()) continue;
    const absl::StatusOr<std::optional<std::string>> told =
        liveness->Read(store_keys::MeshArrivals(first.head_id, r));
    if (!told.ok()) {
      unknown.push_back(absl::StrCat("replica ", r, "'s (", told.status().message(), ")"));
      continue;
    }
    if (!told->has_value()) continue;
    // "<step> <world size> <ranks> <left>": only this step's trainers, waiting or answered
    // since this try began.
    const std::vector<std::string> fields = absl::StrSplit(**told, ' ');
    int64_t step = -1;
    int world = -1;
    int64_t left_ms = -1;
    if (fields.size() != 4 || !absl::SimpleAtoi(fields[0], &step) ||
        !absl::SimpleAtoi(fields[1], &world) || !absl::SimpleAtoi(fields[3], &left_ms) ||
        step != first.step || world != first.world_size || (left_ms != 0 && left_ms < began_ms)) {
      continue;
    }
    for (absl::string_view rank : absl::StrSplit(fields[2], ',', absl::SkipEmpty())) {
      int t = -1;
      if (absl::SimpleAtoi(rank, &t) && epoch.ReplicaOf(t, mesh_->replicas()) == r) came.insert(t);
    }
  }
  std::vector<int> missing;
  for (int t = 0; t < first.world_size; ++t) {
    if (!came.contains(t)) missing.push_back(t);
  }
  return core::WithReason(
      absl::AbortedError(absl::StrCat(
          "synchronous optimizer step ", first.step, " of head \"", first.head_id,
          "\": expected all ", first.world_size, " ranks (on the mesh's ", epoch.live.size(),
          " replicas: ",
          epoch.number == 0 ? absl::StrCat("rank t at replica t mod ", mesh_->replicas())
                            : absl::StrCat(epoch.Describe(), ": ", epoch.Moves(mesh_->replicas())),
          ") within ", absl::FormatDuration(absl::FromChrono(waited)), "; got ranks [",
          absl::StrJoin(came, ", "), "], missing ranks [", absl::StrJoin(missing, ", "), "]",
          unknown.empty() ? std::string()
                          : absl::StrCat(" (not known: ", absl::StrJoin(unknown, ", "), ")"),
          ": nothing applied on any replica, the accumulated dW is kept (ask again once every "
          "rank runs)")),
      core::reason::kRanksMissing,
      {{"head", first.head_id},
       {"step", absl::StrCat(first.step)},
       {"missing_ranks", absl::StrJoin(missing, ",")}});
}

absl::StatusOr<HeadDescription> MeshSteps::AwaitLeader(const SyncStepRequest& first) {
  const Key key{first.head_id, first.step};
  std::unique_lock<std::mutex> lock(mu_);
  Ready& ready = ready_[key];
  ready = Ready{.first = first};
  changed_.notify_all();
  // The leader's step comes once the leader's own trainers asked for it, within the same wait
  // as this replica's (the leader's trainers that did not come are named from what the fronts
  // published: Missing). A step the leader started waits for its result.
  changed_.wait_for(lock, wait_, [&] { return ready.taken || ready.result.has_value(); });
  if (!ready.taken && !ready.result.has_value()) {
    ready_.erase(key);
    lock.unlock();
    return Missing(first, {}, wait_);
  }
  changed_.wait(lock, [&] { return ready.result.has_value(); });
  absl::StatusOr<HeadDescription> result = *ready.result;
  ready_.erase(key);
  if (!result.ok()) return ToTrainers(mesh_->Restated(result.status()));
  return result;
}

absl::Status MeshSteps::Verdict(const v1::MeshStep& step,
                                const std::optional<SyncStepRequest>& mine) {
  const std::string& head_id = step.step().head_id();
  const std::string who = absl::StrCat("replica ", mesh_->replica());
  // A step proposed in another epoch than this replica's (the mesh changed meanwhile).
  if (const MeshEpoch here = mesh_->epoch(); step.epoch() != here.number) {
    return core::WithReason(
        absl::AbortedError(absl::StrCat("mesh step of epoch ", step.epoch(), ": ", who, " is in ",
                                        here.Describe(), ": nothing applied")),
        core::reason::kMeshReconfiguring, {{"epoch", absl::StrCat(here.number)}});
  }
  if (replica_group_ != nullptr) {
    // Every rank of this replica answers before anything is summed over the replicas: a rank
    // that is gone refuses the step here, on every replica, with nothing applied anywhere.
    v1::GroupCommand ping;
    ping.mutable_ping();
    absl::Status alive = replica_group_->health();
    if (alive.ok()) {
      absl::StatusOr<HeadGroup::Lane> lane = replica_group_->Enter();
      alive = lane.ok() ? RunCommand(*lane, ping, [] { return absl::OkStatus(); }) : lane.status();
    }
    if (!alive.ok()) return Prefixed(alive, absl::StrCat(who, " is down: "));
  }
  ASSIGN_OR_RETURN(const std::optional<SyncStepRequest> leaders, LeadersRequest(step));
  if (leaders.has_value() && WaitsForTrainers(step, *mesh_)) {
    if (!mine.has_value()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!down_.ok()) return down_;                // it did not wait: the mesh is down
        if (draining_) return DrainingVerdict(step);  // it stopped waiting: the mesh drains
      }
      return Missing(*leaders, {}, wait_);  // this replica's trainers did not all come
    }
    SyncStepRequest theirs = *mine;
    theirs.expected_incarnation = "";  // each replica checked its own trainers' already
    if (absl::Status disagree = SynchronousSteps::Agree(*leaders, theirs); !disagree.ok()) {
      return Prefixed(disagree,
                      absl::StrCat(who, " disagrees with replica ", mesh_->leader_replica(), ": "));
    }
  }
  ASSIGN_OR_RETURN(const HeadDescription head, operations_->local().Describe(head_id));
  if (head.weight_version != step.weight_version()) {
    return core::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "weight_version: expected every replica of head \"", head_id, "\" at replica ",
            mesh_->leader_replica(), "'s version ", step.weight_version(), "; ", who, " is at ",
            head.weight_version, ": nothing applied")),
        core::reason::kReplicasDiverged, {{"replicas", absl::StrCat(mesh_->replica())}});
  }
  if (head.vocab_size != step.vocab_size() || head.hidden_size != step.hidden_size()) {
    return core::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "head: expected every replica of head \"", head_id, "\" shaped as replica ",
            mesh_->leader_replica(), "'s [", step.vocab_size(), ", ", step.hidden_size(), "]; ",
            who, "'s is [", head.vocab_size, ", ", head.hidden_size, "]: nothing applied")),
        core::reason::kReplicasDiverged, {{"replicas", absl::StrCat(mesh_->replica())}});
  }
  return absl::OkStatus();
}

absl::StatusOr<HeadDescription> MeshSteps::RunOnThisReplica(
    const v1::MeshStep& step, const std::optional<SyncStepRequest>& mine) {
  const absl::Status verdict = Verdict(step, mine);
  ASSIGN_OR_RETURN(const std::vector<absl::Status> verdicts, mesh_->ExchangeVerdicts(verdict));
  // Every replica refuses alike, with the first refusal (which names its replica).
  for (const absl::Status& v : verdicts) {
    if (v.ok()) continue;
    // A verdict that names a lost process is this process's too, now, not at its next beat: no
    // call may be taken here after the trainers were told the mesh is down.
    if (NamesLostProcess(v) && mesh_->liveness() != nullptr) mesh_->liveness()->DeclareDown(v);
    return v;
  }
  ASSIGN_OR_RETURN(const OptimizerStepSpec spec, AppliedSpec(step));
  return operations_->ReduceStep(step.step().head_id(), spec, step.attempt(), step.epoch());
}

absl::Status MeshFollower::Run(const std::atomic<bool>& stop) {
  for (;;) {
    HeadGroup* log = mesh_->fronts();
    // The leader's replica was evicted and this front leads now (mesh_epoch.h): it appends to
    // the log instead, until the stop or the mesh's end.
    if (mesh_->is_leader()) {
      while (!stop.load() && mesh_->health().ok()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      return stop.load() ? absl::OkStatus() : mesh_->health();
    }
    const absl::Status followed = FollowCommands(
        *log, [this](const v1::GroupCommand& command) { return Follow(command); }, stop);
    // A log the mesh left behind (a replica was evicted): the next epoch's, once it is built.
    if (stop.load() || log->Retired().ok()) return followed;
    while (!stop.load() && mesh_->fronts() == log && mesh_->health().ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (mesh_->fronts() == log) return followed;  // stopped, or down before the next epoch
  }
}

absl::Status MeshFollower::Follow(const v1::GroupCommand& command) {
  if (command.has_mesh_step()) return steps_->Follow(command.mesh_step());
  if (command.has_gather() && command.gather().over_replicas()) {
    return operations_->SumGradientsOnLeader(command.gather().head_id()).status();
  }
  if (command.has_front()) {
    mesh_->fronts()->set_front_address(command.front().address());
    return absl::OkStatus();
  }
  // The drain's wait for this front's calls holds no lane (they need it); its ranks serve none.
  if (command.has_drain()) return local_->Follow(command);
  // A head command: run on every rank of this replica, as the leader runs it on its own.
  if (replica_group_ == nullptr) return local_->Follow(command);
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, replica_group_->Enter());
  return RunCommand(lane, command, [&] { return local_->Follow(command); });
}

}  // namespace remotehead::server
