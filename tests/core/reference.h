// The independent reference the engine is tested against: the naive head — full [N, V] logits,
// every function written again from its textbook definition (torch's own cross_entropy,
// log_softmax, an explicit one-hot, …) and differentiated by LibTorch autograd in one piece.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"

// gtest would print Debian's absl::string_view (not std::string_view) as a list of chars.
namespace absl {
ABSL_NAMESPACE_BEGIN
inline void PrintTo(string_view s, std::ostream* os) { *os << '"' << std::string(s) << '"'; }
ABSL_NAMESPACE_END
}  // namespace absl

namespace remotehead::reference {

struct ReferenceResult {
  torch::Tensor output;       // per-token [N] (reduction none) or the 0-d loss
  torch::Tensor grad_hidden;  // [N, D]
  torch::Tensor grad_weight;  // [V, D]
  torch::Tensor grad_bias;    // [V] or undefined
};

// Computes in float64 from the head's (exactly representable) values. The upstream gradient
// is `grad_output` when defined ([N] for none, scalar otherwise), else options.upstream_scale.
ReferenceResult NaiveReference(const core::Head& head, const core::TokenBatch& batch,
                               const core::StepOptions& options,
                               const torch::Tensor& grad_output = {});

// Per-token values of the function alone on float64 logits (the reference's definitions).
torch::Tensor ReferencePerToken(const std::string& function, const torch::Tensor& logits,
                                const core::TokenBatch& batch, const torch::Tensor& safe_targets,
                                const core::FunctionParams& params);

// max |a − b| as a double (tensors converted to float64 on the CPU).
double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b);
// max |a|.
double MaxAbs(const torch::Tensor& a);

// The error of `actual` relative to the reference's magnitude: max |actual − expected| /
// max(max |expected|, floor). Every numerical bound in the tests is stated this way, so that it
// holds whatever BLAS kernels (and summation orders) a machine has: an absolute bound of 1e-7 on
// dX failed at 3e-7 on another CPU of the same kind. An all-zero reference (and floor 0) gives
// 0 for an all-zero `actual` and infinity otherwise.
double RelativeError(const torch::Tensor& actual, const torch::Tensor& expected,
                     double floor = 0.0);
double RelativeError(double actual, double expected, double floor = 0.0);

}  // namespace remotehead::reference

namespace remotehead::reference {

// A head with W ~ N(0, 0.02²)·scale chosen so that logits are O(1) for unit-variance hidden.
std::unique_ptr<core::Head> MakeTestHead(int64_t vocab, int64_t hidden, torch::ScalarType dtype,
                                         bool bias, uint64_t seed = 1,
                                         torch::ScalarType grad_dtype = torch::kFloat,
                                         torch::Device device = torch::kCPU);

// Random hidden states, targets with ~20% ignore_index (-100), and whatever the function and
// reduction need: weights for weighted_sum; advantages, old / ref log-probs for grpo (old and
// ref are the head's true log-probs plus noise, so both clip sides and the KL are exercised).
// Drawn on the CPU (the same values whatever the device), then moved to the head's device.
core::TokenBatch MakeTestBatch(const core::Head& head, int64_t rows, const std::string& function,
                               core::Reduction reduction, uint64_t seed = 2);

}  // namespace remotehead::reference
