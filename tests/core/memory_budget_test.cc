// Memory: a call's transient peak (measured, not computed from shapes: by the counting CPU
// allocator, and on CUDA by the caching allocator's statistics) stays within
// memory_budget_bytes for every function, mode, dtype and device, and does not grow with the
// number of rows N — with the autograd blocks and, for the functions the fused kernel covers,
// with fused blocks (StepOptions::fused_blocks: the chunk is the block, dz over the logits).
#include <gtest/gtest.h>

#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/memory_stats.h"
#include "support/devices.h"

namespace remotehead {
namespace {

using core::Reduction;

constexpr int64_t kVocab = 2000;
constexpr int64_t kHidden = 256;
constexpr int64_t kBudget = int64_t{2} << 20;

struct Measured {
  int64_t peak_bytes;  // peak during the call minus what was allocated just before it
  int64_t chunk_rows;
};

enum class Mode { kFused, kForward, kBackward };

// Inputs, gradient buffers and the dX output are allocated before measuring, as in a trainer.
// On CUDA one unmeasured call first: cuBLAS allocates its workspace (through the caching
// allocator) on a stream's first GEMM and keeps it, as a server does after its first step.
Measured MeasureCall(const core::Head& head, int64_t rows, const std::string& function,
                     const core::FunctionParams& params, Mode mode,
                     std::optional<torch::ScalarType> logits_dtype, bool fused,
                     core::PlanRules rules) {
  const torch::Device device = head.device();
  if (!device.is_cuda()) core::InstallCpuMemoryTracker();
  const core::TokenBatch batch = reference::MakeTestBatch(head, rows, function, Reduction::kMean);
  core::GradientBuffers grads = head.NewGradientBuffers();
  torch::Tensor grad_hidden = torch::empty({rows, kHidden}, head.weight().options());
  const torch::Tensor grad_output = torch::ones({}, torch::TensorOptions().device(device));
  core::StepOptions options{.function = function,
                            .params = params,
                            .memory_budget_bytes = kBudget,
                            .fused_blocks = fused,
                            .logits_dtype = logits_dtype,
                            .teacher = reference::TestTeacher(head, function)};
  options.plan_rules = rules;
  auto plan = core::PlanCall(head, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->fused, fused);
  auto call = [&] {
    switch (mode) {
      case Mode::kFused:
        return core::FusedForwardBackward(head, batch, options, &grads, grad_hidden).ok();
      case Mode::kForward:
        return core::Forward(head, batch, options).ok();
      case Mode::kBackward:
        return core::Backward(head, batch, options, grad_output, &grads, grad_hidden).ok();
    }
    return false;
  };
  if (device.is_cuda()) {
    EXPECT_TRUE(call());
  }

  EXPECT_TRUE(core::ResetPeakMemory(device).ok());
  const int64_t before = core::GetMemoryStats(device)->allocated_bytes;
  EXPECT_TRUE(call());
  return {core::GetMemoryStats(device)->peak_allocated_bytes - before, plan->chunk_rows};
}

using reference::FunctionCase;

// Whether the fused kernel computes this case's blocks when asked (CallPlan::fused).
bool FusedCovers(const FunctionCase& c) {
  auto head = reference::MakeTestHead(16, 8, torch::kFloat, false);
  auto plan = core::PlanCall(*head, {.function = c.function, .params = c.params,
                                     .fused_blocks = true,
                                     .teacher = reference::TestTeacher(*head, c.function)});
  return plan.ok() && plan->fused;
}

class MemoryBudget : public ::testing::TestWithParam<std::tuple<FunctionCase, std::string>> {};

TEST_P(MemoryBudget, PeakStaysWithinBudgetAndFlatInRows) {
  const auto& [c, device_name] = GetParam();
  const torch::Device device(device_name);
  REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device);
  // The head's dtype, the dtype its logits are formed in (StepOptions::logits_dtype), and the
  // plan's rules: a bf16 head's autograd blocks also under CUDA's (core::PlanRules: blocks by
  // the budget alone, the gradient over the logits; a fused call's plan is the same by both).
  struct Dtypes {
    torch::ScalarType dtype;
    std::optional<torch::ScalarType> logits_dtype;
    core::PlanRules rules = core::PlanRules::kDevice;
  };
  const Dtypes dtypes[] = {{torch::kFloat, std::nullopt},
                           {torch::kBFloat16, std::nullopt},
                           {torch::kBFloat16, torch::kFloat},
                           {torch::kBFloat16, std::nullopt, core::PlanRules::kCuda}};
  for (const bool fused : {false, true}) {
    if (fused && !FusedCovers(c)) continue;
    for (const auto& [dtype, logits_dtype, rules] : dtypes)
    for (Mode mode : {Mode::kFused, Mode::kForward, Mode::kBackward}) {
      if (fused && rules == core::PlanRules::kCuda) continue;
      const bool cuda_rules = rules == core::PlanRules::kCuda;
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (logits_dtype ? " fp32 logits" : "") +
                   " mode " + std::to_string(static_cast<int>(mode)) +
                   (fused ? " fused blocks" : "") + (cuda_rules ? " CUDA's plan rules" : ""));
      auto head = reference::MakeTestHead(kVocab, kHidden, dtype, /*bias=*/true, /*seed=*/1,
                                          torch::kFloat, device);
      const Measured small =
          MeasureCall(*head, 600, c.function, c.params, mode, logits_dtype, fused, rules);
      const Measured large =
          MeasureCall(*head, 2400, c.function, c.params, mode, logits_dtype, fused, rules);
      ASSERT_LT(small.chunk_rows, 600) << "the budget must force chunking";
      EXPECT_GT(small.peak_bytes, kBudget / 8) << "measurement sees the chunk buffers";
      // fp32, and anything on CUDA (its bf16 dW GEMM writes into the fp32 accumulator, with no
      // fp32 copy of W, dz or X): everything the call allocates is within the budget. bf16 on
      // the CPU: oneDNN's half-precision GEMMs also allocate scratch of their own that the
      // budget does not model (flat in N, ~0.3 of the budget at this tiny shape), hence the
      // allowance. fp32 logits of a bf16 head run every CPU GEMM in fp32 (on W's slices): no
      // oneDNN scratch.
      const double allowed =
          dtype == torch::kFloat || device.is_cuda() || logits_dtype ? kBudget : 1.5 * kBudget;
      EXPECT_LE(small.peak_bytes, allowed);
      EXPECT_LE(large.peak_bytes, allowed);
      // 4× the rows: only O(N) bookkeeping (masks, per-token sums) may grow, a few bytes a row.
      EXPECT_LE(large.peak_bytes, small.peak_bytes + 64 * (2400 - 600))
          << "small=" << small.peak_bytes << " large=" << large.peak_bytes;
    }
  }
}

