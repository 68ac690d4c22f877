#include "replication/replica_step.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {

StepAround ReplicaStepAround(Placement& placement, const std::string& head_id, bool keep_own,
                             StepDecision decision, int epoch) {
  StepAround around;
  around.before = [&placement, keep_own, epoch, decision = std::move(decision)](
                      core::Head& head) -> absl::StatusOr<core::GradientBuffers> {
    core::GradientBuffers& grads = head.grads();
    // This replica's own dW, kept when the step leaves dW accumulated or a refused decision puts
    // it back: a copy of dW for the step.
    core::GradientBuffers own;
    if (keep_own || decision.keeps_own) {
      own.weight = grads.weight.clone();
      if (grads.bias.defined()) own.bias = grads.bias.clone();
    }
    absl::Status summed = placement.SumOverReplicas(grads.weight, epoch);
    if (summed.ok() && grads.bias.defined()) summed = placement.SumOverReplicas(grads.bias, epoch);
    if (!decision.decide) RETURN_IF_ERROR(summed);
    placement.TestOnlyPause("after_sum", head.version() + 1);
    if (decision.decide) {
      // A failed sum is decided too (an abort), and leaves dW as the decision's refusal does.
      if (const absl::Status decided = decision.decide(summed); !decided.ok()) {
        if (own.weight.defined()) {
          grads.weight.copy_(own.weight);
          if (own.bias.defined()) grads.bias.copy_(own.bias);
        } else {
          grads.weight.zero_();
          if (grads.bias.defined()) grads.bias.zero_();
        }
        return decided;
      }
    }
    if (!keep_own) return core::GradientBuffers{};
    return own;
  };
  around.after = [&placement, head_id](const core::Head& head) {
    placement.TestOnlyPause("after_apply", head.version());
    return placement.CompareReplicasAt(
        head.version(), {head.weight(), head.bias()},
        absl::StrCat("the weights of head \"", head_id, "\" at version ", head.version()));
  };
  return around;
}

absl::StatusOr<HeadDescription> ReplicaStep(HeadOperations& operations, const std::string& id,
                                            const OptimizerStepSpec& spec,
                                            const std::string& attempt, int epoch) {
  Placement& placement = operations.placement();
  if (!placement.replicated()) {
    return absl::FailedPreconditionError("reduce_step: this server is not a replica of a mesh");
  }
  if (attempt.empty()) {
    return absl::InvalidArgumentError(
        "reduce_step.attempt: expected the mesh step's name; got none");
  }
  // A copy of this replica's own dW is kept for a refused decision only where a lost replica is
  // evicted (then this replica's trainers resend nothing); elsewhere the loss takes the mesh
  // down, and every trainer starts again from a saved state.
  const StepDecision decision{.decide =
                                  [&placement, attempt, epoch](const absl::Status& summed) {
                                    return placement.DecideStep(attempt, summed, epoch);
                                  },
                              .keeps_own = placement.evicts_replicas()};
  return operations.OptimizerStep(
      id, spec, ReplicaStepAround(placement, id, !spec.zero_gradients, decision, epoch));
}

}  // namespace remotehead::server
