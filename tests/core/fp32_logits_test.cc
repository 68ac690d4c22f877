// fp32 logits from a half-precision head's weights (StepOptions::logits_dtype = float32): the
// loss, dX, dW and db of a bf16 head against the float64 reference of the same bf16 values
// (reference.h: the naive head differentiated by autograd) at fp32 accuracy, where the default
// (logits rounded to bf16) is measurably further off, and under CUDA's plan rules (dz split into
// bf16 hi + lo for the backward's GEMMs) near it; every chunking the same result; a
// two-head function's teacher the same way; unset meaning the head's dtype; float32 a no-op on
// float32 / float64 heads; any other dtype refused.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "core/reference.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/engine.h"
#include "support/devices.h"

namespace remotehead {
namespace {

using core::Reduction;

constexpr int64_t kVocab = 1003;
constexpr int64_t kHidden = 48;
constexpr int64_t kRows = 61;
// A budget whose sixteenth (CallPlan::weight_slice_bytes) holds 100 rows of fp32 W: the CPU's
// GEMMs run over 11 slices of W, the last one ragged.
constexpr int64_t kSliceBudget = 16 * 100 * kHidden * 4;
constexpr double kFloor = 1e-3;  // reference::RelativeError's floor on magnitudes
// dW and db from dz split into bf16 hi + lo (CallPlan::split_gradient): 2^-16 of each element of
// dz, summed over the rows.
constexpr double kSplitTolerance = 5e-5;

struct Result {
  torch::Tensor output;  // the loss (0-d float64) or per-token outputs
  torch::Tensor grad_hidden;
  torch::Tensor grad_weight;
  torch::Tensor grad_bias;
};

// A fused step for a scalar reduction; Forward then Backward (grad_output) for none.
Result RunStep(const core::Head& head, const core::TokenBatch& batch,
               const core::StepOptions& options, const torch::Tensor& grad_output) {
  core::GradientBuffers grads = head.NewGradientBuffers();
  Result r;
  if (options.reduction != Reduction::kNone) {
    auto fused = core::FusedForwardBackward(head, batch, options, &grads);
    EXPECT_TRUE(fused.ok()) << fused.status();
    if (!fused.ok()) return r;
    r.output = torch::full({}, fused->loss, torch::kDouble);
    r.grad_hidden = fused->grad_hidden;
  } else {
    auto forward = core::Forward(head, batch, options);
    EXPECT_TRUE(forward.ok()) << forward.status();
    auto backward = core::Backward(head, batch, options, grad_output, &grads);
    EXPECT_TRUE(backward.ok()) << backward.status();
    if (!forward.ok() || !backward.ok()) return r;
    r.output = forward->output;
    r.grad_hidden = backward->grad_hidden;
  }
  r.grad_weight = grads.weight;
  r.grad_bias = grads.bias;
  return r;
}

// The largest of the errors of `r` against the reference, by output.
struct Errors {
  double output, grad_hidden, grad_weight, grad_bias;
};

Errors ErrorsOf(const Result& r, const reference::ReferenceResult& ref) {
  return {
      reference::RelativeError(r.output, ref.output, kFloor),
      reference::RelativeError(r.grad_hidden, ref.grad_hidden, kFloor),
      reference::RelativeError(r.grad_weight, ref.grad_weight, kFloor),
      ref.grad_bias.defined() ? reference::RelativeError(r.grad_bias, ref.grad_bias, kFloor) : 0.0};
}

// function, reduction, bias, device
using Param = std::tuple<std::string, Reduction, bool, std::string>;

class Fp32Logits : public ::testing::TestWithParam<Param> {};

TEST_P(Fp32Logits, MatchTheFloat64ReferenceAtFp32AccuracyAtEveryChunking) {
  const auto& [function, reduction, bias, device_name] = GetParam();
  const torch::Device device(device_name);
  REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device);
  torch::manual_seed(0);
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kBFloat16, bias, /*seed=*/1,
                                      torch::kFloat, device);
  const core::TokenBatch batch = reference::MakeTestBatch(*head, kRows, function, reduction);
  core::StepOptions options{.function = function,
                            .reduction = reduction,
                            .memory_budget_bytes = kSliceBudget,
                            .teacher = reference::TestTeacher(*head, function)};
  const torch::Tensor grad_output =
      reduction == Reduction::kNone ? torch::randn({kRows}).to(device) : torch::Tensor();
  const reference::ReferenceResult ref =
      reference::NaiveReference(*head, batch, options, grad_output);