// Every registered function with its defaults and, if it has own params, with all options
// (function_cases.h).
INSTANTIATE_TEST_SUITE_P(
    AllFunctions, MemoryBudget,
    ::testing::Combine(
        ::testing::ValuesIn(reference::DerivedCases(reference::CaseSet::kDefaultsAndAllOptions)),
        ::testing::ValuesIn(testing::TestDevices())),
    [](const ::testing::TestParamInfo<std::tuple<FunctionCase, std::string>>& info) {
      return std::get<0>(info.param).label + "_" + testing::DeviceLabel(std::get<1>(info.param));
    });

// The sampler's costliest settings (function_cases.h): its sort of up to whole rows is counted.
INSTANTIATE_TEST_SUITE_P(
    Sampler, MemoryBudget,
    ::testing::Combine(::testing::ValuesIn(reference::SamplerMemoryCases()),
                       ::testing::ValuesIn(testing::TestDevices())),
    [](const ::testing::TestParamInfo<std::tuple<FunctionCase, std::string>>& info) {
      return std::get<0>(info.param).label + "_" + testing::DeviceLabel(std::get<1>(info.param));
    });

// The default plan of each device (no chunk_rows, budget or block_rows given), at a large
// vocabulary: on a CPU, blocks of at most 2 MiB of fp32 logits (they stay in the caches) within
// the CPU's 96 MiB; on a GPU, the 1 GiB budget and blocks as large as its quarter allows (a GPU
// kernel over a few rows costs its launch: the CPU's rules made a GPU step 30x slower).
class DefaultPlan : public ::testing::TestWithParam<std::string> {};

