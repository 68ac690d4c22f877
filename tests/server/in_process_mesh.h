// The groups of a mesh [R, K] (head_mesh.h) inside one process, for tests: what
// ProcessGroup::JoinMesh gives each of the R·K processes, as in-process groups
// (in_process_process_group.h) on one shared store, with JoinMesh's key prefixes:
//   - K shard groups "<prefix>/shard/<k>" of R ranks: global rank g = r·K + k is rank r of
//     shard k (shard 0's group is the replica fronts' one, the mesh's log);
//   - for K > 1, R replica groups "<prefix>/replica/<r>" of K ranks: g is rank k of replica r.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "remotehead/server/group/process_group.h"
#include "server/in_process_process_group.h"
#include "server/in_process_store.h"

namespace remotehead::testing {

class InProcessMesh {
 public:
  InProcessMesh(int replicas, int ranks_per_replica, std::chrono::milliseconds timeout,
                const std::string& prefix = "remotehead");

  int replicas() const { return replicas_; }
  int ranks_per_replica() const { return ranks_per_replica_; }
  int size() const { return replicas_ * ranks_per_replica_; }
  // Global rank g's configuration, as ResolveGroupConfig makes it (size R·K, rank g, R replicas).
  server::GroupConfig config(int global_rank) const;

  // Global rank g's groups, as JoinMesh returns them (replica: nullptr when K = 1); once each.
  server::ProcessGroup::Mesh Join(int global_rank);

  InProcessStore& store() { return *store_; }
  std::shared_ptr<InProcessStore> shared_store() const { return store_; }
  InProcessProcessGroup& shard(int k) { return *shards_.at(static_cast<size_t>(k)); }
  InProcessProcessGroup& replica(int r) { return *replica_groups_.at(static_cast<size_t>(r)); }

  // Runs fn(global rank) on one thread per process of the mesh; returns when every one has.
  void RunOnAll(const std::function<void(int global_rank)>& fn);

 private:
  const int replicas_;
  const int ranks_per_replica_;
  server::GroupConfig base_;
  std::shared_ptr<InProcessStore> store_;
  std::vector<std::unique_ptr<InProcessProcessGroup>> shards_;          // by k
  std::vector<std::unique_ptr<InProcessProcessGroup>> replica_groups_;  // by r; K > 1 only
};

}  // namespace remotehead::testing
