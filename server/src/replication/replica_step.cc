#include "replication/replica_step.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {

StepAround ReplicaStepAround(Placement& placement, const std::string& head_id, bool keep_own,
                             StepDecision decide) {
  StepAround around;
  around.before = [&placement, keep_own, decide = std::move(decide)](
                      core::Head& head) -> absl::StatusOr<core::GradientBuffers> {
    core::GradientBuffers& grads = head.grads();
    // This replica's own dW, kept when the step leaves dW accumulated or a decision may put it
    // back: a copy of dW for the step.
    core::GradientBuffers own;
    if (keep_own || decide) {
      own.weight = grads.weight.clone();
      if (grads.bias.defined()) own.bias = grads.bias.clone();
    }
    RETURN_IF_ERROR(placement.SumOverReplicas(grads.weight));
    if (grads.bias.defined()) RETURN_IF_ERROR(placement.SumOverReplicas(grads.bias));
    if (decide) {
      if (const absl::Status decided = decide(); !decided.ok()) {
        grads.weight.copy_(own.weight);
        if (own.bias.defined()) grads.bias.copy_(own.bias);
        return decided;
      }
    }
    if (!keep_own) return core::GradientBuffers{};
    return own;
  };
  around.after = [&placement, head_id](const core::Head& head) {
    return placement.CompareReplicasAt(
        head.version(), {head.weight(), head.bias()},
        absl::StrCat("the weights of head \"", head_id, "\" at version ", head.version()));
  };
  return around;
}

absl::StatusOr<HeadDescription> ReplicaStep(HeadOperations& operations, const std::string& id,
                                            const OptimizerStepSpec& spec) {
  if (!operations.placement().replicated()) {
    return absl::FailedPreconditionError("reduce_step: this server is not a replica of a mesh");
  }
  return operations.OptimizerStep(
      id, spec, ReplicaStepAround(operations.placement(), id, !spec.zero_gradients));
}

}  // namespace remotehead::server
