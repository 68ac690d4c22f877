// The fused block (core/src/fused/fused_block.h, StepOptions::fused_blocks) — its CPU twin here,
// the CUDA kernel too when the machine has a GPU:
//  - the engine with fused blocks against the naive full-logits reference (float64 autograd)
//    and against the engine's own autograd path, for every derived case of every function the
//    kernel covers (function_cases.h: defaults, each own param, softcap + temperature, all
//    options) × reduction × mode × bias × dtype (bf16, fp16, fp32, fp64), at several chunk sizes
//    with ~20% ignored targets;
//  - one block alone against float64 autograd at a vocabulary of several tiles and a ragged
//    last tile: each row's value and extras (1e-6 relative in fp32), its health partials, and
//    every logit's gradient within one ulp of the logits' dtype (the in-place rounding);
//  - the plan: a fused call's block is its chunk, and no fp32 gradient buffer is counted for a
//    half-precision head, so the same budget buys more rows.
#include "fused/fused_block.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/engine.h"
#include "support/devices.h"
#include "vocab_ops.h"

namespace remotehead {
namespace {

using core::Reduction;
using reference::FunctionCase;

bool FusedCovers(const FunctionCase& c) {
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  const core::TransformFunction* fn = *registry.Find(c.function);
  return core::fused::Covers(*fn, *registry.ResolveParams(*fn, c.params));
}

const std::vector<FunctionCase>& Cases() {
  static const auto* cases = [] {
    auto* out = new std::vector<FunctionCase>;
    for (const FunctionCase& c : reference::DerivedCases()) {
      if (FusedCovers(c)) out->push_back(c);
    }
    return out;
  }();
  return *cases;
}

enum class Mode { kFused, kTwoPhase };

using Param = std::tuple<FunctionCase, Reduction, Mode, bool /*bias*/, torch::ScalarType,
                         std::string /*device*/>;

class FusedEngineParity : public ::testing::TestWithParam<Param> {};

constexpr int64_t kVocab = 97;
constexpr int64_t kHidden = 24;
constexpr int64_t kRows = 67;
constexpr double kFloor = 1e-3;

// Against the float64 reference, relative to its magnitude: the engine parity suite's budgets
// (fp32 near-exact, half precision a few ulps of its 8 or 11 mantissa bits), float64 at
// rounding level.
double Tolerance(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kDouble:
      return 1e-10;
    case torch::kFloat:
      return 2e-5;
    case torch::kHalf:
      return 5e-3;
    default:
      return 3e-2;
  }
}

struct EngineRun {
  torch::Tensor output;  // loss (0-d) or per-token
  torch::Tensor grad_hidden, grad_weight, grad_bias;
  core::StepStats stats;
};

EngineRun RunEngine(const core::Head& head, const core::TokenBatch& batch,
                    core::StepOptions options, Mode mode, const torch::Tensor& grad_output) {
  EngineRun run;
  core::GradientBuffers grads = head.NewGradientBuffers();
  if (mode == Mode::kFused) {
    auto result = core::FusedForwardBackward(head, batch, options, &grads);
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return run;
    run.output = torch::full({}, result->loss, torch::kDouble);
    run.grad_hidden = result->grad_hidden;
    run.stats = result->stats;
  } else {
    auto forward = core::Forward(head, batch, options);
    EXPECT_TRUE(forward.ok()) << forward.status();
    if (!forward.ok()) return run;
    run.output = forward->output;
    auto backward = core::Backward(head, batch, options, grad_output, &grads);
    EXPECT_TRUE(backward.ok()) << backward.status();
    if (!backward.ok()) return run;
    run.grad_hidden = backward->grad_hidden;
    run.stats = backward->stats;
  }
  run.grad_weight = grads.weight;
  run.grad_bias = grads.bias;
  return run;
}

TEST_P(FusedEngineParity, MatchesTheReferenceAndTheAutogradPath) {
  const auto& [fcase, reduction, mode, bias, dtype, device_name] = GetParam();
  const torch::Device device(device_name);
  REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device);
  torch::manual_seed(0);
  auto head =
      reference::MakeTestHead(kVocab, kHidden, dtype, bias, /*seed=*/1, std::nullopt, device);
  const core::TokenBatch batch = reference::MakeTestBatch(*head, kRows, fcase.function, reduction);
  core::StepOptions options;
  options.function = fcase.function;
  options.params = fcase.params;
  options.reduction = reduction;
  options.upstream_scale = 0.5;
  options.head_health = true;  // compared with the autograd path's below
  torch::Tensor grad_output;
  if (mode == Mode::kTwoPhase) {
    grad_output = reduction == Reduction::kNone ? torch::randn({kRows}, torch::kDouble)
                                                : torch::full({}, 0.5, torch::kDouble);
    grad_output = grad_output.to(device, core::AccumulationDtype(dtype));
  }
  const reference::ReferenceResult ref =
      reference::NaiveReference(*head, batch, options, grad_output);
  ASSERT_GT(reference::MaxAbs(ref.grad_weight), 0.0) << "reference gradient is trivially zero";

