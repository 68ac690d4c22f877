// The optimizer steps of a head's replicas on a mesh (head_mesh.h) and the mesh's follower.
//
// A step is one command of the mesh's log (v1::MeshStep), made by the leader once its own
// trainers agreed (a synchronous step) or for one caller (an unsynchronized step). Every
// replica's front runs it the same way (RunOnThisReplica): it takes its own trainers' request
// for that step (waiting for them, up to the wait given), checks it against the leader's and
// its head's version and shape against the leader's, the fronts exchange their verdicts, and
// only if every replica agrees each runs the step on its ranks with dW summed over the replicas
// (ReplicatedHeadOperations::ReduceStep). Otherwise every replica refuses with the first replica's
// refusal, naming it, and nothing is applied anywhere.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/v1/head_group.pb.h"
#include "replication/group_follower.h"
#include "service/sync_steps.h"

namespace remotehead::server {

class ReplicatedHeadOperations;

class MeshSteps : public TrainerShare {
 public:
  // `wait`: how long a replica's front waits for its own trainers once the leader's step came.
  MeshSteps(ReplicatedHeadOperations* operations, HeadMesh* mesh, HeadGroup* replica_group,
            std::chrono::milliseconds wait)
      : operations_(operations), mesh_(mesh), replica_group_(replica_group), wait_(wait) {}

  // A step of every replica, as this replica's trainers asked for it: `first` (the first of
  // them, for a synchronous step; unset for an unsynchronized one) and `spec` (grad_scale
  // divided by the world size). On the leader: made a mesh command. On another front: a
  // synchronous step waits for the leader's; an unsynchronized one is NOT_THE_LEADER.
  absl::StatusOr<HeadDescription> Step(const std::string& head_id,
                                       const std::optional<SyncStepRequest>& first,
                                       const OptimizerStepSpec& spec);
  // Another front: the leader's step command, with this replica's trainers' request.
  absl::Status Follow(const v1::MeshStep& step);
  // Answers the synchronous steps waiting here for the leader's with `status` at once: those
  // the leader has not started (the server drains); with `started`, those it did too (the mesh
  // is down: their answer would never come), and no later step waits for trainers.
  void AbortWaiting(const absl::Status& status, bool started);
  // The server drains (HeadService::Drain, on every front; first on the leader, whose drain
  // runs the mesh's). On the leader, told to every front through the store (Liveness::Publish,
  // "draining"): a front waiting for its own trainers at a step the leader already started
  // stops waiting and refuses it (SERVER_DRAINING), and since every replica refuses a step one
  // of them refused, nothing is applied anywhere — the drain never waits for a step's timeout,
  // and the leader's trainers are answered at once. A step whose every replica's trainers came
  // is applied everywhere as usual.
  void Drain();

  // OK if this replica's front serves trainer `rank` in the mesh's epoch (HeadMesh::ReplicaOf);
  // else INVALID_ARGUMENT naming `field`, reason WRONG_REPLICA, metadata "replica" (the one that
  // does), "epoch".
  absl::Status CheckTrainer(int rank, const std::string& field) const;

  // TrainerShare: this replica's trainers (HeadMesh::TrainersOf; another is refused,
  // WRONG_REPLICA, naming the replica whose front serves it); at a step, published for the other fronts
  // (Liveness::Publish, "arrivals/<head>/<replica>", the latest step only: "<step> <world size>
  // <ranks> <left>", left = 0 while they wait, else when they were answered, in ms of the system
  // clock); the trainers of every replica that came to this try of the step, and those missing,
  // as the fronts published them (trainers answered before this try began came to an earlier
  // try of the same step, which was aborted: they count as missing).
  std::vector<int> Ranks(int world_size) const override;
  absl::Status CheckRank(const SyncStepRequest& request) const override;
  void Came(const SyncStepRequest& first, const std::vector<int>& ranks) override;
  void Left(const SyncStepRequest& first, const std::vector<int>& ranks,
            std::chrono::system_clock::time_point answered) override;
  absl::Status Missing(const SyncStepRequest& first, const std::vector<int>& came,
                       std::chrono::milliseconds waited) override;

 private:
  // This replica's trainers' step, handed from the synchronous steps to the mesh's follower.
  struct Ready {
    SyncStepRequest first;
    std::optional<absl::StatusOr<HeadDescription>> result;  // set once the mesh ran it
    bool taken = false;
  };
  using Key = std::pair<std::string, int64_t>;  // head, step

  absl::StatusOr<HeadDescription> RunOnThisReplica(const v1::MeshStep& step,
                                                   const std::optional<SyncStepRequest>& mine);
  // This replica's verdict on the leader's `step`: OK or the refusal, naming this replica.
  absl::Status Verdict(const v1::MeshStep& step, const std::optional<SyncStepRequest>& mine);
  // Another front: waits for the leader's step for `first` and returns its result.
  absl::StatusOr<HeadDescription> AwaitLeader(const SyncStepRequest& first);
  // Publishes this replica's trainers at `first`'s step (`left_ms`: 0 while they wait).
  void Tell(const SyncStepRequest& first, const std::vector<int>& ranks, int64_t left_ms);
  // Whether the leader said the mesh drains (its Drain, read from the store).
  bool LeaderDrains();
  // This replica's refusal of `step` because the mesh drains: ABORTED inside the mesh's command
  // (an UNAVAILABLE there would take the mesh down, HeadGroup::Check), reason SERVER_DRAINING.
  absl::Status DrainingVerdict(const v1::MeshStep& step) const;

  ReplicatedHeadOperations* const operations_;
  HeadMesh* const mesh_;
  HeadGroup* const replica_group_;  // nullptr: a replica of one server
  const std::chrono::milliseconds wait_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<Key, Ready> ready_;
  absl::Status down_;      // set by AbortWaiting(…, started = true)
  bool draining_ = false;  // set by Drain, or once the leader's drain was read from the store
};

// The mesh's log as a front other than the leader follows it: a step to MeshSteps, the
// leader's address to the fronts' group, any other command relayed to this replica's ranks
// (run here through `local`, every other rank of the replica through its own follower).
class MeshFollower {
 public:
  MeshFollower(HeadMesh* mesh, HeadGroup* replica_group, GroupFollower* local, MeshSteps* steps,
               ReplicatedHeadOperations* operations)
      : mesh_(mesh),
        replica_group_(replica_group),
        local_(local),
        steps_(steps),
        operations_(operations) {}

  absl::Status Run(const std::atomic<bool>& stop);
  absl::Status Follow(const v1::GroupCommand& command);

 private:
  HeadMesh* const mesh_;
  HeadGroup* const replica_group_;
  GroupFollower* const local_;
  MeshSteps* const steps_;
  ReplicatedHeadOperations* const operations_;
};

// The mesh command of a step (`first`: the leader's trainers' request, unset for an
// unsynchronized step; `spec` as they sent it), at the leader's head `head`.
v1::MeshStep MeshStepCommand(const std::string& head_id,
                             const std::optional<SyncStepRequest>& first,
                             const OptimizerStepSpec& spec, const HeadDescription& head);

}  // namespace remotehead::server
