// Engine vs the naive full-logits reference (float64 autograd on the CPU), for every function
// (with its defaults, each own param, softcap + temperature, all options: function_cases.h) ×
// reduction × mode × bias × dtype × device (CPU, and CUDA when the machine has a GPU), each at
// chunk sizes {1, 7, 64, N, N+5} with N = 67 (not a multiple of any of them), function blocks
// smaller than, equal to and larger than the chunk, and ~20% of the targets set to ignore_index;
// a bf16 head also at chunks of 7 in blocks of 3 under CUDA's plan rules (core::PlanRules).
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "support/devices.h"

namespace remotehead {
namespace {

using core::Reduction;

using reference::FunctionCase;

// Every registered function with its defaults, each own param, softcap + temperature, and all
// options together (function_cases.h).
const std::vector<FunctionCase>& Cases() {
  static const auto* cases = new std::vector<FunctionCase>(reference::DerivedCases());
  return *cases;
}

enum class Mode { kFused, kTwoPhase };

using Param = std::tuple<FunctionCase, Reduction, Mode, bool /*bias*/, torch::ScalarType,
                         std::string /*device*/>;

class EngineParity : public ::testing::TestWithParam<Param> {};

constexpr int64_t kVocab = 97;
constexpr int64_t kHidden = 24;
constexpr int64_t kRows = 67;

// Error allowed relative to the reference's magnitude (reference::RelativeError, with
// magnitudes below kFloor counted as kFloor): fp32 is near-exact (CUDA's fp32 GEMMs do not
// use TF32 unless a program asks); bf16 logits, dX and (on CUDA) the dz the dW GEMM reads are
// rounded to 8 mantissa bits, so its budget is a few bf16 ulps.
double Tolerance(torch::ScalarType dtype) { return dtype == torch::kFloat ? 2e-5 : 3e-2; }
constexpr double kFloor = 1e-3;

TEST_P(EngineParity, MatchesNaiveReferenceAtEveryChunkSize) {
  const auto& [fcase, reduction, mode, bias, dtype, device_name] = GetParam();
  const torch::Device device(device_name);
  REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device);
  torch::manual_seed(0);
  auto head =
      reference::MakeTestHead(kVocab, kHidden, dtype, bias, /*seed=*/1, torch::kFloat, device);
  const core::TokenBatch batch = reference::MakeTestBatch(*head, kRows, fcase.function, reduction);

  core::StepOptions options;
  options.function = fcase.function;
  options.teacher = reference::TestTeacher(*head, fcase.function);
  options.params = fcase.params;
  options.reduction = reduction;
  options.upstream_scale = 0.5;  // the fused mode's known upstream gradient (e.g. a loss scale)
  // Two-phase: the trainer's upstream gradient, per token for none, else a scalar.
  torch::Tensor grad_output;
  if (mode == Mode::kTwoPhase) {
    grad_output =
        reduction == Reduction::kNone ? torch::randn({kRows}) : torch::full({}, 0.5, torch::kFloat);
    grad_output = grad_output.to(device);
  }
  const reference::ReferenceResult ref =
      reference::NaiveReference(*head, batch, options, grad_output);
  ASSERT_GT(reference::MaxAbs(ref.grad_weight), 0.0) << "reference gradient is trivially zero";

