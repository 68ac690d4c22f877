#include "remotehead/core/engine.h"

#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine_internal.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {
namespace engine_internal {
namespace {

absl::Status CheckGradientBuffers(const Head& head, const GradientBuffers* grads) {
  if (grads == nullptr) return absl::OkStatus();
  const torch::Tensor& w = grads->weight;
  if (!w.defined() || w.sizes() != head.weight().sizes() || w.device() != head.device() ||
      (w.scalar_type() != torch::kFloat && w.scalar_type() != head.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grads.weight: expected ", c10::str(head.weight().sizes()), " float32 or ",
        DtypeName(head.dtype()), " on ", head.device().str(), "; got ", ShapeOf(w),
        w.defined() ? absl::StrCat(" ", DtypeName(w.scalar_type()), " on ", w.device().str())
                    : ""));
  }
  if (head.has_bias() != grads->bias.defined() ||
      (head.has_bias() &&
       (grads->bias.sizes() != head.bias().sizes() || grads->bias.device() != head.device()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grads.bias: expected ", head.has_bias() ? c10::str(head.bias().sizes()) : "none", "; got ",
        ShapeOf(grads->bias)));
  }
  return absl::OkStatus();
}

absl::Status CheckGradHiddenOut(const Head& head, const Plan& plan, const torch::Tensor& out) {
  if (!out.defined()) return absl::OkStatus();
  if (out.dim() != 2 || out.size(0) != plan.rows || out.size(1) != head.hidden_size() ||
      out.scalar_type() != head.dtype() || out.device() != head.device() || !out.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_hidden_out: expected a contiguous [", plan.rows, ", ", head.hidden_size(), "] ",
        DtypeName(head.dtype()), " tensor on ", head.device().str(), "; got ", ShapeOf(out)));
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> PrepareGradHidden(const Head& head, const Plan& plan,
                                                torch::Tensor grad_hidden_out) {
  RETURN_IF_ERROR(CheckGradHiddenOut(head, plan, grad_hidden_out));
  if (!plan.holds_grad_hidden()) return torch::Tensor();
  if (grad_hidden_out.defined()) return grad_hidden_out;
  return torch::empty({plan.rows, head.hidden_size()}, head.weight().options());
}

// LibTorch reports failures during compute (allocation failures above all) as exceptions; the
// engine's callers get a status instead. Out-of-memory maps to RESOURCE_EXHAUSTED.
template <typename Fn>
auto StatusFromExceptions(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const GroupFailure& e) {
    return e.status;
  } catch (const StopRequested&) {
    return absl::CancelledError(
        "cancelled: the request was cancelled or its deadline expired; stopped between chunks");
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory: ", e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch error: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
}

absl::StatusOr<FusedResult> FusedForwardBackwardImpl(const Head& head, const TokenBatch& batch,
                                                     const StepOptions& options,
                                                     GradientBuffers* grads,
                                                     torch::Tensor grad_hidden_out) {
  if (options.reduction == Reduction::kNone) {
    return absl::InvalidArgumentError(
        "reduction: fused mode needs a scalar loss (sum, mean or weighted_sum); got none — "
        "use Forward then Backward for per-token outputs");
  }
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options, CallMode::kFused));
  RETURN_IF_ERROR(CheckGradientBuffers(head, grads));
  ASSIGN_OR_RETURN(torch::Tensor grad_hidden, PrepareGradHidden(head, plan, grad_hidden_out));
  if (plan.call.couples_rows) {
    return FusedCoupled(head, batch, plan, options.upstream_scale, grads, std::move(grad_hidden));
  }

  const double factor = options.upstream_scale / plan.denominator;
  const UpstreamFn upstream = [factor](int64_t, int64_t, const torch::Tensor& w) {
    return w * factor;
  };
  const ChunkOutputs outputs =
      RunChunks(head, batch, plan, TrainingPass(plan, &upstream, grads, grad_hidden));
  FusedResult result;
  result.loss_value = outputs.loss_sum / plan.denominator;
  if (!options.loss_on_device) {
    const PhaseScope sync(plan.phases, StepPhase::kHostSync);
    result.loss = result.loss_value.item<double>();
  }
  result.grad_hidden = std::move(grad_hidden);
  result.stats = MakeStats(plan, outputs);
  result.token_extras = outputs.token_extras;
  return result;
}

absl::StatusOr<ForwardResult> ForwardImpl(const Head& head, const TokenBatch& batch,
                                          const StepOptions& options) {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options, CallMode::kForward));
  if (plan.fn().output != OutputKind::kPerToken) {
    return RunGenerationChunks(head, batch, plan, options.output_dtype);
  }
  if (plan.call.couples_rows) return ForwardCoupled(head, batch, plan);
  const bool per_token = options.reduction == Reduction::kNone;
  const ChunkOutputs outputs = RunChunks(head, batch, plan, {.keep_per_token = per_token});
  ForwardResult result;
  result.output =
      per_token ? outputs.per_token : (outputs.loss_sum / plan.denominator).to(LogitsDtype(head));
  result.stats = MakeStats(plan, outputs);
  result.token_extras = outputs.token_extras;
  return result;
}