  // One row, ragged chunks, one chunk larger than the call. (The fused chunk is the block, so
  // the autograd path's block sizes have no counterpart here.)
  for (const int64_t chunk : {int64_t{1}, int64_t{7}, kRows + 5}) {
    SCOPED_TRACE("chunk_rows=" + std::to_string(chunk));
    options.chunk_rows = chunk;
    options.fused_blocks = true;
    const EngineRun fused = RunEngine(*head, batch, options, mode, grad_output);
    ASSERT_TRUE(fused.grad_hidden.defined());
    // The chunk is the block.
    EXPECT_EQ(fused.stats.block_rows, std::min(chunk, kRows));
    EXPECT_EQ(fused.grad_hidden.scalar_type(), dtype);
    EXPECT_LE(reference::RelativeError(fused.output, ref.output, kFloor), Tolerance(dtype));
    EXPECT_LE(reference::RelativeError(fused.grad_hidden, ref.grad_hidden, kFloor),
              Tolerance(dtype));
    EXPECT_LE(reference::RelativeError(fused.grad_weight, ref.grad_weight, kFloor),
              Tolerance(dtype));
    if (bias) {
      EXPECT_LE(reference::RelativeError(fused.grad_bias, ref.grad_bias, kFloor), Tolerance(dtype));
    }
    // The autograd path of the same engine, same chunks: the same extras' and health's sums.
    if (chunk != 7) continue;
    options.fused_blocks = false;
    const EngineRun autograd = RunEngine(*head, batch, options, mode, grad_output);
    ASSERT_TRUE(autograd.grad_hidden.defined());
    EXPECT_EQ(fused.stats.valid_tokens, autograd.stats.valid_tokens);
    EXPECT_EQ(fused.stats.num_chunks, autograd.stats.num_chunks);
    ASSERT_EQ(fused.stats.extras.size(), autograd.stats.extras.size());
    for (const auto& [name, sum] : autograd.stats.extras) {
      EXPECT_LE(reference::RelativeError(fused.stats.extras.at(name), sum, 1.0), Tolerance(dtype))
          << name;
    }
    EXPECT_EQ(fused.stats.health.tokens, autograd.stats.health.tokens);
    if (autograd.stats.health.tokens > 0) {
      EXPECT_LE(reference::RelativeError(fused.stats.health.entropy_sum,
                                         autograd.stats.health.entropy_sum, 1.0),
                Tolerance(dtype));
      EXPECT_LE(reference::RelativeError(fused.stats.health.lse_sq_sum,
                                         autograd.stats.health.lse_sq_sum, 1.0),
                Tolerance(dtype));
      EXPECT_EQ(fused.stats.health.logit_max, autograd.stats.health.logit_max);
    }
  }
}

