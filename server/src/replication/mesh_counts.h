// A head's accumulated micro-batches across a mesh's replicas. Each replica's trainers add into
// that replica's dW, so no front alone knows how many micro-batches the mesh's next step would
// apply: every front publishes its own count whenever it may change (HeadRegistry's count
// observer: a commit, a zeroing, a step, a head added or dropped), before the call that changed
// it is answered, and HeadInfo at any front (DescribeHead) sums every replica's. A trainer that
// was answered therefore finds its micro-batch counted at every front.
#pragma once

#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/server/group/head_mesh.h"
#include "service/head_operations.h"

namespace remotehead::server {

class MeshCounts {
 public:
  // `mesh`: nullptr, or a mesh whose front this process is not, makes both calls this
  // process's own.
  MeshCounts(HeadMesh* mesh, HeadOperations* local) : mesh_(mesh), local_(local) {}

  // Publishes this replica's count of head `id` (0 once it is gone).
  void Publish(const std::string& id);
  // The head as this front holds it, with accumulated_micro_batches summed over the replicas.
  // UNAVAILABLE naming the replica whose count cannot be read.
  absl::StatusOr<HeadDescription> Describe(const std::string& id) const;
  // Whether counts are published here (a front of a mesh with liveness).
  bool active() const;

 private:
  HeadMesh* const mesh_;
  HeadOperations* const local_;
  std::mutex publishing_;  // one at a time, each with the count as it is then
};

}  // namespace remotehead::server