  // …and a bf16 head's chunks of several blocks under CUDA's plan rules (core::PlanRules): each
  // block's gradient written over the chunk's logits, dW accumulating it rounded.
  std::vector<std::tuple<int64_t, int64_t, core::PlanRules>> chunk_and_block = {
      {1, 0, core::PlanRules::kDevice},
      {7, 3, core::PlanRules::kDevice},
      {64, 5, core::PlanRules::kDevice},
      {kRows, 0, core::PlanRules::kDevice},
      {kRows + 5, 16, core::PlanRules::kDevice}};
  if (dtype != torch::kFloat) chunk_and_block.emplace_back(7, 3, core::PlanRules::kCuda);
  for (const auto& [chunk, block, rules] : chunk_and_block) {
    SCOPED_TRACE("chunk_rows=" + std::to_string(chunk) + " block_rows=" + std::to_string(block) +
                 (rules == core::PlanRules::kCuda ? " CUDA's plan rules" : ""));
    options.chunk_rows = chunk;
    options.block_rows = block;
    options.plan_rules = rules;
    core::GradientBuffers grads = head->NewGradientBuffers();
    torch::Tensor grad_hidden;
    if (mode == Mode::kFused) {
      auto result = core::FusedForwardBackward(*head, batch, options, &grads);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_LE(reference::RelativeError(result->loss, ref.output.item<double>(), kFloor),
                Tolerance(dtype));
      EXPECT_EQ(result->stats.chunk_rows, std::min(chunk, kRows));
      EXPECT_EQ(result->stats.num_chunks, (kRows + chunk - 1) / chunk);
      EXPECT_EQ(result->stats.block_rows, block > 0 ? block : std::min(chunk, kRows));
      grad_hidden = result->grad_hidden;
    } else {
      auto forward = core::Forward(*head, batch, options);
      ASSERT_TRUE(forward.ok()) << forward.status();
      EXPECT_EQ(forward->output.sizes(), ref.output.sizes());
      EXPECT_LE(reference::RelativeError(forward->output, ref.output, kFloor), Tolerance(dtype));
      auto backward = core::Backward(*head, batch, options, grad_output, &grads);
      ASSERT_TRUE(backward.ok()) << backward.status();
      grad_hidden = backward->grad_hidden;
      EXPECT_EQ(backward->stats.valid_tokens, forward->stats.valid_tokens);
      EXPECT_EQ(backward->stats.num_chunks, forward->stats.num_chunks);
    }
    EXPECT_EQ(grad_hidden.scalar_type(), dtype);
    EXPECT_EQ(grad_hidden.device(), device);
    EXPECT_LE(reference::RelativeError(grad_hidden, ref.grad_hidden, kFloor), Tolerance(dtype));
    EXPECT_EQ(grads.weight.scalar_type(), torch::kFloat);
    EXPECT_LE(reference::RelativeError(grads.weight, ref.grad_weight, kFloor), Tolerance(dtype));
    if (bias) {
      EXPECT_LE(reference::RelativeError(grads.bias, ref.grad_bias, kFloor), Tolerance(dtype));
    }
  }
}

std::vector<Param> AllParams() {
  std::vector<Param> params;
  for (const FunctionCase& c : Cases()) {
    for (Reduction r :
         {Reduction::kNone, Reduction::kSum, Reduction::kMean, Reduction::kWeightedSum}) {
      for (Mode m : {Mode::kFused, Mode::kTwoPhase}) {
        if (m == Mode::kFused && r == Reduction::kNone) continue;  // fused needs a scalar loss
        for (bool bias : {false, true}) {
          for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
            for (const std::string& device : testing::TestDevices()) {
              params.emplace_back(c, r, m, bias, dtype, device);
            }
          }
        }
      }
    }
  }
  return params;
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto& [fcase, reduction, mode, bias, dtype, device] = info.param;
  return fcase.label + "_" + std::string(core::ReductionName(reduction)) + "_" +
         (mode == Mode::kFused ? "fused" : "twophase") + (bias ? "_bias" : "_nobias") + "_" +
         (dtype == torch::kFloat ? "fp32" : "bf16") + "_" + testing::DeviceLabel(device);
}

INSTANTIATE_TEST_SUITE_P(AllFunctions, EngineParity, ::testing::ValuesIn(AllParams()), ParamName);

// The seed solutions divided a chunk's mean by the chunk count; a mean must be over the valid
// tokens of the whole call. Put every ignored token in the first chunks to make that visible.
TEST(EngineChunking, MeanIsOverAllValidTokensWhateverTheChunking) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  batch.targets.narrow(0, 0, 40).fill_(-100);
  batch.targets.narrow(0, 40, kRows - 40).clamp_min_(0);
  core::StepOptions options;
  const reference::ReferenceResult ref = reference::NaiveReference(*head, batch, options);
  for (const int64_t chunk : {int64_t{8}, int64_t{33}, kRows}) {
    options.chunk_rows = chunk;
    auto result = core::FusedForwardBackward(*head, batch, options, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->stats.valid_tokens, kRows - 40);
    EXPECT_LE(reference::RelativeError(result->loss, ref.output.item<double>()), 2e-5)
        << "chunk_rows=" << chunk;
    EXPECT_LE(reference::RelativeError(result->grad_hidden, ref.grad_hidden), 2e-5);
  }
}

// A preallocated dX buffer is written in place, and `grads == nullptr` (a frozen head) leaves
// no trace on the head's accumulators.
TEST(EngineOutputs, WritesIntoGivenGradHiddenAndSkipsFrozenWeights) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, true);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  torch::Tensor out = torch::full({kRows, kHidden}, 7.0);
  const void* storage = out.data_ptr();
  auto result = core::FusedForwardBackward(*head, batch, {}, nullptr, out);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->grad_hidden.data_ptr(), storage);
  const reference::ReferenceResult ref = reference::NaiveReference(*head, batch, {});
  EXPECT_LE(reference::RelativeError(out, ref.grad_hidden), 2e-5);
  EXPECT_EQ(reference::MaxAbs(head->grads().weight), 0.0);
  EXPECT_EQ(reference::MaxAbs(head->grads().bias), 0.0);
}

// Extras are sums over valid tokens: nll's sum / valid tokens equals the unsmoothed mean CE.
TEST(EngineOutputs, ExtrasAreSumsOverValidTokens) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  core::StepOptions smoothed;
  smoothed.params = {{"label_smoothing", 0.2}, {"z_loss", 1e-2}};
  auto result = core::FusedForwardBackward(*head, batch, smoothed, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  const reference::ReferenceResult plain = reference::NaiveReference(*head, batch, {});
  EXPECT_LE(reference::RelativeError(result->stats.extras.at("nll") / result->stats.valid_tokens,
                                     plain.output.item<double>()),
            2e-5);
  EXPECT_GT(result->stats.extras.at("z_loss"), 0.0);
}

}  // namespace
}  // namespace remotehead
