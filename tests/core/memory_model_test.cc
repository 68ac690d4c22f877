// The engine's memory model (core/call_plan.h): for every function, mode, dtype (bf16 with fp32
// logits too: StepOptions::logits_dtype; bf16 under CUDA's plan rules) and chunking, the bytes
// PlanCall's CallPlan::Memory predicts are at least the transient peak the counting CPU
// allocator measures during the call, and at most kMaxOverestimate times it. A server
// admits requests by this estimate, so an underestimate could let a request run the device
// out of memory, and a gross overestimate would refuse work that fits.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/memory_stats.h"

namespace remotehead {
namespace {

using core::CallMode;
using core::Reduction;

constexpr int64_t kVocab = 3000;
constexpr int64_t kHidden = 128;
// The estimate may exceed the measured peak by this factor at most. It is conservative on
// purpose where the engine's peak depends on LibTorch's internals (which temporaries of a
// function's autograd graph are alive at once).
constexpr double kMaxOverestimate = 3.0;

// A derived case (function_cases.h) and the reduction it is measured with.
struct MemoryCase {
  reference::FunctionCase fcase;
  Reduction reduction = Reduction::kMean;
};

void PrintTo(const MemoryCase& c, std::ostream* os) {
  *os << c.fcase.label << "_" << core::ReductionName(c.reduction);
}

// How the chunk size is chosen: from a memory budget, as given, or larger than the call.
struct Chunking {
  std::string label;
  int64_t chunk_rows = 0;
  int64_t memory_budget_bytes = 0;
  int64_t rows = 0;
};

void PrintTo(const Chunking& c, std::ostream* os) { *os << c.label; }

// The head's dtype and the dtype its logits are formed in (StepOptions::logits_dtype), and the
// plan's rules (a bf16 head's plan under CUDA's: no fp32 gradient buffer, blocks by the budget).
struct DtypeCase {
  std::string label;
  torch::ScalarType dtype = torch::kFloat;
  std::optional<torch::ScalarType> logits_dtype;
  core::PlanRules rules = core::PlanRules::kDevice;
};

void PrintTo(const DtypeCase& c, std::ostream* os) { *os << c.label; }

const DtypeCase kDtypes[] = {
    {"fp32", torch::kFloat, std::nullopt},
    {"bf16", torch::kBFloat16, std::nullopt},
    {"bf16_fp32logits", torch::kBFloat16, torch::kFloat},
    {"bf16_cuda_rules", torch::kBFloat16, std::nullopt, core::PlanRules::kCuda},
    {"bf16_fp32logits_cuda_rules", torch::kBFloat16, torch::kFloat, core::PlanRules::kCuda},
};

using Param = std::tuple<MemoryCase, CallMode, DtypeCase, Chunking>;

class MemoryModel : public ::testing::TestWithParam<Param> {};

TEST_P(MemoryModel, EstimateBoundsTheMeasuredPeak) {
  const auto& [mcase, mode, dtypes, chunking] = GetParam();
  const reference::FunctionCase& fcase = mcase.fcase;
  core::InstallCpuMemoryTracker();
  torch::manual_seed(0);
  auto head = reference::MakeTestHead(kVocab, kHidden, dtypes.dtype, /*bias=*/true);
  const Reduction reduction = mode == CallMode::kFused && mcase.reduction == Reduction::kNone
                                  ? Reduction::kSum
                                  : mcase.reduction;
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, chunking.rows, fcase.function, reduction);
  core::StepOptions options{.function = fcase.function,
                            .params = fcase.params,
                            .reduction = reduction,
                            .chunk_rows = chunking.chunk_rows,
                            .memory_budget_bytes = chunking.memory_budget_bytes,
                            .logits_dtype = dtypes.logits_dtype,
                            .teacher = reference::TestTeacher(*head, fcase.function)};
  options.plan_rules = dtypes.rules;
  core::GradientBuffers grads = head->NewGradientBuffers();
  const torch::Tensor grad_output = reduction == Reduction::kNone ? torch::randn({chunking.rows})
                                                                  : torch::ones({}, torch::kDouble);
  auto plan = core::PlanCall(*head, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const core::CallMemory estimate = plan->Memory(chunking.rows, mode);

  // Inputs and accumulators exist before the call, as in a server; dX is the call's own.
  ASSERT_TRUE(core::ResetPeakMemory(torch::kCPU).ok());
  const int64_t before = core::GetMemoryStats(torch::kCPU)->allocated_bytes;
  absl::Status status;
  switch (mode) {
    case CallMode::kFused:
      status = core::FusedForwardBackward(*head, batch, options, &grads).status();
      break;
    case CallMode::kForward:
      status = core::Forward(*head, batch, options).status();
      break;
    case CallMode::kBackward:
      status = core::Backward(*head, batch, options, grad_output, &grads).status();
      break;
  }
  ASSERT_TRUE(status.ok()) << status;
  const int64_t measured = core::GetMemoryStats(torch::kCPU)->peak_allocated_bytes - before;

  EXPECT_GE(estimate.total(), measured) << estimate.Breakdown() << " vs measured " << measured;
  EXPECT_LE(static_cast<double>(estimate.total()), kMaxOverestimate * static_cast<double>(measured))
      << estimate.Breakdown() << " vs measured " << measured;
  RecordProperty("estimate_over_measured",
                 std::to_string(static_cast<double>(estimate.total()) / measured));
}

// Every registered function with its defaults and, if it has own params, with all options, and
// the sampler's costliest settings (function_cases.h), the reductions taken in turn so that each
// is measured.
std::vector<MemoryCase> Cases() {
  const Reduction reductions[] = {Reduction::kMean, Reduction::kNone, Reduction::kSum,
                                  Reduction::kWeightedSum};
  std::vector<MemoryCase> cases;
  for (reference::FunctionCase& c :
       reference::DerivedCases(reference::CaseSet::kDefaultsAndAllOptions)) {
    cases.push_back({std::move(c), reductions[cases.size() % std::size(reductions)]});
  }
  for (reference::FunctionCase& c : reference::SamplerMemoryCases()) {
    cases.push_back({std::move(c), reductions[cases.size() % std::size(reductions)]});
  }
  return cases;
}

const Chunking kChunkings[] = {
    {"budget", 0, int64_t{3} << 20, 700},  // the budget forces several chunks
    {"chunk_rows", 96, 0, 500},            // explicit chunks, a ragged last one
    {"one_small_chunk", 4096, 0, 37},      // fewer rows than one chunk
};

std::string Name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [mcase, mode, dtypes, chunking] = info.param;
  const char* modes[] = {"fused", "forward", "backward"};
  return mcase.fcase.label + "_" + std::string(core::ReductionName(mcase.reduction)) + "_" +
         modes[static_cast<int>(mode)] + "_" + dtypes.label + "_" + chunking.label;
}

INSTANTIATE_TEST_SUITE_P(
    EveryFunctionModeAndDtype, MemoryModel,
    ::testing::Combine(::testing::ValuesIn(Cases()),
                       ::testing::Values(CallMode::kFused, CallMode::kForward, CallMode::kBackward),
                       ::testing::ValuesIn(kDtypes), ::testing::ValuesIn(kChunkings)),
    Name);

}  // namespace
}  // namespace remotehead
