// The independent reference the engine is tested against: the naive head — full [N, V] logits,
// every function written again from its textbook definition (torch's own cross_entropy,
// log_softmax, an explicit one-hot, …) and differentiated by LibTorch autograd in one piece.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>

#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"

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
// A two-head function's teacher is options.teacher, fed batch.teacher_hidden (no gradient).
ReferenceResult NaiveReference(const core::Head& head, const core::TokenBatch& batch,
                               const core::StepOptions& options,
                               const torch::Tensor& grad_output = {});

// Per-token values of the function alone on float64 logits (the reference's definitions), with
// `params` completed by the registry's defaults (FunctionRegistry::ResolveParams); `teacher_z`
// the teacher's transformed logits for a two-head function; `head_z` the logits as the head
// forms them (HeadLogits; undefined: `logits`), on which a sampled function decides its set.
torch::Tensor ReferencePerToken(const std::string& function, const torch::Tensor& logits,
                                const core::TokenBatch& batch, const torch::Tensor& safe_targets,
                                const core::FunctionParams& params,
                                const torch::Tensor& teacher_z = {},
                                int64_t ignore_index = -100,
                                const torch::Tensor& head_z = {});

// The transformed float64 logits as a head forms them: the product X·Wᵀ + b rounded to the
// head's dtype (its GEMM's output), then scale, softcap and temperature; detached. A sampler's
// kept set is a discrete choice: decided on exact logits instead, a bf16 head's rounding could
// move a token across a boundary and change the result by that token's whole probability.
torch::Tensor HeadLogits(const core::Head& head, const torch::Tensor& hidden,
                         const core::FunctionParams& params);

// The sampler's kept set (core/sampler_kept_set.h) of float64 logits z [N, V] (transforms
// applied) written from its definition: each truncation in its order as a mask over the sorted,
// renormalised distribution; min-p in probabilities (p >= min_p·p_max), as Hugging Face and vLLM
// write it. [N, V] bool; `params` may omit the sampler's (off).
torch::Tensor ReferenceKeptMask(const torch::Tensor& z, const core::FunctionParams& params);

// The reference of one registered function: one entry per name in ReferenceFunctions().
// What a function is (its aux inputs, whether it needs targets, its params, their defaults and
// ranges) is read from the registry's TransformFunction; an entry holds only what the registry
// cannot give: an independent definition, and the test data the tests feed it.
struct ReferenceFunction {
  // z: float64 logits [N, V] (logit scale, softcap and temperature applied); targets: [N] int64
  // with ignored positions set to 0; aux: the batch's per-token inputs, float64 on the CPU
  // (integral ones int64); params: every param of the function, defaults filled in. Returns
  // the per-token values [N].
  using PerToken =
      std::function<torch::Tensor(const torch::Tensor& z, const torch::Tensor& targets,
                                  const core::AuxTensors& aux, const core::FunctionParams& params)>;
  // A two-head function's reference: as PerToken, with the teacher's float64 logits [N, V]
  // (its own scale and softcap, the shared temperature applied) as a constant.
  using TwoHeadPerToken = std::function<torch::Tensor(
      const torch::Tensor& z, const torch::Tensor& teacher_z, const torch::Tensor& targets,
      const core::FunctionParams& params)>;
  // Adds the function's aux inputs to a batch of MakeTestBatch (hidden and targets drawn, on the
  // CPU), drawing from `gen`. Empty: each required and optional aux drawn from N(0, 1).
  using MakeAux =
      std::function<void(const core::Head& head, at::Generator& gen, core::TokenBatch* batch)>;

  // Empty for a generation output (OutputKind other than kPerToken): generation_test has their
  // references (X·Wᵀ for logits, torch::multinomial for sample).
  PerToken per_token;
  TwoHeadPerToken two_head;  // instead of per_token, for a function that needs_teacher
  // Instead of per_token, for a function that scores a sampled token (a sampler's kept set,
  // core/sampler_kept_set.h): as PerToken, with the logits as the head forms them (HeadLogits)
  // to decide the kept set on.
  using SampledPerToken = std::function<torch::Tensor(
      const torch::Tensor& z, const torch::Tensor& head_z, const torch::Tensor& targets,
      const core::AuxTensors& aux, const core::FunctionParams& params)>;
  SampledPerToken sampled;
  MakeAux make_aux;
  // Values the derived cases (function_cases.h) give the function's own params: in range and
  // not the default. A param not named here gets a value derived from its ParamSpec.
  core::FunctionParams test_values;
};

// Every registered function's reference, by name. functions_test fails when a registered
// function has no entry, or an entry names no registered function: adding a function is one
// registration in core/src/functions.cc plus one entry here.
const std::map<std::string, ReferenceFunction>& ReferenceFunctions();

// max |a − b| as a double (tensors converted to float64 on the CPU).
double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b);
// max |a|.
double MaxAbs(const torch::Tensor& a);

// The error of `actual` relative to the reference's magnitude: max |actual − expected| /
// max(max |expected|, floor). Every numerical bound in the tests is stated this way, so that it
// holds whatever BLAS kernels (and summation orders) a machine has: an absolute bound of 1e-7 on
// dX failed at 3e-7 on another CPU of the same kind. An all-zero reference (and floor 0) gives
// 0 for an all-zero `actual` and infinity otherwise. Equal values count as no difference, equal
// infinities included (a log-probability of −inf outside a sampler's kept set), and the magnitude
// is the finite values'; an infinity against anything else is an infinite error, a NaN a NaN.
double RelativeError(const torch::Tensor& actual, const torch::Tensor& expected,
                     double floor = 0.0);
double RelativeError(double actual, double expected, double floor = 0.0);

}  // namespace remotehead::reference

namespace remotehead::reference {

// A head with W ~ N(0, 0.02²)·scale chosen so that logits are O(1) for unit-variance hidden.
std::unique_ptr<core::Head> MakeTestHead(int64_t vocab, int64_t hidden, torch::ScalarType dtype,
                                         bool bias, uint64_t seed = 1,
                                         std::optional<torch::ScalarType> grad_dtype = std::nullopt,
                                         torch::Device device = torch::kCPU);

// The teacher head the tests give a two-head function (TransformFunction::needs_teacher) of a
// student head: the same V, dtype and device, another width (D + 5), a bias, other weights;
// one per student shape, kept for the process. Null for every other function.
const core::Head* TestTeacher(const core::Head& student, const std::string& function);

// Random hidden states, targets with ~20% ignore_index (-100), and whatever the function and
// reduction need: weights for weighted_sum; a two-head function's teacher_hidden (for
// TestTeacher's width); the function's aux inputs, required and optional, as
// its ReferenceFunction::make_aux draws them (for grpo: advantages, and old / ref log-probs that
// are the head's true log-probs plus noise, so both clip sides and the KL are exercised). A name
// the registry does not know gets no aux.
// Drawn on the CPU (the same values whatever the device), then moved to the head's device.
core::TokenBatch MakeTestBatch(const core::Head& head, int64_t rows, const std::string& function,
                               core::Reduction reduction, uint64_t seed = 2);

}  // namespace remotehead::reference
