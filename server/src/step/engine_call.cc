#include "step/engine_call.h"

#include "remotehead/core/status_macros.h"

namespace remotehead::server {

absl::StatusOr<EngineOutputs> RunEngine(core::CallMode mode, const core::Head& head,
                                        const core::TokenBatch& batch,
                                        const core::StepOptions& options,
                                        const torch::Tensor& grad_output,
                                        core::GradientBuffers* grads) {
  EngineOutputs out;
  switch (mode) {
    case core::CallMode::kFused: {
      ASSIGN_OR_RETURN(core::FusedResult r,
                       core::FusedForwardBackward(head, batch, options, grads));
      out.loss = std::move(r.loss_value);
      out.grad_hidden = std::move(r.grad_hidden);
      out.token_extras = std::move(r.token_extras);
      out.stats = std::move(r.stats);
      return out;
    }
    case core::CallMode::kForward: {
      ASSIGN_OR_RETURN(core::ForwardResult r, core::Forward(head, batch, options));
      if (options.reduction == core::Reduction::kNone) {
        out.outputs = std::move(r.output);
        out.token_ids = std::move(r.token_ids);
      } else {
        out.loss = r.output.to(torch::kDouble);
      }
      out.token_extras = std::move(r.token_extras);
      out.stats = std::move(r.stats);
      return out;
    }
    case core::CallMode::kBackward: {
      ASSIGN_OR_RETURN(core::BackwardResult r,
                       core::Backward(head, batch, options, grad_output, grads));
      out.grad_hidden = std::move(r.grad_hidden);
      out.token_extras = std::move(r.token_extras);
      out.stats = std::move(r.stats);
      return out;
    }
  }
  return absl::InternalError("unknown step mode");
}

}  // namespace remotehead::server
