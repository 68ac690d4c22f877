#include "replication/cluster_drain.h"

#include <algorithm>
#include <csignal>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "replication/replicated_head_operations.h"
#include "translate/group_commands.h"

namespace remotehead::server {
namespace {

// How long a request may take to reach rank 0 (two polls of the logs, ~100 ms each, and a
// relay) and rank 0's stop to reach every rank, beyond the drain's own grace and save time.
constexpr std::chrono::seconds kTravel{5};

}  // namespace

std::string SignalName(int signal) {
  if (signal == SIGTERM) return "SIGTERM";
  if (signal == SIGINT) return "SIGINT";
  return absl::StrCat("signal ", signal);
}

void ClusterDrain::Configure(Timing timing, Quiesce quiesce) {
  timing_ = timing;
  quiesce_ = std::move(quiesce);
}

std::chrono::milliseconds ClusterDrain::patience() const {
  return timing_.grace + timing_.save + kTravel;
}

void ClusterDrain::Log(const std::string& line) const {
  if (log_ != nullptr) *log_ << "remotehead-server: " << line << std::endl;
}

absl::Status ClusterDrain::Follow(const v1::GroupCommand& command) {
  draining_.store(true);
  if (command.has_drain()) {
    const auto wait = std::chrono::milliseconds(std::max<int64_t>(0, command.drain().wait_ms()));
    Log(absl::StrCat("draining (", command.drain().reason(), ")",
                     placement_.is_front()
                         ? absl::StrCat(": calls in flight get up to ", DrainSeconds(wait), " s")
                         : std::string()));
    if (quiesce_ && !quiesce_(Clock::now() + wait)) {
      Log("drain: calls still running after the grace were cancelled");
    }
    return absl::OkStatus();
  }
  if (command.has_stop()) {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = command.stop();
    stop_.store(true);  // the follower ends once it replied: nothing more comes
    return absl::OkStatus();
  }
  return absl::InternalError(
      absl::StrCat("drain: command \"", CommandName(command), "\" is not the drain's"));
}

ClusterDrain::Outcome ClusterDrain::Poll(int signal, const std::optional<absl::Status>& followed) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_.has_value()) return Stopped(*stopped_);
  }
  if (placement_.leads_cluster()) {
    if (signal != 0) {
      return Run(absl::StrCat(SignalName(signal), " on global rank ", timing_.global_rank));
    }
    // A log that cannot be read (the group is down) asks for nothing: its own failure stops it.
    if (const std::optional<std::string> reason = placement_.DrainRequested(); reason.has_value()) {
      return Run(*reason);
    }
    return {};
  }
  if (followed.has_value()) {  // the log ended without a stop: rank 0 is gone
    return {.done = true,
            .exit_code = 1,
            .line = absl::StrCat(
                "stopped: ", followed->message(),
                draining() ? "; the drain did not finish: head states NOT saved" : "")};
  }
  AskOrRelay(signal);
  if (give_up_at_.has_value() && Clock::now() >= *give_up_at_) {
    stop_.store(true);
    return {.done = true,
            .exit_code = 1,
            .line = absl::StrCat("stopped: global rank 0 did not finish the drain within ",
                                 DrainSeconds(timing_.grace + timing_.save + kTravel),
                                 " s (--shutdown_grace_seconds + --drain_save_seconds + ",
                                 kTravel.count(), " s): head states NOT saved")};
  }
  return {};
}

void ClusterDrain::AskOrRelay(int signal) {
  // Up: a rank's own group (to its front), a replica's front's the mesh's (to the leader).
  if (signal != 0 && !asked_) {
    asked_ = true;
    draining_.store(true);
    give_up_at_ = Clock::now() + patience();
    const std::string reason =
        absl::StrCat(SignalName(signal), " on global rank ", timing_.global_rank);
    if (const absl::Status s = placement_.RequestDrainUp(reason); !s.ok()) {
      Log(absl::StrCat(reason, ": the drain could not be asked for: ", s.message()));
    } else {
      Log(absl::StrCat(reason,
                       ": asked global rank 0 to drain every rank; following its log "
                       "until it says stop (at most ",
                       DrainSeconds(patience()), " s)"));
    }
  }
  if (relayed_) return;
  if (const std::optional<std::string> reason = placement_.ReplicaDrainRequested();
      reason.has_value()) {
    relayed_ = true;
    if (const absl::Status s = placement_.RequestDrainUp(*reason); !s.ok()) {
      Log(absl::StrCat(*reason,
                       ": the request could not be passed to the mesh's leader: ", s.message()));
    }
  }
}

