// A mesh's epoch: which of its R replicas serve. Epoch 0 is every replica. With
// --mesh_min_replicas N < R, the loss of any process of replica r (not replica 0, whose global
// rank 0 serves the store, unless the store is external: --group_store_external) while at least
// N whole replicas remain evicts replica r and moves the mesh to the next epoch: one record, set
// once in the store by compare-and-set (Liveness::Settle under "epoch/<e>", sealed), so every
// process learns the same epoch and there is no split brain. The rules of an epoch, kept here in
// one place:
//   - the serving replicas are listed by seniority: an admitted replica joins the end, and the
//     first one leads (leader()): its front appends to the mesh's log, its rank of each shard is
//     rank 0 of the epoch's shard group (the root of the sum of dW, the source of a heal). The
//     leader changes only when its replica is evicted: the next in the list leads;
//   - the cross-replica groups (the fronts' log, each shard's peers) are rebuilt among the
//     serving replicas under a prefix of the epoch's own (store_keys::ShardGroupInEpoch), with
//     fresh sealed nonces: an entry of epoch e never verifies in e + 1; a serving replica's own
//     group (its shards) is untouched;
//   - trainer t is served by replica t mod R while that replica serves, else by the serving
//     replica live[t mod |live|] (ReplicaOf): a moved trainer's replica is a function of the
//     epoch only, the same at every front and in every client;
//   - an evicted replica whose every process asks to join again (restarted with its flags, or
//     restarted by itself: serving.h) is admitted by the leader between two mesh steps, in the
//     next epoch (With), one record set as an eviction's is; its processes then receive every
//     head's sealed state from the leader's rank of their shard (the heal: HeadMesh) before their
//     front serves, and its trainers come back to it.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace remotehead::server {

struct MeshEpoch {
  int number = 0;
  std::vector<int> live;  // the serving replicas, by seniority (the leader first)
  int evicted = -1;       // the replica this epoch evicted (-1: none)
  int admitted = -1;      // the replica this epoch admitted again (-1: none)
  std::string cause;      // why: the lost process, as its verdict named it

  // Epoch 0 of a mesh of `replicas`.
  static MeshEpoch First(int replicas);
  bool serves(int replica) const;
  // The replica that leads: the first serving one (replica 0 until it is evicted).
  int leader() const { return live.empty() ? 0 : live.front(); }
  // The index of `replica` among the serving replicas (its rank in the epoch's shard groups);
  // -1 if it does not serve.
  int IndexOf(int replica) const;
  // The replica whose front serves trainer `trainer` of a mesh of `replicas`.
  int ReplicaOf(int trainer, int replicas) const;
  // The trainers of a world of `world_size` that `replica` serves, ascending.
  std::vector<int> TrainersOf(int replica, int world_size, int replicas) const;
  // The epoch after this one, without `replica`.
  MeshEpoch Without(int replica, const std::string& cause) const;
  // The epoch after this one, with `replica` admitted again (the last in seniority).
  MeshEpoch With(int replica, const std::string& cause) const;
  // "epoch 1 (replicas [0, 2] serve; replica 1 evicted)".
  std::string Describe() const;
  // Where the trainers of the evicted replica go now, for the log line: "trainers t with t mod 3
  // = 1 now go to replica 0 (t mod 2 = 0) and replica 2 (t mod 2 = 1)".
  std::string Moves(int replicas) const;

  // The status of a call answered while the mesh changes to this epoch: UNAVAILABLE, reason
  // MESH_RECONFIGURING (metadata epoch, and evicted or admitted), `what` before its words —
  // nothing of the call applied; ask again shortly.
  absl::Status ChangeStatus(const std::string& what) const;

  // As the store keeps it (sealed by Liveness): "<number> <evicted> <live, comma-separated>
  // <admitted>\n<cause>".
  std::string Encode() const;
  static absl::StatusOr<MeshEpoch> Decode(const std::string& bytes);
};

// Whether `status` says that the mesh changes epochs (reason MESH_RECONFIGURING: a replica was
// evicted or admitted, nothing of the call applied).
bool IsMeshReconfiguring(const absl::Status& status);

}  // namespace remotehead::server