  std::vector<Result> fp32_results;
  for (const int64_t chunk_rows : {int64_t{1}, int64_t{7}, kRows}) {
    SCOPED_TRACE("chunk_rows " + std::to_string(chunk_rows));
    options.chunk_rows = chunk_rows;
    options.logits_dtype = std::nullopt;
    const Errors bf16 = ErrorsOf(RunStep(*head, batch, options, grad_output), ref);
    options.logits_dtype = torch::kFloat;
    const Result result = RunStep(*head, batch, options, grad_output);
    ASSERT_TRUE(result.grad_weight.defined());
    const Errors fp32 = ErrorsOf(result, ref);
    // fp32 logits: the loss, dW (an fp32 accumulator) and db are exact to fp32 rounding; dX is
    // rounded once to bf16 (8 bits: 2^-8 of the largest value bounds it). On a GPU the plan
    // splits dz (below).
    const double dw_tolerance = device.is_cuda() ? kSplitTolerance : 1e-5;
    EXPECT_LE(fp32.output, 1e-5);
    EXPECT_LE(fp32.grad_weight, dw_tolerance);
    EXPECT_LE(fp32.grad_bias, dw_tolerance);
    EXPECT_LE(fp32.grad_hidden, 1.0 / 256);
    // CUDA's plan rules: the backward's GEMMs read dz as bf16 hi + lo (CallPlan::split_gradient,
    // summed back on this CPU): dW and db to about 2^-16 of dz, still far from bf16 logits' error.
    options.plan_rules = core::PlanRules::kCuda;
    const Errors split = ErrorsOf(RunStep(*head, batch, options, grad_output), ref);
    options.plan_rules = core::PlanRules::kDevice;
    EXPECT_LE(split.output, 1e-5);
    EXPECT_LE(split.grad_weight, kSplitTolerance);
    EXPECT_LE(split.grad_bias, kSplitTolerance);
    EXPECT_LE(split.grad_hidden, 1.0 / 256);
    EXPECT_GE(bf16.grad_weight, 10 * split.grad_weight)
        << "bf16 " << bf16.grad_weight << " split " << split.grad_weight;
    RecordProperty("dw_error_split_chunk" + std::to_string(chunk_rows), c10::str(split.grad_weight));
    // The default's bf16 logits (and, for dX, bf16 dz) are further off: here the error the
    // option removes.
    EXPECT_GE(bf16.output, 10 * fp32.output) << "bf16 " << bf16.output << " fp32 " << fp32.output;
    EXPECT_GE(bf16.grad_weight, 10 * fp32.grad_weight)
        << "bf16 " << bf16.grad_weight << " fp32 " << fp32.grad_weight;
    RecordProperty("loss_error_bf16_logits_chunk" + std::to_string(chunk_rows),
                   c10::str(bf16.output));
    RecordProperty("loss_error_fp32_logits_chunk" + std::to_string(chunk_rows),
                   c10::str(fp32.output));
    RecordProperty("dw_error_bf16_logits_chunk" + std::to_string(chunk_rows),
                   c10::str(bf16.grad_weight));
    RecordProperty("dw_error_fp32_logits_chunk" + std::to_string(chunk_rows),
                   c10::str(fp32.grad_weight));
    fp32_results.push_back(result);
  }
  // Every chunking: the same result up to fp32 summation order.
  for (const Result& r : fp32_results) {
    EXPECT_LE(reference::RelativeError(r.output, fp32_results[0].output, kFloor), 1e-6);
    EXPECT_LE(reference::RelativeError(r.grad_weight, fp32_results[0].grad_weight, kFloor), 1e-6);
    EXPECT_LE(reference::RelativeError(r.grad_hidden.to(torch::kFloat),
                                       fp32_results[0].grad_hidden.to(torch::kFloat), kFloor),
              1.0 / 256);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Functions, Fp32Logits,
    ::testing::Combine(::testing::Values("cross_entropy", "token_logprobs", "distill_kl"),
                       ::testing::Values(Reduction::kMean, Reduction::kNone), ::testing::Bool(),
                       ::testing::ValuesIn(testing::TestDevices())),
    [](const ::testing::TestParamInfo<Param>& info) {
      return std::get<0>(info.param) + "_" +
             std::string(core::ReductionName(std::get<1>(info.param))) +
             (std::get<2>(info.param) ? "_bias_" : "_nobias_") +
             testing::DeviceLabel(std::get<3>(info.param));
    });

// The rows of function "logits" (a Forward of no function but the GEMM): unset, the head's
// bf16 product, bit for bit; float32, the fp32 product of the same bf16 values.
TEST(Fp32LogitsRows, UnsetIsTheHeadsDtypeAndFloat32IsTheFp32Product) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kBFloat16, /*bias=*/true);
  torch::manual_seed(3);
  const core::TokenBatch batch{.hidden = torch::randn({kRows, kHidden}).to(torch::kBFloat16)};
  core::StepOptions options{.function = "logits",
                            .reduction = Reduction::kNone,
                            .chunk_rows = 16,
                            .memory_budget_bytes = kSliceBudget};
  auto unset = core::Forward(*head, batch, options);
  ASSERT_TRUE(unset.ok()) << unset.status();
  const torch::Tensor bf16 = torch::addmm(head->bias(), batch.hidden, head->weight().t());
  EXPECT_TRUE(torch::equal(unset->output, bf16.to(torch::kFloat)));

  options.logits_dtype = torch::kFloat;
  auto fp32 = core::Forward(*head, batch, options);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  const torch::Tensor exact =
      torch::addmm(head->bias().to(torch::kDouble), batch.hidden.to(torch::kDouble),
                   head->weight().to(torch::kDouble).t());
  EXPECT_LE(reference::RelativeError(fp32->output, exact), 1e-6);
  EXPECT_GE(reference::RelativeError(unset->output, exact), 1e-3) << "bf16 rounding is visible";

  // The plans: the chunk buffer in the head's dtype, or fp32 with one slice of W on top.
  auto plan_unset = core::PlanCall(*head, {.function = "logits"});
  auto plan_fp32 = core::PlanCall(*head, {.function = "logits", .logits_dtype = torch::kFloat});
  ASSERT_TRUE(plan_unset.ok() && plan_fp32.ok());
  EXPECT_EQ(plan_unset->gemm_dtype, torch::kBFloat16);
  EXPECT_FALSE(plan_unset->fp32_logits_of_half_head);
  EXPECT_EQ(plan_unset->weight_slice_bytes, 0);
  EXPECT_EQ(plan_fp32->gemm_dtype, torch::kFloat);
  EXPECT_TRUE(plan_fp32->fp32_logits_of_half_head);
  EXPECT_EQ(plan_fp32->chunk_row_bytes_forward - plan_unset->chunk_row_bytes_forward, 2.0 * kVocab);
}