std::vector<Param> AllParams() {
  std::vector<Param> params;
  for (const FunctionCase& c : Cases()) {
    for (Reduction r :
         {Reduction::kNone, Reduction::kSum, Reduction::kMean, Reduction::kWeightedSum}) {
      for (Mode m : {Mode::kFused, Mode::kTwoPhase}) {
        if (m == Mode::kFused && r == Reduction::kNone) continue;
        for (bool bias : {false, true}) {
          for (torch::ScalarType dtype :
               {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}) {
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
         core::DtypeName(dtype) + "_" + testing::DeviceLabel(device);
}

INSTANTIATE_TEST_SUITE_P(CoveredFunctions, FusedEngineParity, ::testing::ValuesIn(AllParams()),
                         ParamName);

// --- One block alone, at a vocabulary of several tiles.

// Three full tiles and a ragged fourth; rows with large and small logits.
constexpr int64_t kBlockVocab = 3 * 4096 + 777;
constexpr int64_t kBlockRows = 5;

struct BlockCase {
  std::string label;
  std::string function;
  core::FunctionParams params;
  torch::ScalarType dtype;
};

void PrintTo(const BlockCase& c, std::ostream* os) { *os << c.label; }

class FusedBlock : public ::testing::TestWithParam<BlockCase> {};

// The function's value on float64 logits by its own forward (the autograd path's definition),
// and its gradient by autograd.
struct Float64Block {
  torch::Tensor y, dz;
  std::map<std::string, torch::Tensor> extras;
  torch::Tensor lse, mean;  // per row: lse and E_p[z'] of the transformed logits
};

Float64Block ReferenceBlock(const core::TransformFunction& fn, const core::FunctionParams& params,
                            const torch::Tensor& z_raw, const torch::Tensor& targets,
                            const torch::Tensor& dy) {
  torch::Tensor z = z_raw.to(torch::kDouble).detach().requires_grad_(true);
  const core::LocalVocabOps vocab(z_raw.size(1));
  core::ChunkInputs in;
  in.params = &params;
  in.vocab = &vocab;
  in.targets = targets;
  torch::Tensor zt;
  {
    torch::AutoGradMode grad(true);
    zt = z;
    const double scale = params.at(core::kLogitScaleParam);
    const double cap = params.at(core::kSoftcapParam);
    const double temperature = params.at(core::kTemperatureParam);
    if (scale != 1.0) zt = zt * scale;
    if (cap > 0) zt = torch::tanh(zt / cap) * cap;
    if (temperature != 1.0) zt = zt / temperature;
    in.logits = zt;
  }
  Float64Block out;
  core::FunctionOutput fo;
  {
    torch::AutoGradMode grad(true);
    fo = fn.forward(in);
  }
  out.y = fo.per_token.detach();
  for (auto& [name, t] : fo.extras) out.extras[name] = t.detach();
  out.dz = torch::autograd::grad({fo.per_token}, {z}, {dy.to(torch::kDouble)})[0];
  const torch::Tensor zd = zt.detach();
  out.lse = zd.logsumexp(1);
  out.mean = (zd.softmax(1) * zd).sum(1);
  return out;
}

// How far each dz (`got`, in the buffer's dtype) is beyond what the dtype allows about `want`:
// one ulp of |want| in that dtype (2^floor(log2|want|)·ε), plus for fp32 and fp64 buffers the
// compute's own error about the row's largest gradient (each row's sums reach every logit, and
// entropy's p_j·(E − z'_j) subtracts logits of up to ~50 here: 2e-6 for fp32 compute, 1e-12 for
// fp64). ≤ 0 everywhere when the bound holds.
torch::Tensor DzExcess(const torch::Tensor& got, const torch::Tensor& want,
                       torch::ScalarType dtype) {
  const double eps = dtype == torch::kBFloat16 ? 7.8125e-3
                     : dtype == torch::kHalf   ? 9.765625e-4
                     : dtype == torch::kFloat  ? 1.1920929e-7
                                               : 2.220446e-16;
  // The spacing of the dtype's subnormals (fp16's normals end at 6e-5; bf16's and fp32's about
  // 1e-38, which an e^(z − lse) of −90 reaches).
  const double min_spacing = dtype == torch::kBFloat16 ? 9.183549615799121e-41
                             : dtype == torch::kHalf   ? 5.9604644775390625e-8
                             : dtype == torch::kFloat  ? 1.401298464324817e-45
                                                       : 1e-300;
  const torch::Tensor w = want.to(torch::kDouble);
  const torch::Tensor ulp =
      (torch::exp2(torch::floor(torch::log2(w.abs().clamp_min(1e-300)))) * eps)
          .clamp_min(min_spacing);
  const double compute_eps = dtype == torch::kDouble             ? 1e-12
                             : c10::isReducedFloatingType(dtype) ? 0.0
                                                                 : 2e-6;
  const torch::Tensor row_scale = std::get<0>(w.abs().max(1, true));
  return (got.to(torch::kDouble) - w).abs() - (ulp + compute_eps * row_scale);
}

TEST_P(FusedBlock, MatchesFloat64AutogradWithinOneUlp) {
  const BlockCase& c = GetParam();
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  const core::TransformFunction* fn = *registry.Find(c.function);
  const core::FunctionParams params = *registry.ResolveParams(*fn, c.params);
  ASSERT_TRUE(core::fused::Covers(*fn, params));
  torch::manual_seed(3);
  // Rows of growing spread: near-uniform to peaked (|z| up to ~24).
  const torch::Tensor spread = torch::tensor({0.1, 1.0, 3.0, 6.0, 12.0}, torch::kDouble);
  const torch::Tensor z64 =
      torch::randn({kBlockRows, kBlockVocab}, torch::kDouble) * spread.unsqueeze(1);
  const torch::Tensor z = z64.to(c.dtype).contiguous();  // the chunk buffer
  const torch::Tensor targets = torch::tensor(
      {int64_t{0}, int64_t{4095}, int64_t{4096}, kBlockVocab - 1, int64_t{9000}}, torch::kLong);
  const torch::ScalarType compute = core::fused::ComputeDtype(c.dtype);
  const torch::Tensor dy = torch::tensor({0.5, -1.0, 2.0, 0.0, 1.5}, torch::kDouble).to(compute);

  // The reference sees exactly the values the kernel reads (the chunk buffer's).
  const Float64Block ref = ReferenceBlock(*fn, params, z, targets, dy);

  torch::Tensor buffer = z.clone();
  const core::fused::BlockOutputs out =
      core::fused::RunBlockCpu({.function = fn,
                                .params = &params,
                                .vocab_size = kBlockVocab,
                                .logits = buffer,
                                .targets = fn->needs_targets ? targets : torch::Tensor(),
                                .dy = dy,
                                .health = true});
  const double value_tolerance = compute == torch::kDouble ? 1e-12 : 1e-6;
  EXPECT_LE(reference::RelativeError(out.y, ref.y, 1.0), value_tolerance);
  ASSERT_EQ(out.extras.size(), ref.extras.size());
  for (const auto& [name, t] : ref.extras) {
    EXPECT_LE(reference::RelativeError(out.extras.at(name), t, 1.0), value_tolerance) << name;
  }
  // Health: lse = m + log s, E_p[z'] = m + t / s.
  const torch::Tensor h = out.health.to(torch::kDouble);
  const torch::Tensor m = h.select(1, 0), s = h.select(1, 1), t = h.select(1, 2);
  EXPECT_LE(reference::RelativeError(m + s.log(), ref.lse, 1.0), value_tolerance);
  EXPECT_LE(reference::RelativeError(m + t / s, ref.mean, 1.0), value_tolerance);

  // dz in place, in the buffer's dtype: within one ulp of the float64 gradient rounded to it.
  ASSERT_EQ(buffer.scalar_type(), c.dtype);
  const torch::Tensor excess = DzExcess(buffer, ref.dz, c.dtype);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << "worst at " << excess.argmax().item<int64_t>() << " of " << excess.numel();
}

std::vector<BlockCase> BlockCases() {
  std::vector<BlockCase> cases;
  const core::FunctionParams all = {{"label_smoothing", 0.1},
                                    {"z_loss", 1e-3},
                                    {core::kLogitScaleParam, reference::kTestLogitScale},
                                    {core::kSoftcapParam, reference::kTestSoftcap * 4},
                                    {core::kTemperatureParam, reference::kTestTemperature}};
  const core::FunctionParams transforms = {{core::kLogitScaleParam, reference::kTestLogitScale},
                                           {core::kSoftcapParam, reference::kTestSoftcap * 4},
                                           {core::kTemperatureParam, reference::kTestTemperature}};
  for (torch::ScalarType dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat, torch::kDouble}) {
    const std::string d = core::DtypeName(dtype);
    cases.push_back({"cross_entropy_" + d, "cross_entropy", {}, dtype});
    cases.push_back({"cross_entropy_all_options_" + d, "cross_entropy", all, dtype});
    cases.push_back({"token_logprobs_" + d, "token_logprobs", {}, dtype});
    cases.push_back({"token_logprobs_transforms_" + d, "token_logprobs", transforms, dtype});
    cases.push_back({"entropy_" + d, "entropy", {}, dtype});
    cases.push_back({"entropy_transforms_" + d, "entropy", transforms, dtype});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Tiles, FusedBlock, ::testing::ValuesIn(BlockCases()),
                         [](const ::testing::TestParamInfo<BlockCase>& info) {
                           return info.param.label;
                         });

// --- The CUDA kernels against their CPU twin (the GPU kit runs these under compute-sanitizer
// too): the same block on the GPU and on the CPU; values within 1e-6 relative (fp32 compute),
// every dz within one ulp of the twin's.

class FusedBlockOnCuda : public ::testing::TestWithParam<BlockCase> {};

TEST_P(FusedBlockOnCuda, MatchesTheCpuTwin) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  const BlockCase& c = GetParam();
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  const core::TransformFunction* fn = *registry.Find(c.function);
  const core::FunctionParams params = *registry.ResolveParams(*fn, c.params);
  torch::manual_seed(4);
  const torch::Tensor spread = torch::tensor({0.1, 1.0, 3.0, 6.0, 12.0}, torch::kDouble);
  const torch::Tensor z =
      (torch::randn({kBlockRows, kBlockVocab}, torch::kDouble) * spread.unsqueeze(1))
          .to(c.dtype)
          .contiguous();
  const torch::Tensor targets = torch::tensor(
      {int64_t{0}, int64_t{4095}, int64_t{4096}, kBlockVocab - 1, int64_t{9000}}, torch::kLong);
  const torch::ScalarType compute = core::fused::ComputeDtype(c.dtype);
  const torch::Tensor dy = torch::tensor({0.5, -1.0, 2.0, 0.0, 1.5}, torch::kDouble).to(compute);
  auto run = [&](const torch::Device& device) {
    torch::Tensor buffer = z.to(device).clone();
    core::fused::BlockOutputs out =
        core::fused::RunBlock({.function = fn,
                               .params = &params,
                               .vocab_size = kBlockVocab,
                               .logits = buffer,
                               .targets = fn->needs_targets ? targets.to(device) : torch::Tensor(),
                               .dy = dy.to(device),
                               .health = true});
    return std::make_pair(std::move(out), buffer.cpu());
  };
  const auto [gpu, gpu_dz] = run(torch::Device("cuda:0"));
  const auto [cpu, cpu_dz] = run(torch::kCPU);
  const double tolerance = compute == torch::kDouble ? 1e-12 : 1e-6;
  EXPECT_LE(reference::RelativeError(gpu.y.cpu(), cpu.y, 1.0), tolerance);
  for (const auto& [name, t] : cpu.extras) {
    EXPECT_LE(reference::RelativeError(gpu.extras.at(name).cpu(), t, 1.0), tolerance) << name;
  }
  EXPECT_LE(reference::RelativeError(gpu.health.cpu(), cpu.health, 1.0), tolerance);
  const torch::Tensor excess = DzExcess(gpu_dz, cpu_dz, c.dtype);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << "worst at " << excess.argmax().item<int64_t>() << " of " << excess.numel();
}

INSTANTIATE_TEST_SUITE_P(Tiles, FusedBlockOnCuda, ::testing::ValuesIn(BlockCases()),
                         [](const ::testing::TestParamInfo<BlockCase>& info) {
                           return info.param.label + "_cuda";
                         });

// --- The plan.

TEST(FusedPlan, TheChunkIsTheBlockAndNoFp32GradientIsCounted) {
  auto head = reference::MakeTestHead(32000, 256, torch::kBFloat16, false);
  core::StepOptions options;
  options.memory_budget_bytes = int64_t{64} << 20;
  auto autograd = core::PlanCall(*head, options);
  ASSERT_TRUE(autograd.ok()) << autograd.status();
  EXPECT_FALSE(autograd->fused);
  options.fused_blocks = true;
  auto fused = core::PlanCall(*head, options);
  ASSERT_TRUE(fused.ok()) << fused.status();
  EXPECT_TRUE(fused->fused);
  EXPECT_EQ(fused->block_rows, fused->chunk_rows);
  // bf16 logits (2 B) without the fp32 gradient (4 B) or a block: about 3× the rows.
  EXPECT_GE(fused->chunk_rows, 2 * autograd->chunk_rows);
  // The budget holds the chunk's transient bytes (the call's outputs, dX, come on top).
  const core::CallMemory memory = fused->Memory(4096, core::CallMode::kFused);
  EXPECT_LE(memory.logits_bytes + memory.block_bytes + memory.gemm_bytes,
            options.memory_budget_bytes);
  EXPECT_GT(memory.logits_bytes, options.memory_budget_bytes / 2) << "the chunk fills the budget";
}

TEST(FusedPlan, CallsTheKernelDoesNotCoverKeepTheAutogradPath) {
  auto head = reference::MakeTestHead(1000, 32, torch::kFloat, false);
  core::StepOptions options;
  options.fused_blocks = true;
  for (const std::string function : {"mse_onehot", "sigmoid_sum", "grpo"}) {
    options.function = function;
    auto plan = core::PlanCall(*head, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_FALSE(plan->fused) << function;
  }
  options.function = "token_logprobs";
  options.params = {{"top_k", 5}};
  auto sampled = core::PlanCall(*head, options);
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  EXPECT_FALSE(sampled->fused) << "a sampler's truncation is not the kernel's";
}

}  // namespace
}  // namespace remotehead
