#include "remotehead/core/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {
namespace {

absl::Status CheckRange(const char* field, double value, double lo, double hi, bool lo_open) {
  const bool ok = std::isfinite(value) && (lo_open ? value > lo : value >= lo) && value < hi;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": expected a finite value in ", lo_open ? "(" : "[", lo, ", ", hi, "); got ", value));
}

absl::Status CheckState(const char* kind, double grad_scale, const OptimizerState& state) {
  if (!std::isfinite(grad_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_scale: expected a finite value; got ", grad_scale));
  }
  if (!state.kind.empty() && state.kind != kind) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optimizer: expected ", state.kind, " (this head's optimizer state); got ", kind));
  }
  return absl::OkStatus();
}

// Applies `update(p, g, buf1, buf2)` to the weight and (if any) the bias in the head's
// accumulation dtype (float64 for a float64 head, float32 for the others: a half-precision
// parameter is updated in fp32 and rounded back once). State kept in another dtype (restored from
// a state file written before float64 heads kept float64 state) is converted once.
template <typename Update>
void ForEachParam(Head& head, double grad_scale, OptimizerState* state, Update&& update) {
  torch::NoGradGuard no_grad;
  const torch::ScalarType dtype = AccumulationDtype(head.dtype());
  auto apply = [&](torch::Tensor& param, const torch::Tensor& grad, torch::Tensor& buf1,
                   torch::Tensor& buf2) {
    for (torch::Tensor* buf : {&buf1, &buf2}) {
      if (buf->defined() && buf->scalar_type() != dtype) *buf = buf->to(dtype);
    }
    torch::Tensor p = param.to(dtype);
    const torch::Tensor g = grad.to(dtype) * grad_scale;
    update(p, g, buf1, buf2);
    if (p.data_ptr() != param.data_ptr()) param.copy_(p);
  };
  apply(head.mutable_weight(), head.grads().weight, state->weight_buf1, state->weight_buf2);
  if (head.has_bias()) {
    apply(head.mutable_bias(), head.grads().bias, state->bias_buf1, state->bias_buf2);
  }
}

int64_t BytesIfDefined(const torch::Tensor& t) { return t.defined() ? t.nbytes() : 0; }

// Bytes after a step of `kind` that keeps `buffers` buffers per parameter, each in the head's
// accumulation dtype (ForEachParam's).
int64_t BytesAfterStep(const Head& head, const OptimizerState& state, const char* kind,
                       int buffers) {
  const int64_t current = OptimizerStateBytes(state);
  if (!state.kind.empty() && state.kind != kind) return current;
  const int64_t parameters =
      head.vocab_size() * head.hidden_size() + (head.has_bias() ? head.vocab_size() : 0);
  const auto element = static_cast<int64_t>(c10::elementSize(AccumulationDtype(head.dtype())));
  return std::max(current, buffers * parameters * element);
}

}  // namespace

int64_t OptimizerStateBytes(const OptimizerState& state) {
  return BytesIfDefined(state.weight_buf1) + BytesIfDefined(state.weight_buf2) +
         BytesIfDefined(state.bias_buf1) + BytesIfDefined(state.bias_buf2);
}

int64_t OptimizerStateBytesAfterStep(const Head& head, const OptimizerState& state,
                                     const SgdOptions& options) {
  return BytesAfterStep(head, state, "sgd", options.momentum != 0 ? 1 : 0);
}

int64_t OptimizerStateBytesAfterStep(const Head& head, const OptimizerState& state,
                                     const AdamWOptions&) {
  return BytesAfterStep(head, state, "adamw", 2);
}

absl::Status CheckOptimizerStep(const OptimizerState& state, const SgdOptions& o,
                                double grad_scale) {
  RETURN_IF_ERROR(CheckRange("sgd.lr", o.lr, 0, INFINITY, false));  // 0: a no-op, as torch
  RETURN_IF_ERROR(CheckRange("sgd.momentum", o.momentum, 0, 1, false));
  RETURN_IF_ERROR(CheckRange("sgd.weight_decay", o.weight_decay, 0, INFINITY, false));
  return CheckState("sgd", grad_scale, state);
}

absl::Status CheckOptimizerStep(const OptimizerState& state, const AdamWOptions& o,
                                double grad_scale) {
  RETURN_IF_ERROR(CheckRange("adamw.lr", o.lr, 0, INFINITY, false));
  RETURN_IF_ERROR(CheckRange("adamw.beta1", o.beta1, 0, 1, false));
  RETURN_IF_ERROR(CheckRange("adamw.beta2", o.beta2, 0, 1, false));
  RETURN_IF_ERROR(CheckRange("adamw.eps", o.eps, 0, INFINITY, true));
  RETURN_IF_ERROR(CheckRange("adamw.weight_decay", o.weight_decay, 0, INFINITY, false));
  return CheckState("adamw", grad_scale, state);
}

absl::Status SgdStep(Head& head, const SgdOptions& o, double grad_scale, OptimizerState* state) {
  RETURN_IF_ERROR(CheckOptimizerStep(*state, o, grad_scale));
  state->kind = "sgd";
  ForEachParam(head, grad_scale, state,
               [&](torch::Tensor& p, const torch::Tensor& g, torch::Tensor& buf, torch::Tensor&) {
                 torch::Tensor d = o.weight_decay != 0 ? g + o.weight_decay * p : g;
                 if (o.momentum != 0) {
                   if (!buf.defined()) {
                     buf = d.clone();
                   } else {
                     buf.mul_(o.momentum).add_(d);
                   }
                   d = buf;
                 }
                 p.add_(d, -o.lr);
               });
  ++state->steps;
  state->hyper_parameters = {
      {"lr", o.lr}, {"momentum", o.momentum}, {"weight_decay", o.weight_decay}};
  head.BumpVersion();
  return absl::OkStatus();
}

absl::Status AdamWStep(Head& head, const AdamWOptions& o, double grad_scale,
                       OptimizerState* state) {
  RETURN_IF_ERROR(CheckOptimizerStep(*state, o, grad_scale));
  state->kind = "adamw";
  const int64_t t = state->steps + 1;
  const double bias_correction1 = 1 - std::pow(o.beta1, t);
  const double bias_correction2 = 1 - std::pow(o.beta2, t);
  ForEachParam(head, grad_scale, state,
               [&](torch::Tensor& p, const torch::Tensor& g, torch::Tensor& m, torch::Tensor& v) {
                 if (!m.defined()) {
                   m = torch::zeros_like(p);
                   v = torch::zeros_like(p);
                 }
                 p.mul_(1 - o.lr * o.weight_decay);
                 m.lerp_(g, 1 - o.beta1);
                 v.mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
                 const torch::Tensor denom = (v.sqrt() / std::sqrt(bias_correction2)).add_(o.eps);
                 p.addcdiv_(m, denom, -o.lr / bias_correction1);
               });
  state->steps = t;
  state->hyper_parameters = {{"lr", o.lr},
                             {"beta1", o.beta1},
                             {"beta2", o.beta2},
                             {"eps", o.eps},
                             {"weight_decay", o.weight_decay}};
  head.BumpVersion();
  return absl::OkStatus();
}

}  // namespace remotehead::core