// A float32 or float64 head forms its logits in its own dtype already: float32 is accepted and
// changes no bit.
TEST(Fp32LogitsOnFloatHeads, Float32ChangesNothing) {
  for (const torch::ScalarType dtype : {torch::kFloat, torch::kDouble}) {
    SCOPED_TRACE(core::DtypeName(dtype));
    auto head = reference::MakeTestHead(kVocab, kHidden, dtype, /*bias=*/true, 1, dtype);
    const core::TokenBatch batch =
        reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
    core::StepOptions options{.chunk_rows = 7};
    const Result unset = RunStep(*head, batch, options, {});
    options.logits_dtype = torch::kFloat;
    const Result fp32 = RunStep(*head, batch, options, {});
    EXPECT_TRUE(torch::equal(unset.output, fp32.output));
    EXPECT_TRUE(torch::equal(unset.grad_hidden, fp32.grad_hidden));
    EXPECT_TRUE(torch::equal(unset.grad_weight, fp32.grad_weight));
    EXPECT_TRUE(torch::equal(unset.grad_bias, fp32.grad_bias));
  }
}

// Half-precision accumulators (HeadOptions::grad_dtype bf16) and float16 heads take the same
// path: each slice's dW summed in fp32 and rounded once; fp16 logits formed in fp32.
TEST(Fp32LogitsOtherHalfCases, Bf16AccumulatorsAndFloat16Heads) {
  for (const auto& [dtype, grad_dtype] :
       {std::pair{torch::kBFloat16, torch::kBFloat16}, std::pair{torch::kHalf, torch::kFloat}}) {
    SCOPED_TRACE(core::DtypeName(dtype) + " dW in " + core::DtypeName(grad_dtype));
    auto head = reference::MakeTestHead(kVocab, kHidden, dtype, /*bias=*/true, 1, grad_dtype);
    const core::TokenBatch batch =
        reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kSum);
    core::StepOptions options{.reduction = Reduction::kSum,
                              .chunk_rows = 7,
                              .memory_budget_bytes = kSliceBudget,
                              .logits_dtype = torch::kFloat};
    const reference::ReferenceResult ref = reference::NaiveReference(*head, batch, options);
    const Errors e = ErrorsOf(RunStep(*head, batch, options, {}), ref);
    EXPECT_LE(e.output, 1e-5);
    // A bf16 accumulator rounds to 8 bits at each of the 9 chunks' additions.
    EXPECT_LE(e.grad_weight, grad_dtype == torch::kFloat ? 1e-5 : 1.0 / 64);
    EXPECT_LE(e.grad_hidden, 1.0 / 256);
  }
}

TEST(Fp32LogitsValidation, AnyOtherDtypeIsRefusedNamingTheField) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kBFloat16, /*bias=*/false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  core::GradientBuffers grads = head->NewGradientBuffers();
  for (const torch::ScalarType bad :
       {torch::kBFloat16, torch::kHalf, torch::kDouble, torch::kLong}) {
    core::StepOptions options{.logits_dtype = bad};
    auto r = core::FusedForwardBackward(*head, batch, options, &grads);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(),
              "logits_dtype: expected float32 (fp32 logits from the head's bfloat16 weights) or "
              "unset (logits in the head's dtype); got " +
                  core::DtypeName(bad));
  }
  EXPECT_EQ(grads.weight.abs().sum().item<double>(), 0.0) << "a refused call adds nothing";
}

}  // namespace
}  // namespace remotehead
