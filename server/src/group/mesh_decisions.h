// The commit decision of every mesh step (HeadMesh::Decide's rules, head_mesh.h): after the sum,
// one decision per step, settled once for every rank of every replica (Liveness::Settle under
// the step's attempt) to apply or abort. On a mesh that evicts, a rank proposes "apply" only once
// every serving rank said its sum is done (store_keys::MeshSummed), so a step is applied on every
// serving replica or on none; the leader forgets the decision of the step before.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/group/mesh_epoch.h"

namespace remotehead::server {

class HeadMesh;

class MeshDecisions {
 public:
  explicit MeshDecisions(HeadMesh* mesh) : mesh_(mesh) {}

  // HeadMesh::Decide.
  absl::Status Decide(const std::string& attempt, const absl::Status& summed, int epoch);
  // The steps whose decision this rank read, applied or aborted.
  int64_t resolved(bool applied) const { return applied ? applied_ : aborted_; }

 private:
  // Whether every serving rank said it summed `attempt` (false: not yet); a status once the step
  // must abort.
  absl::StatusOr<bool> AllSummed(const std::string& attempt, const MeshEpoch& at) const;

  HeadMesh* const mesh_;
  std::mutex mu_;
  std::string last_decided_;  // on the leader: the attempt whose decision is forgotten next
  std::string last_summed_;   // the attempt whose "summed" word this rank takes back next
  std::atomic<int64_t> applied_{0};
  std::atomic<int64_t> aborted_{0};
};

}  // namespace remotehead::server
