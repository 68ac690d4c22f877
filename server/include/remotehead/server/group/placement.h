// Where this process's part of every head sits — alone, a rank of a head group (a shard of
// every head's rows), or a rank of a mesh (a shard in one of R replicas) — and the collectives a
// head operation runs across it. A process alone is a placement too: its one shard is every row
// and its collectives give back their input (as vLLM's GroupCoordinator of world size 1 does), so
// an operation (HeadOperations) is written once and does not ask which topology it runs in.
//
// Holds no group: the HeadGroup and HeadMesh (either may be absent) outlive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead::server {

class HeadGroup;
class HeadMesh;

class Placement {
 public:
  Placement() = default;  // alone
  // A rank of `group` (K > 1 ranks; null: K = 1) in `mesh` (R > 1 replicas; null: none).
  Placement(HeadGroup* group, HeadMesh* mesh) : group_(group), mesh_(mesh) {}

  // This process's rank in its head group, and the group's size (0 and 1 alone).
  int rank() const;
  int size() const;
  // Whether a head's rows are split over the ranks (a head group), so a head records its shards.
  bool sharded() const { return group_ != nullptr; }
  // Whether this process answers HeadService: alone, or the front of its group.
  bool is_front() const;
  // This process's replica of its mesh, and the mesh's replicas (0 and 1 off a mesh).
  int replica() const;
  int replicas() const;
  // The replica whose front leads the mesh now (MeshEpoch::leader; 0 off a mesh).
  int leader_replica() const;
  // Whether it is one process of several (a head group, a mesh, or both).
  bool in_cluster() const { return group_ != nullptr || mesh_ != nullptr; }
  // Whether it is a front of a mesh's replica (which names every replica's trainers and counts).
  bool is_replica_front() const;
  // Whether it follows a log instead of deciding: a group's rank other than the front follows
  // the front's; a replica's front other than the leader, the leader's.
  bool follows_group() const { return !is_front(); }
  bool follows_mesh() const;
  // Whether this process decides for every process of its cluster (the mesh's leader, else the
  // group's front); alone there is no cluster to lead.
  bool leads_cluster() const;
  // What the cluster is called in a log line: "mesh", "head group" (alone: "server").
  const char* cluster_name() const;
  // OK while the group and the mesh work; else the first failure (alone: OK).
  absl::Status health() const;
  // OK while the group (else the mesh's fronts) takes work that trains or changes a head
  // (HeadGroup::Serving); else UNAVAILABLE with its verdict (alone: OK).
  absl::Status Serving() const;

  // The heal of a replica admitted again (head_mesh.h), this rank's part. `bytes` (the leader's
  // replica's rank's: every head's sealed state) broadcast to this rank's shard peers of `epoch`;
  // `joiner`: this rank is the admitted replica's. FAILED_PRECONDITION off a mesh.
  absl::Status BroadcastHeal(std::string& bytes, int epoch, bool joiner);
  // The key that seals the heal's states: the group's secret ("" without one).
  std::string heal_secret() const;
  // Tests only (--testonly_mesh_corrupt_heal): whether a joiner flips a byte of what it receives.
  bool testonly_corrupt_heal() const;
  // The heal's outcome on this rank: counted; on the joiner, its front serves (OK) or it leaves.
  void HealEnded(const absl::Status& outcome, bool joiner);
  // Waits until a mesh that changes epochs is settled (HeadMesh::AwaitSettled; OK alone).
  absl::Status AwaitMeshSettled(std::chrono::steady_clock::time_point deadline);
  // OK if every replica's `tensors` hash alike (HeadMesh::CompareAcrossReplicas; alone: OK).
  absl::Status CompareReplicas(const std::vector<torch::Tensor>& tensors, const std::string& what);

  // Every rank's rows of a head of `vocab_size` rows (alone: one range, all of them);
  // INVALID_ARGUMENT naming `field` when the group has more ranks than rows.
  absl::StatusOr<std::vector<core::ShardRange>> Ranges(int64_t vocab_size,
                                                       const std::string& field) const;

  // The head group's collectives (head_group.h), in the same order on every rank; alone there is
  // no one to send to: the input is the result.
  // The front's `tensors` written into every rank's.
  absl::Status Share(std::vector<torch::Tensor>& tensors);
  // This rank's rows `mine` of a tensor split by `ranges`: the whole on the front.
  absl::StatusOr<torch::Tensor> GatherRows(const torch::Tensor& mine,
                                           const std::vector<core::ShardRange>& ranges);
  // Every rank's `mine` summed on the front.
  absl::StatusOr<torch::Tensor> SumToFront(const torch::Tensor& mine);

  // Drain requests (GroupLog::RequestDrain), read and written in the logs this process shares:
  // a rank's request, if one came, in the group's log or the mesh's (the first found; a log that
  // cannot be read asks for nothing); alone: none.
  std::optional<std::string> DrainRequested();
  // Only the request a rank of this replica made in its group's log, on a replica's front of a
  // mesh (which relays it up to the leader); elsewhere none.
  std::optional<std::string> ReplicaDrainRequested();
  // A drain asked of the process above: a rank's front, a replica front's leader.
  absl::Status RequestDrainUp(const std::string& reason);

  // The mesh's (head_mesh.h); nothing to do off a mesh.
  // Whether this process is one replica of several (what an over-replicas step needs).
  bool replicated() const { return mesh_ != nullptr; }
  // The leader's `tensors` written into every replica front's (on a front of a mesh).
  absl::Status ShareFromLeader(std::vector<torch::Tensor>& tensors);
  // `t` summed over the replicas, in place, the same bits on each — by the groups of the mesh's
  // epoch `epoch` only (-1: the current one; HeadMesh::SumOverReplicas).
  absl::Status SumOverReplicas(torch::Tensor& t, int epoch = -1);
  // The commit decision of the replicas' step `attempt` once this rank's sum is done (`summed`:
  // how it went): OK to apply, ABORTED when the step was settled to abort (HeadMesh::Decide).
  // Alone: `summed`.
  absl::Status DecideStep(const std::string& attempt, const absl::Status& summed, int epoch = -1);
  // Whether the mesh evicts a lost replica and goes on (mesh_epoch.h): its survivors then keep
  // their own dW through a step that is aborted.
  bool evicts_replicas() const;
  // A test's pause at `point` of the mesh step to `version` (HeadMesh::TestOnlyPause).
  void TestOnlyPause(const std::string& point, int64_t version) const;
  // `status` restated for a caller when it was caused by an evicted replica (HeadMesh::Restated).
  absl::Status Restated(const absl::Status& status) const;
  // At every --mesh_checksum_every_steps-th `version`: the replicas' `tensors` compared
  // (DATA_LOSS naming those that differ, `what` saying what they are).
  absl::Status CompareReplicasAt(int64_t version, const std::vector<torch::Tensor>& tensors,
                                 const std::string& what);
  // How long the mesh's log waits for a front's reply (0 off a mesh's front).
  std::chrono::milliseconds mesh_reply_timeout() const;

 private:
  HeadGroup* group_ = nullptr;
  HeadMesh* mesh_ = nullptr;
};

}  // namespace remotehead::server
