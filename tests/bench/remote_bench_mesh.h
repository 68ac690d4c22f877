// remotehead-remote-bench --replicas R: W data-parallel trainers on a mesh of R replicas of K
// ranks (docs/meshes.md) against the same trainers on one replica, measured in one run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(int32_t, replicas);

namespace remotehead::bench {

struct MeshBenchSetup {
  int64_t n = 0, d = 0, v = 0;  // tokens per trainer per step, hidden size, vocabulary
  int ranks_per_replica = 1;    // K
  std::string server;           // the remotehead-server binary
  std::vector<std::string> server_args;
  int64_t chunk_bytes = 1 << 20;
  bool json = false;
};

// Runs the bench (table, or one JSON object with `json`) and returns the exit code.
int RunMeshBench(const MeshBenchSetup& setup);

}  // namespace remotehead::bench
