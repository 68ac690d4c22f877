// The coordinated drain of a head group or mesh: SIGTERM (or SIGINT) on ANY rank stops every
// process with every head's state saved on every rank, so a rolling restart (Kubernetes) loses
// no training. Each rank stopping on its own signal could save nothing: a state is whole only
// where every rank saved its shard under one id, and a rank that left cannot save.
//
// How it runs (global rank 0 — the group's front, the mesh's leader, which serves the store —
// runs it through the logs, so every rank sees the same commands in the same order):
//   1. the signalled rank asks for it: a sealed request in its group's log (GroupLog::
//      RequestDrain); a replica's front relays its ranks' requests to the mesh's log. A rank
//      that asked keeps following its log until the stop (the saves must reach it);
//   2. rank 0 stops taking new calls (UNAVAILABLE, reason SERVER_DRAINING; health NOT_SERVING),
//      answers the synchronous steps waiting and waits up to --shutdown_grace_seconds for its
//      calls in flight; on a mesh a `drain` command does the same on every replica's front
//      (within what is left of that grace);
//   3. every head's state is saved on every rank under one state id (ReplicatedHeadOperations::
//      SaveState), when --state_dir is set;
//   4. a `stop` command (relayed by each replica's front to its ranks) names the states saved:
//      every rank stops following, logs them and exits 0. The next start restores them
//      (state_restore.h: the newest state every rank holds).
// A rank that asked and sees no stop within --shutdown_grace_seconds + --drain_save_seconds
// (plus a few seconds for the request to travel), or whose leader is gone, stops anyway: exit 1,
// saying that nothing was saved. A server on its own saves at SIGTERM by itself (not this).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/group/placement.h"
#include "remotehead/v1/head_group.pb.h"

namespace remotehead::server {

class ReplicatedHeadOperations;

// A duration as the drain's messages print it: seconds, to the millisecond.
inline double DrainSeconds(std::chrono::milliseconds ms) {
  return static_cast<double>(ms.count()) / 1000.0;
}

class ClusterDrain {
 public:
  using Clock = std::chrono::steady_clock;
  // This process's part of step 2: stop taking new calls, answer the synchronous steps waiting,
  // wait until `deadline` for the calls in flight (then cancel them); whether all had finished.
  // A rank that serves no calls only turns its health NOT_SERVING.
  using Quiesce = std::function<bool(Clock::time_point deadline)>;
  struct Timing {
    std::chrono::milliseconds grace{30000};  // --shutdown_grace_seconds: for the calls in flight
    std::chrono::milliseconds save{60000};   // --drain_save_seconds: for the saves after them
    int global_rank = 0;                     // this process's, named in its request
  };
  // What became of the drain (Poll): once `done`, the process exits with `exit_code`, logging
  // `line`.
  struct Outcome {
    bool done = false;
    int exit_code = 0;
    std::string line;
  };

  // `group` / `mesh`: this process's (nullptr: none; with neither, nothing here is used).
  ClusterDrain(ReplicatedHeadOperations* operations, HeadGroup* group, HeadMesh* mesh,
               std::ostream* log)
      : operations_(operations), placement_(group, mesh), log_(log) {}

  // Set before this process follows a log or serves.
  void Configure(Timing timing, Quiesce quiesce);

  // A follower's stop flag (HeadGroup::Follow): set by the stop command, or when this rank
  // gives up on the drain.
  const std::atomic<bool>& stop_following() const { return stop_; }
  // The process stops (the drain is done, or it ends otherwise): a follower still waiting lets go
  // (a front that came to lead the mesh follows nothing, and never reads a stop).
  void StopFollowing() { stop_.store(true); }
  // Whether a drain concerns this process (it was signalled, asked, or told).
  bool draining() const { return draining_.load(); }

  // A follower: the drain command (this process quiesces within the command's wait) or the
  // stop command (this rank stops following once it replied).
  absl::Status Follow(const v1::GroupCommand& command);

  // Called by the serving loop every ~100 ms: `signal`, the signal received (0: none);
  // `followed`, set once this rank's follower ended, with its status. On rank 0 a request or
  // its own signal runs the whole drain here (this call returns once every rank was told to
  // stop); elsewhere it asks for the drain, relays requests, and says when to stop.
  Outcome Poll(int signal, const std::optional<absl::Status>& followed);
  // How long a rank that was signalled follows its log, waiting for the drain's stop, before it
  // gives up: --shutdown_grace_seconds + --drain_save_seconds + the time a request and the stop
  // take to travel.
  std::chrono::milliseconds patience() const;

 private:
  // Rank 0: steps 2–4; the outcome for rank 0 itself.
  Outcome Run(const std::string& reason);
  // Step 3: every head's state saved on every rank, into `stop` (what was and was not saved).
  void SaveEveryHead(v1::GroupStop& stop);
  // Another rank: asks for the drain (once), relays its replica's requests (a mesh's front).
  void AskOrRelay(int signal);
  // The outcome that the stop command (or, on rank 0, the stop it sent) says.
  Outcome Stopped(const v1::GroupStop& stop) const;
  void Log(const std::string& line) const;

  ReplicatedHeadOperations* const operations_;
  Placement placement_;  // where this process sits, and the logs it shares
  std::ostream* const log_;
  Timing timing_;
  Quiesce quiesce_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> draining_{false};
  mutable std::mutex mu_;
  std::optional<v1::GroupStop> stopped_;  // guarded by mu_: the stop command, once it came
  // The serving loop's own (Poll):
  bool asked_ = false;    // this rank asked for the drain
  bool relayed_ = false;  // a mesh's front passed its replica's request on
  std::optional<Clock::time_point> give_up_at_;
};

// The text of `signal` ("SIGTERM", "SIGINT", "signal 10").
std::string SignalName(int signal);

}  // namespace remotehead::server
