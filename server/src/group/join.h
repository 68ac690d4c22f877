// Joining what this process is part of: nothing (a server on its own), a head group of K ranks,
// or a replica of a mesh [R, K] (head_mesh.h), from the resolved --group_* flags. The one place
// that builds the groups and the mesh, opens their logs and says so on stdout.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/group/liveness.h"
#include "remotehead/server/group/placement.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

struct Cluster {
  // Every process's heartbeat and the one verdict that the group or mesh is down; first, so
  // that it outlives the groups that hold it.
  std::unique_ptr<Liveness> liveness;
  std::unique_ptr<HeadGroup> group;  // this replica's group of K > 1 ranks; nullptr: K = 1
  std::unique_ptr<HeadMesh> mesh;    // R > 1 replicas; nullptr: none
  // This process joined a mesh that ran already (its replica was evicted; mesh_epoch.h): its
  // heads come from the heal, not from --state_dir or --head.
  bool joined_running = false;
  // Where this process sits (placement.h), for what asks it of the cluster.
  Placement placement() const { return {group.get(), mesh.get()}; }
  // Whether this process serves HeadService: rank 0 of its replica (group).
  bool serves() const { return placement().is_front(); }
  // OK while the group and the mesh work; else the verdict (the first failure).
  absl::Status health() const;
  // The transport's gauges for the metrics: the group's and the mesh's (none alone).
  std::vector<MetricSource*> metric_sources() const;
  // Every command of the group's log observed as it completes (nothing alone).
  void ObserveGroupCommands(std::function<void(const std::string&, double)> observer) const;
  // The logs whose front this process is, which announce its address to their followers: its
  // group's on the group's front, the mesh's on the mesh's leader (none alone).
  std::vector<HeadGroup*> logs_led() const;
  // Every process's `mine`, by global rank (replica r's rank k at r·K + k), on every process:
  // along the replica's group, then along the shard peers. {mine} for a server on its own.
  absl::StatusOr<std::vector<std::string>> AllGather(const std::string& mine) const;
};

// The --mesh_* flags as given.
struct MeshFlags {
  std::string reduce_dtype = "float32";
  int checksum_every_steps = 100;
  int min_replicas = 0;
  int max_evictions = 0;
  double eviction_window_seconds = 3600;
  std::string testonly_pause;          // --testonly_mesh_pause
  bool testonly_corrupt_heal = false;  // --testonly_mesh_corrupt_heal
  bool test_environment = false;       // REMOTEHEAD_TESTONLY=1: test-only flags allowed
};
// The flags as options for a mesh of `replicas`; INVALID_ARGUMENT naming the flag.
absl::StatusOr<MeshOptions> ResolveMeshOptions(const MeshFlags& flags, int replicas);

// Joins (every rank waits for the others, up to config.timeout) and opens the logs. On a mesh
// that evicts (--mesh_min_replicas), a process of a replica other than 0 (any, with an external
// store) that finds the mesh running already joins it again instead: it asks, waits to be admitted,
// and joins the groups of the epoch that admits it (Cluster::joined_running).
absl::StatusOr<Cluster> JoinCluster(const GroupConfig& config, const MeshOptions& mesh_options);

}  // namespace remotehead::server
