// A mesh replica's part of the mesh's optimizer step, as every rank of the replica runs it
// around HeadOperations::OptimizerStep's apply (StepAround), under the head's lock:
//
//   sum     dW (and db) summed over the replicas, in place, the same bits on each
//           (Placement::SumOverReplicas); this replica's own kept when the step does not zero
//           dW, and put back after the apply, so that nothing is counted twice;
//   decide  the step's commit decision: whether the summed dW is applied, settled once for every
//           rank of every replica under the step's name (MeshStep.attempt; HeadMesh::Decide):
//           each rank proposes "apply" once its sum is done, and applies only if that is what
//           was settled — a process that resolves a lost replica settles "abort" first. Every
//           replica that reaches it agreed already (the fronts' verdicts, exchanged before the
//           command ran: MeshSteps::RunOnThisReplica);
//   apply   the optimizer step itself (HeadOperations' own);
//   compare every --mesh_checksum_every_steps versions, the weights compared across the
//           replicas (DATA_LOSS naming those that differ).
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "remotehead/server/group/placement.h"
#include "service/head_operations.h"

namespace remotehead::server {

// The decision between the sum and the apply, given how this rank's sum went: `decide` OK
// applies, anything else is the step's answer with nothing applied on this rank. `keeps_own`: a
// refusal (or a failed sum) puts this replica's own dW back (a copy of it kept through the sum,
// as for a step that leaves dW accumulated); otherwise dW is zeroed — it held the replicas' sum
// — and every trainer of the step sends its part again.
struct StepDecision {
  std::function<absl::Status(const absl::Status& summed)> decide;
  bool keeps_own = false;
};

// `keep_own`: the step does not zero dW. `decision.decide` unset: apply. `epoch`: the mesh's
// epoch the step belongs to (MeshStep.epoch), whose groups alone may sum it (-1: the current).
StepAround ReplicaStepAround(Placement& placement, const std::string& head_id, bool keep_own,
                             StepDecision decision = {}, int epoch = -1);

// This rank's part of a mesh replica's step `attempt` of head `id` (the ReduceStep command),
// its decision the mesh's (Placement::DecideStep): FAILED_PRECONDITION off a mesh.
absl::StatusOr<HeadDescription> ReplicaStep(HeadOperations& operations, const std::string& id,
                                            const OptimizerStepSpec& spec,
                                            const std::string& attempt, int epoch = 0);

}  // namespace remotehead::server
