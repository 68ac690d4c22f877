// A mesh replica's part of the mesh's optimizer step, as every rank of the replica runs it
// around HeadOperations::OptimizerStep's apply (StepAround), under the head's lock:
//
//   sum     dW (and db) summed over the replicas, in place, the same bits on each
//           (Placement::SumOverReplicas); this replica's own kept when the step does not zero
//           dW, and put back after the apply, so that nothing is counted twice;
//   decide  the step's commit decision: whether the summed dW is applied. Every replica that
//           reaches it agreed already (the verdicts the fronts exchanged before the command ran,
//           MeshSteps::RunOnThisReplica), so today it always applies; it is the seat of a
//           decision taken after the sum (a replica lost during the sum aborts the step there);
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

// The decision between the sum and the apply: OK applies, anything else is the step's answer
// with nothing applied on this rank (dW is put back to this replica's own first).
using StepDecision = std::function<absl::Status()>;

// `keep_own`: the step does not zero dW. `decide` unset: apply.
StepAround ReplicaStepAround(Placement& placement, const std::string& head_id, bool keep_own,
                             StepDecision decide = {});

// This rank's part of a mesh replica's step of head `id` (the ReduceStep command):
// FAILED_PRECONDITION off a mesh.
absl::StatusOr<HeadDescription> ReplicaStep(HeadOperations& operations, const std::string& id,
                                            const OptimizerStepSpec& spec);

}  // namespace remotehead::server
