// Synchronous optimizer steps of data-parallel trainers (OptimizerStepRequest.synchronous):
// W trainer processes each added their own micro-batches' dW to one head; each asks for the
// optimizer step of global step s as rank r of W. The first W - 1 callers wait; the last one's
// arrival checks that all of them asked for the same step and applies it once (the summed dW
// scaled by grad_scale / W, as DDP averages gradients); every caller gets the same answer.
//
// Free of gRPC: a caller hands in a Reply that is called exactly once — at once (a retry of an
// applied step, a refusal) or later from another thread (the last rank's, the timer's).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "service/head_requests.h"

namespace remotehead::server {

class ServerMetrics;

// One rank's request.
struct SyncStepRequest {
  std::string head_id;
  int64_t step = 0;
  int rank = 0;
  int world_size = 1;
  OptimizerStepSpec spec;            // as this rank sent it (grad_scale before the 1 / W)
  std::string expected_incarnation;  // "" = any
};

// Which of a world's trainers come to this server's synchronous steps, and what the other
// servers learn of them. This class itself is a server alone or a head group's front: every rank
// of the world comes here, and no one else is told. A mesh's front overrides it (MeshSteps,
// replication/mesh_steps.h): its replica's trainers only, told to the other fronts, and the
// missing named across the mesh — so that every replica names the same trainers.
class TrainerShare {
 public:
  virtual ~TrainerShare() = default;
  // The ranks of a world of `world_size` that this server waits for.
  virtual std::vector<int> Ranks(int world_size) const;
  // OK for a trainer that belongs here; else the refusal naming where it belongs.
  virtual absl::Status CheckRank(const SyncStepRequest& request) const;
  // This server's trainers that asked for `first`'s step so far (they wait).
  virtual void Came(const SyncStepRequest& first, const std::vector<int>& ranks);
  // This server's trainers at `first`'s step were answered (applied, refused, aborted) at
  // `answered` (before their answers were sent): they no longer count as come to a later try of
  // the same step (the same step asked again after it was aborted).
  virtual void Left(const SyncStepRequest& first, const std::vector<int>& ranks,
                    std::chrono::system_clock::time_point answered);
  // ABORTED, reason RANKS_MISSING: the step of `first` waited `waited`, and of the trainers
  // this server waits for, only `came` came; names every trainer of the world that came to this
  // try of it and every one missing (metadata missing_ranks).
  virtual absl::Status Missing(const SyncStepRequest& first, const std::vector<int>& came,
                               std::chrono::milliseconds waited);
};

class SynchronousSteps {
 public:
  using Reply = std::function<void(const absl::StatusOr<HeadDescription>&)>;
  // Applies a step that every rank agreed on: `first`, the first rank's request, and `spec`,
  // its step with grad_scale already divided by the world size (HeadOperations::OptimizerStep:
  // on a head group, on every rank; on a mesh, the replicas' step, head_mesh.h).
  using Apply = std::function<absl::StatusOr<HeadDescription>(const SyncStepRequest& first,
                                                              const OptimizerStepSpec& spec)>;
  // The head as it is now (HeadOperations::Describe): a step's answer is given again only
  // while the head is still at the version that step made.
  using Describe = std::function<absl::StatusOr<HeadDescription>(const std::string& head_id)>;

  // `timeout`: how long the ranks that came wait for the others, from the first arrival.
  // `metrics` (nullptr: none) gets the wait times, the ranks waiting and the aborted steps.
  SynchronousSteps(Apply apply, Describe describe, std::chrono::milliseconds timeout,
                   ServerMetrics* metrics);
  // Fails the steps still waiting (UNAVAILABLE) and stops the timer.
  ~SynchronousSteps();
  SynchronousSteps(const SynchronousSteps&) = delete;
  SynchronousSteps& operator=(const SynchronousSteps&) = delete;

  // Calls `reply` exactly once. A bad request (rank, world size, step) is INVALID_ARGUMENT at
  // once; a retry of a step applied recently gets its answer again — while the head is still
  // at the version that step made (after a restore, a re-upload or a new head of the same id,
  // the same step number is a new step).
  void Arrive(SyncStepRequest request, Reply reply);
  // Fails every waiting caller with `status` (the server is draining); nothing applied.
  void AbortAll(const absl::Status& status);
  // Which trainers come here (default: every rank of the world; a mesh's front: its replica's).
  // Set before the first step.
  void set_trainers(TrainerShare* trainers) { trainers_ = trainers; }

  // The refusal of `request` against `first` (the rank that came first, or on a mesh the
  // leader's), naming the field and both values; OK if they agree.
  static absl::Status Agree(const SyncStepRequest& first, const SyncStepRequest& request);

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiter {
    Reply reply;
    Clock::time_point arrived;
  };
  // The ranks waiting at one head's step.
  struct Pending {
    SyncStepRequest first;                     // what the others must agree with
    std::map<int, std::vector<Waiter>> ranks;  // a rank that retried waits twice
    Clock::time_point deadline;
    bool applying = false;  // the last rank is applying it: later arrivals join the answer
  };
  // A step applied, kept for the ranks whose answer was lost.
  struct Applied {
    int64_t step = 0;
    int world_size = 0;
    HeadDescription result;
  };
  using Replies = std::vector<std::pair<Waiter, absl::StatusOr<HeadDescription>>>;

  // Applies the step of `head_id` (its last rank came) and answers every rank.
  void ApplyAndAnswer(const std::string& head_id);
  // Moves every waiter of `pending` into `out`, to be answered with `status`.
  void TakeAll(Pending& pending, const absl::StatusOr<HeadDescription>& status, Replies* out);
  void Send(Replies replies);
  void TimerLoop();
  // The trainer share told which trainers came to `head_id`'s step now.
  void TellCame(const std::string& head_id);
  // The trainer share told that the trainers of `pending` (taken out of pending_) were answered
  // at `answered`.
  void TellLeft(const Pending& pending, std::chrono::system_clock::time_point answered);
  void UpdateWaitingLocked();

  const Apply apply_;
  const Describe describe_;
  const std::chrono::milliseconds timeout_;
  ServerMetrics* const metrics_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::map<std::string, Pending> pending_;              // by head
  std::map<std::string, std::deque<Applied>> applied_;  // by head, the latest last
  TrainerShare every_rank_;  // the default share: every rank of the world
  TrainerShare* trainers_ = &every_rank_;
  std::mutex telling_;  // one Came at a time, each with the trainers as they are then
  std::thread timer_;
};

}  // namespace remotehead::server