TEST_P(DefaultPlan, BlocksAndChunksSuitTheDevice) {
  const torch::Device device(GetParam());
  REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device);
  constexpr int64_t kLargeVocab = 128000;
  auto head = reference::MakeTestHead(kLargeVocab, 64, torch::kBFloat16, /*bias=*/false,
                                      /*seed=*/1, torch::kFloat, device);
  core::StepOptions options;
  options.params[core::kSoftcapParam] = 30.0;
  auto plan = core::PlanCall(*head, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const double budget = static_cast<double>(core::DefaultMemoryBudgetBytes(device));
  const double block = static_cast<double>(plan->block_rows) * plan->block_row_bytes;
  EXPECT_LE(block, 0.25 * budget);
  if (device.is_cuda()) {
    EXPECT_EQ(core::DefaultMemoryBudgetBytes(device), core::kDefaultCudaMemoryBudgetBytes);
    EXPECT_GT(block + plan->block_row_bytes, 0.25 * budget) << "the quarter is the only limit";
    EXPECT_GE(plan->block_rows, 32);
    EXPECT_GE(plan->chunk_rows, 256);
  } else {
    EXPECT_EQ(core::DefaultMemoryBudgetBytes(device), core::kDefaultMemoryBudgetBytes);
    EXPECT_LE(plan->block_rows * kLargeVocab * 4, core::kFunctionBlockBytes);
    EXPECT_GE(plan->chunk_rows, plan->block_rows);
  }
}