ClusterDrain::Outcome ClusterDrain::Run(const std::string& reason) {
  draining_.store(true);
  Log(absl::StrCat("draining the ", placement_.cluster_name(), " (", reason,
                   "): calls in flight get up to ", DrainSeconds(timing_.grace),
                   " s, then every head's state is saved on every rank"));
  const Clock::time_point deadline = Clock::now() + timing_.grace;
  if (quiesce_ && !quiesce_(deadline)) {
    Log("drain: calls still running after the grace were cancelled");
  }
  v1::GroupStop stop;
  stop.set_reason(reason);
  // A mesh that changes epochs (an eviction's groups being built, an admitted replica being
  // healed) settles first, within the saves' time: then every member, a healed joiner too, holds
  // every head and the state is saved on all of them.
  if (const absl::Status settled = placement_.AwaitMeshSettled(Clock::now() + timing_.save);
      !settled.ok()) {
    Log(absl::StrCat("drain: the mesh did not settle: ", settled.message()));
  }
  // A group already down reaches no rank: nothing can be saved (the others end on their own).
  absl::Status drained = placement_.health();
  if (drained.ok() && placement_.replicated()) {
    // Every other front's calls get what is left of the grace, within the log's reply wait.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::max(Clock::duration::zero(), deadline - Clock::now()));
    v1::GroupCommand command;
    command.mutable_drain()->set_reason(reason);
    command.mutable_drain()->set_wait_ms(
        std::min(left, placement_.mesh_reply_timeout() / 2).count());
    drained = operations_->RunEverywhere(command, [] { return absl::OkStatus(); });
  }
  if (drained.ok()) {
    SaveEveryHead(stop);
  } else if (operations_->local().Store().ok()) {
    stop.set_not_saved(absl::StrCat("the drain did not reach every rank: ", drained.message()));
  }
  v1::GroupCommand command;
  *command.mutable_stop() = stop;
  const absl::Status told =
      drained.ok() ? operations_->RunEverywhere(command, [] { return absl::OkStatus(); }) : drained;
  Outcome outcome = Stopped(stop);
  // What was saved was saved on every rank before the stop: a rank that missed the stop ends on
  // its own (its log ends with this process), which loses nothing.
  if (!told.ok()) {
    outcome.line = absl::StrCat(outcome.line, "; the other ranks were not told to stop (",
                                told.message(), "): they stop when this process is gone");
  }
  return outcome;
}

void ClusterDrain::SaveEveryHead(v1::GroupStop& stop) {
  if (!operations_->local().Store().ok()) return;  // no --state_dir: nothing to save
  std::vector<std::string> failed;
  for (const HeadDescription& head : operations_->local().List()) {
    const absl::StatusOr<HeadDescription> saved = operations_->SaveState(head.id);
    if (!saved.ok()) {
      failed.push_back(absl::StrCat("\"", head.id, "\": ", saved.status().message()));
      continue;
    }
    v1::GroupHeadState* state = stop.add_saved();
    state->set_head_id(head.id);
    state->set_state_id(saved->state_id);
  }
  if (!failed.empty()) stop.set_not_saved(absl::StrJoin(failed, "; "));
}

ClusterDrain::Outcome ClusterDrain::Stopped(const v1::GroupStop& stop) const {
  std::vector<std::string> saved;
  for (const v1::GroupHeadState& state : stop.saved()) {
    saved.push_back(absl::StrCat("\"", state.head_id(), "\" as ", state.state_id()));
  }
  const std::string states =
      saved.empty() ? std::string()
                    : absl::StrCat("head states saved on every rank: ", absl::StrJoin(saved, ", "));
  if (!stop.not_saved().empty()) {
    return {
        .done = true,
        .exit_code = 1,
        .line = absl::StrCat("drained (", stop.reason(), "); ", states, states.empty() ? "" : "; ",
                             "head states NOT saved: ", stop.not_saved())};
  }
  const bool store = operations_->local().Store().ok();
  return {.done = true,
          .exit_code = 0,
          .line = absl::StrCat("drained (", stop.reason(), "); ",
                               !store          ? "no --state_dir: no head state saved"
                               : saved.empty() ? "no heads: no state to save"
                                               : states)};
}

}  // namespace remotehead::server
