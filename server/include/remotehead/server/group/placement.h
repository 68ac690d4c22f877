// Where this process's part of every head sits — alone, a rank of a head group (a shard of
// every head's rows), or a rank of a mesh (a shard in one of R replicas) — and the collectives a
// head operation runs across it. A process alone is a placement too: its one shard is every row
// and its collectives give back their input (as vLLM's GroupCoordinator of world size 1 does), so
// an operation (HeadOperations) is written once and does not ask which topology it runs in.
//
// Holds no group: the HeadGroup and HeadMesh (either may be absent) outlive it.
#pragma once

#include <cstdint>
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

  // The mesh's (head_mesh.h); nothing to do off a mesh.
  // Whether this process is one replica of several (what an over-replicas step needs).
  bool replicated() const { return mesh_ != nullptr; }
  // The leader's `tensors` written into every replica front's (on a front of a mesh).
  absl::Status ShareFromLeader(std::vector<torch::Tensor>& tensors);
  // `t` summed over the replicas, in place, the same bits on each.
  absl::Status SumOverReplicas(torch::Tensor& t);
  // At every --mesh_checksum_every_steps-th `version`: the replicas' `tensors` compared
  // (DATA_LOSS naming those that differ, `what` saying what they are).
  absl::Status CompareReplicasAt(int64_t version, const std::vector<torch::Tensor>& tensors,
                                 const std::string& what);

 private:
  HeadGroup* group_ = nullptr;
  HeadMesh* mesh_ = nullptr;
};

}  // namespace remotehead::server
