#include "server/in_process_mesh.h"

#include <thread>

#include "absl/strings/str_cat.h"

namespace remotehead::testing {

InProcessMesh::InProcessMesh(int replicas, int ranks_per_replica, std::chrono::milliseconds timeout,
                             const std::string& prefix)
    : replicas_(replicas),
      ranks_per_replica_(ranks_per_replica),
      store_(std::make_shared<InProcessStore>()) {
  base_.size = replicas * ranks_per_replica;
  base_.replicas = replicas;
  base_.timeout = timeout;
  base_.prefix = prefix;
  // A group of `size` ranks under `name`, as JoinMesh makes a shard's and a replica's.
  auto group = [&](int size, const std::string& name) {
    server::GroupConfig config = base_;
    config.size = size;
    config.replicas = 1;
    config.prefix = absl::StrCat(prefix, "/", name);
    return std::make_unique<InProcessProcessGroup>(config, store_);
  };
  for (int k = 0; k < ranks_per_replica; ++k) {
    shards_.push_back(group(replicas, absl::StrCat("shard/", k)));
  }
  if (ranks_per_replica > 1) {
    for (int r = 0; r < replicas; ++r) {
      replica_groups_.push_back(group(ranks_per_replica, absl::StrCat("replica/", r)));
    }
  }
}

server::GroupConfig InProcessMesh::config(int global_rank) const {
  server::GroupConfig config = base_;
  config.rank = global_rank;
  return config;
}

server::ProcessGroup::Mesh InProcessMesh::Join(int global_rank) {
  const server::GroupConfig mine = config(global_rank);
  server::ProcessGroup::Mesh mesh;
  if (ranks_per_replica_ > 1) {
    mesh.replica = replica(mine.replica()).Take(mine.rank_in_replica());
  }
  mesh.shard = shard(mine.rank_in_replica()).Take(mine.replica());
  return mesh;
}

void InProcessMesh::RunOnAll(const std::function<void(int global_rank)>& fn) {
  std::vector<std::thread> threads;
  for (int g = 0; g < size(); ++g) threads.emplace_back(fn, g);
  for (std::thread& t : threads) t.join();
}

}  // namespace remotehead::testing