// CUDA's rules asked of a CPU head (StepOptions::plan_rules): the GPU's budget and blocks, and
// no fp32 gradient buffer — the CPU's tests of the GPU's plan.
TEST(DefaultPlanRules, CudaRulesOnACpuHeadPlanAsAGpuDoes) {
  constexpr int64_t kLargeVocab = 128000;
  auto head = reference::MakeTestHead(kLargeVocab, 64, torch::kBFloat16, /*bias=*/false);
  core::StepOptions options;
  options.params[core::kSoftcapParam] = 30.0;
  auto cpu = core::PlanCall(*head, options);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  options.plan_rules = core::PlanRules::kCuda;
  auto cuda = core::PlanCall(*head, options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const double budget = static_cast<double>(core::kDefaultCudaMemoryBudgetBytes);
  EXPECT_EQ(core::DefaultMemoryBudgetBytes(torch::kCPU, core::PlanRules::kCuda),
            core::kDefaultCudaMemoryBudgetBytes);
  const double block = static_cast<double>(cuda->block_rows) * cuda->block_row_bytes;
  EXPECT_LE(block, 0.25 * budget);
  EXPECT_GT(block + cuda->block_row_bytes, 0.25 * budget) << "the quarter is the only limit";
  EXPECT_GE(cuda->chunk_rows, 256);
  // The gradient: over the bf16 logits under CUDA's rules (dW reads it rounded, through fp32
  // slices of it on this CPU), a separate fp32 buffer of 4 bytes a logit under the CPU's.
  EXPECT_TRUE(cuda->gradient_in_logits);
  EXPECT_GT(cuda->gradient_slice_bytes, 0);
  EXPECT_FALSE(cpu->gradient_in_logits);
  EXPECT_EQ(cpu->gradient_slice_bytes, 0);
  EXPECT_DOUBLE_EQ(cpu->chunk_row_bytes - cuda->chunk_row_bytes, kLargeVocab * 4.0);
}

INSTANTIATE_TEST_SUITE_P(Devices, DefaultPlan, ::testing::ValuesIn(testing::TestDevices()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return testing::DeviceLabel(info.param);
                         });

// A caller-owned logits workspace (a server reusing one across a request's batches) replaces
// the [chunk_rows, V] buffer the call would allocate: the transient peak drops by about that
// buffer, and the results are the same.
TEST(MemoryBudgetWorkspace, LogitsWorkspaceReplacesTheCallsOwnBuffer) {
  core::InstallCpuMemoryTracker();
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 600, "cross_entropy", Reduction::kMean);
  core::StepOptions options{.memory_budget_bytes = kBudget};
  auto measure = [&](const core::StepOptions& o, core::FusedResult* result) {
    EXPECT_TRUE(core::ResetPeakMemory(torch::kCPU).ok());
    const int64_t before = core::GetMemoryStats(torch::kCPU)->allocated_bytes;
    auto r = core::FusedForwardBackward(*head, batch, o, nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    const int64_t peak = core::GetMemoryStats(torch::kCPU)->peak_allocated_bytes - before;
    *result = *std::move(r);
    return peak;
  };
  core::FusedResult own, reused;
  const int64_t own_peak = measure(options, &own);
  const int64_t chunk_rows = own.stats.chunk_rows;
  options.logits_workspace = torch::empty({chunk_rows, kVocab}, head->weight().options());
  const int64_t reused_peak = measure(options, &reused);
  const int64_t buffer_bytes = chunk_rows * kVocab * 4;
  EXPECT_LE(reused_peak, own_peak - buffer_bytes * 9 / 10)
      << "own " << own_peak << " reused " << reused_peak << " buffer " << buffer_bytes;
  EXPECT_EQ(reused.loss, own.loss);
  EXPECT_TRUE(torch::equal(reused.grad_hidden, own.grad_hidden));
}

TEST(MemoryStats, CpuTrackerCountsLiveAndPeakBytes) {
  core::InstallCpuMemoryTracker();
  ASSERT_TRUE(core::ResetPeakMemory(torch::kCPU).ok());
  const int64_t before = core::GetMemoryStats(torch::kCPU)->allocated_bytes;
  {
    torch::Tensor t = torch::empty({1000, 250});  // 1,000,000 bytes
    EXPECT_GE(core::GetMemoryStats(torch::kCPU)->allocated_bytes - before, 1000000);
  }
  const auto after = *core::GetMemoryStats(torch::kCPU);
  EXPECT_EQ(after.allocated_bytes, before);
  EXPECT_GE(after.peak_allocated_bytes - before, 1000000);
}

// CUDA: the caching allocator's statistics, through the same GetMemoryStats / ResetPeakMemory
// the server's metrics read.
TEST(MemoryStats, CudaCountsLiveAndPeakBytes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  ASSERT_TRUE(core::ResetPeakMemory(cuda).ok());
  const int64_t before = core::GetMemoryStats(cuda)->allocated_bytes;
  {
    torch::Tensor t = torch::empty({1 << 20, 16}, torch::TensorOptions().device(cuda));  // 64 MiB
    const auto during = *core::GetMemoryStats(cuda);
    EXPECT_GE(during.allocated_bytes - before, int64_t{64} << 20);
    EXPECT_GE(during.reserved_bytes, during.allocated_bytes);
  }
  const auto after = *core::GetMemoryStats(cuda);
  EXPECT_EQ(after.allocated_bytes, before);
  EXPECT_GE(after.peak_allocated_bytes - before, int64_t{64} << 20);
  ASSERT_TRUE(core::ResetPeakMemory(cuda).ok());
  EXPECT_LT(core::GetMemoryStats(cuda)->peak_allocated_bytes - before, int64_t{64} << 20);
}

// CUDA: what the server plans with is the device's free memory, which a fresh allocation of
// 512 MiB (new to the caching allocator, so cudaMalloc'ed) lowers by about that much.
TEST(MemoryStats, AvailableOnCudaIsTheDevicesFreeMemory) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  torch::empty({1}, torch::TensorOptions().device(cuda));  // the context, before measuring
  const int64_t free_before = *core::AvailableMemoryBytes(cuda);
  torch::Tensor t =
      torch::empty({int64_t{512} << 20}, torch::TensorOptions().device(cuda).dtype(torch::kByte));
  const int64_t free_after = *core::AvailableMemoryBytes(cuda);
  EXPECT_GE(free_before - free_after, int64_t{500} << 20);
  EXPECT_LE(free_before - free_after, int64_t{600} << 20);
}

}  // namespace
}  // namespace remotehead