absl::StatusOr<BackwardResult> BackwardImpl(const Head& head, const TokenBatch& batch,
                                            const StepOptions& options,
                                            const torch::Tensor& grad_output,
                                            GradientBuffers* grads, torch::Tensor grad_hidden_out) {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options, CallMode::kBackward));
  RETURN_IF_ERROR(CheckGradientBuffers(head, grads));
  UpstreamFn upstream;
  if (options.reduction == Reduction::kNone) {
    RETURN_IF_ERROR(
        CheckPerToken(grad_output, "grad_output", plan.rows, head.device(), false, plan));
    upstream = [&grad_output](int64_t start, int64_t rows, const torch::Tensor& w) {
      return w * grad_output.narrow(0, start, rows).to(w.scalar_type());
    };
  } else {
    if (!grad_output.defined() || grad_output.numel() != 1 ||
        !IsFloating(grad_output.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_output: expected one floating value (the gradient of the ",
          std::string(ReductionName(options.reduction)), " loss); got ", ShapeOf(grad_output)));
    }
    const double g = grad_output.item<double>();
    if (!std::isfinite(g)) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad_output: expected a finite value; got ", g));
    }
    const double factor = g / plan.denominator;
    upstream = [factor](int64_t, int64_t, const torch::Tensor& w) { return w * factor; };
  }
  ASSIGN_OR_RETURN(torch::Tensor grad_hidden, PrepareGradHidden(head, plan, grad_hidden_out));
  if (plan.call.couples_rows) {
    return BackwardCoupled(head, batch, plan, grad_output, grads, std::move(grad_hidden));
  }
  const ChunkOutputs outputs =
      RunChunks(head, batch, plan, TrainingPass(plan, &upstream, grads, grad_hidden));
  BackwardResult result;
  result.grad_hidden = std::move(grad_hidden);
  result.stats = MakeStats(plan, outputs);
  result.token_extras = outputs.token_extras;
  return result;
}

}  // namespace
}  // namespace engine_internal

// Seen without it: the first logsumexp after a server start split its 24 rows over the two
// OpenMP threads, and one thread's half was computed by VML's AVX2 "enhanced performance" exp
// (VML_EP, ~5e-5 relative error) instead of the AVX-512 VML_HA one LibTorch asks for — about
// one start in 40, so the first call's loss and z-loss differed in the 6th digit. One serial
// call of each function LibTorch runs on VML (ATen/cpu/vml.h, IMPLEMENT_VML_MKL), for fp32 and
// fp64, on a one-element tensor (below the grain size, so on this thread only), makes the
// choice before any parallel call can race with it.
void WarmUpCpuMath() {
  static const bool ready = [] {
    torch::NoGradGuard no_grad;
    for (const torch::ScalarType dtype : {torch::kFloat, torch::kDouble}) {
      const torch::Tensor x = torch::full({1}, 0.5, torch::TensorOptions().dtype(dtype));
      for (torch::Tensor (*op)(const torch::Tensor&) :
           {&torch::exp, &torch::log, &torch::log10, &torch::log2, &torch::sqrt, &torch::tanh,
            &torch::sin, &torch::cos, &torch::tan, &torch::asin, &torch::acos, &torch::atan,
            &torch::erf, &torch::erfc, &torch::erfinv, &torch::trunc}) {
        (void)op(x);
      }
    }
    return true;
  }();
  (void)ready;
}

absl::StatusOr<FusedResult> FusedForwardBackward(const Head& head, const TokenBatch& batch,
                                                 const StepOptions& options, GradientBuffers* grads,
                                                 torch::Tensor grad_hidden_out) {
  WarmUpCpuMath();
  return engine_internal::StatusFromExceptions([&] {
    return engine_internal::FusedForwardBackwardImpl(head, batch, options, grads, grad_hidden_out);
  });
}

absl::StatusOr<ForwardResult> Forward(const Head& head, const TokenBatch& batch,
                                      const StepOptions& options) {
  WarmUpCpuMath();
  return engine_internal::StatusFromExceptions(
      [&] { return engine_internal::ForwardImpl(head, batch, options); });
}

absl::StatusOr<BackwardResult> Backward(const Head& head, const TokenBatch& batch,
                                        const StepOptions& options,
                                        const torch::Tensor& grad_output, GradientBuffers* grads,
                                        torch::Tensor grad_hidden_out) {
  WarmUpCpuMath();
  return engine_internal::StatusFromExceptions([&] {
    return engine_internal::BackwardImpl(head, batch, options, grad_output, grads, grad_hidden_out);
  });
}

}  // namespace remotehead::core
