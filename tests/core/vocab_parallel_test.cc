// A head split by vocabulary over K ranks (an in-process group: one thread per rank, each with
// its own shard of W) against the same head on one engine and against the naive full-logits
// reference: every function × {defaults, each own param, softcap + temperature, all options}
// (the cases derived from the registry, function_cases.h) × K ∈ {1, 2, 3} with uneven shards ×
// every reduction × fused and two-phase × chunk sizes {1, 7, N}, with ~20% of the targets ignored
// and others on the shards' edge columns. float64 within 1e-12, fp32 within 1e-5 (relative to the
// reference's magnitude); a bf16 head's fp32 logits (StepOptions::logits_dtype) as one engine's.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/function_cases.h"
#include "core/in_process_group.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead {
namespace {

using core::Reduction;
using core::ShardRange;

constexpr int64_t kVocab = 29;
constexpr int64_t kHidden = 8;
constexpr int64_t kRows = 23;
constexpr double kFloor = 1e-6;  // magnitudes below this count as this (reference::RelativeError)

using reference::FunctionCase;

// Every vocabulary-decomposable function (a group refuses the others) with its defaults, each
// own param, softcap + temperature, and all options together (function_cases.h).
const std::vector<FunctionCase>& Cases() {
  static const auto* cases = new std::vector<FunctionCase>(reference::DerivedCases(
      reference::CaseSet::kEveryOption,
      [](const core::TransformFunction& fn) { return fn.vocab_decomposable; }));
  return *cases;
}

// Uneven shards: K = 1 the whole head; K = 2 and 3 with very different sizes.
std::vector<ShardRange> Ranges(int k) {
  switch (k) {
    case 1:
      return {{0, kVocab}};
    case 2:
      return {{0, 11}, {11, 18}};
    default:
      return {{0, 5}, {5, 17}, {22, 7}};
  }
}

using testing::OnShards;
using testing::ShardFn;
using testing::ShardOf;

// The reference batch with some targets moved onto the first and last column of every shard,
// so that each rank owns some targets and the edges are exercised.
core::TokenBatch EdgeTargets(core::TokenBatch batch, const std::vector<ShardRange>& ranges) {
  int64_t row = 0;
  for (const ShardRange& r : ranges) {
    for (int64_t column : {r.offset, r.offset + r.rows - 1}) {
      if (row < batch.targets.size(0)) batch.targets[row] = column;
      row += 2;
    }
  }
  return batch;
}

// What a call returns on a group: rank 0's outputs and dX, every rank's dW / db rows put back
// together in vocabulary order.
struct Outcome {
  torch::Tensor output;  // loss (0-d) or per-token outputs
  torch::Tensor grad_hidden;
  torch::Tensor grad_weight;
  torch::Tensor grad_bias;
};

enum class Mode { kFused, kTwoPhase };

// Runs the call on one engine (`ranges` empty) or on a group of ranges.size() shards.
Outcome RunCall(const core::Head& head, const core::TokenBatch& batch, core::StepOptions options,
                Mode mode, const torch::Tensor& grad_output,
                const std::vector<ShardRange>& ranges) {
  const int k = ranges.empty() ? 1 : static_cast<int>(ranges.size());
  std::vector<Outcome> by_rank(static_cast<size_t>(k));
  const ShardFn run = [&](int rank, const core::Head& h, core::StepOptions opts) {
    core::GradientBuffers grads = h.NewGradientBuffers();
    Outcome& out = by_rank[static_cast<size_t>(rank)];
    if (mode == Mode::kFused) {
      auto result = core::FusedForwardBackward(h, batch, opts, &grads);
      ASSERT_TRUE(result.ok()) << "rank " << rank << ": " << result.status();
      out.output = torch::full({}, result->loss, torch::kDouble);
      out.grad_hidden = result->grad_hidden;
    } else {
      auto forward = core::Forward(h, batch, opts);
      ASSERT_TRUE(forward.ok()) << "rank " << rank << ": " << forward.status();
      out.output = forward->output;
      auto backward = core::Backward(h, batch, opts, grad_output, &grads);
      ASSERT_TRUE(backward.ok()) << "rank " << rank << ": " << backward.status();
      out.grad_hidden = backward->grad_hidden;
    }
    if (rank != 0) {
      EXPECT_FALSE(out.grad_hidden.defined()) << "only rank 0 holds dX";
    }
    out.grad_weight = grads.weight;
    out.grad_bias = grads.bias;
  };
  if (ranges.empty()) {
    run(0, head, options);
  } else {
    testing::InProcessGroup group(k);
    OnShards(group, head, ranges, options, run);
  }
  Outcome all = by_rank[0];
  std::vector<torch::Tensor> dw;
  std::vector<torch::Tensor> db;
  for (const Outcome& o : by_rank) {
    dw.push_back(o.grad_weight);
    if (o.grad_bias.defined()) db.push_back(o.grad_bias);
    // Every rank computes the same outputs from the same combined statistics.
    if (o.output.defined() && all.output.defined()) {
      EXPECT_TRUE(torch::equal(o.output, all.output)) << "ranks disagree on the outputs";
    }
  }
  all.grad_weight = torch::cat(dw);
  if (!db.empty()) all.grad_bias = torch::cat(db);
  return all;
}

void ExpectClose(const Outcome& actual, const Outcome& expected, double tolerance,
                 const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_LE(reference::RelativeError(actual.output, expected.output, kFloor), tolerance);
  EXPECT_LE(reference::RelativeError(actual.grad_hidden, expected.grad_hidden, kFloor), tolerance);
  EXPECT_LE(reference::RelativeError(actual.grad_weight, expected.grad_weight, kFloor), tolerance);
  if (expected.grad_bias.defined()) {
    EXPECT_LE(reference::RelativeError(actual.grad_bias, expected.grad_bias, kFloor), tolerance);
  }
}

using Param = std::tuple<FunctionCase, Reduction, int /*K*/>;

class VocabParallel : public ::testing::TestWithParam<Param> {};

TEST_P(VocabParallel, GroupEqualsOneEngineAndTheNaiveReference) {
  const auto& [fcase, reduction, k] = GetParam();
  const std::vector<ShardRange> ranges = Ranges(k);
  for (torch::ScalarType dtype : {torch::kDouble, torch::kFloat}) {
    SCOPED_TRACE(dtype == torch::kDouble ? "float64" : "float32");
    // fp32: 2e-5, engine_parity_test's (a summed policy loss partly cancels: its sum of 67
    // terms carries their rounding, 1.3e-5 of it here for grpo with beta on 3 ranks).
    const double tolerance = dtype == torch::kDouble ? 1e-12 : 2e-5;
    torch::manual_seed(0);
    const bool bias = k != 2;  // with and without a bias across the K values
    auto head = reference::MakeTestHead(kVocab, kHidden, dtype, bias, /*seed=*/1, dtype);
    const core::TokenBatch batch =
        EdgeTargets(reference::MakeTestBatch(*head, kRows, fcase.function, reduction), ranges);

    core::StepOptions options;
    options.function = fcase.function;
    options.teacher = reference::TestTeacher(*head, fcase.function);
    options.params = fcase.params;
    options.reduction = reduction;
    options.upstream_scale = 0.5;
    for (Mode mode : {Mode::kFused, Mode::kTwoPhase}) {
      if (mode == Mode::kFused && reduction == Reduction::kNone) continue;
      SCOPED_TRACE(mode == Mode::kFused ? "fused" : "two-phase");
      torch::Tensor grad_output;
      if (mode == Mode::kTwoPhase) {
        grad_output = reduction == Reduction::kNone ? torch::randn({kRows}, torch::kDouble)
                                                    : torch::full({}, 0.5, torch::kDouble);
      }
      const reference::ReferenceResult ref =
          reference::NaiveReference(*head, batch, options, grad_output);
      ASSERT_GT(reference::MaxAbs(ref.grad_weight), 0.0) << "reference gradient is zero";
      const Outcome naive{mode == Mode::kFused ? ref.output.to(torch::kDouble) : ref.output,
                          ref.grad_hidden, ref.grad_weight, ref.grad_bias};
      for (int64_t chunk : {int64_t{1}, int64_t{7}, kRows}) {
        SCOPED_TRACE("chunk_rows=" + std::to_string(chunk));
        options.chunk_rows = chunk;
        const Outcome single = RunCall(*head, batch, options, mode, grad_output, {});
        const Outcome sharded = RunCall(*head, batch, options, mode, grad_output, ranges);
        ExpectClose(sharded, single, tolerance, "group vs one engine");
        ExpectClose(sharded, naive, tolerance, "group vs naive reference");
      }
    }
  }
}

std::vector<Param> AllParams() {
  std::vector<Param> params;
  for (const FunctionCase& c : Cases()) {
    for (Reduction r :
         {Reduction::kNone, Reduction::kSum, Reduction::kMean, Reduction::kWeightedSum}) {
      for (int k : {1, 2, 3}) params.emplace_back(c, r, k);
    }
  }
  return params;
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const auto& [fcase, reduction, k] = info.param;
  return fcase.label + "_" + std::string(core::ReductionName(reduction)) + "_K" + std::to_string(k);
}

INSTANTIATE_TEST_SUITE_P(AllFunctions, VocabParallel, ::testing::ValuesIn(AllParams()), ParamName);

// fp32 logits of a bf16 head (StepOptions::logits_dtype) on a group: each shard forms its
// columns in fp32 (from slices of 3 rows of W here) and the group sums dX in fp32: one engine's
// result at fp32 accuracy (dX rounded to bf16 once on each side), a two-head function's teacher
// shards included, and the float64 reference's loss.
TEST(VocabParallelFp32Logits, Bf16GroupEqualsOneEngine) {
  for (const std::string function : {"cross_entropy", "distill_kl"}) {
    for (const int k : {2, 3}) {
      SCOPED_TRACE(absl::StrCat(function, " K ", k));
      const std::vector<ShardRange> ranges = Ranges(k);
      torch::manual_seed(0);
      auto head = reference::MakeTestHead(kVocab, kHidden, torch::kBFloat16, /*bias=*/true);
      const core::TokenBatch batch =
          EdgeTargets(reference::MakeTestBatch(*head, kRows, function, Reduction::kMean), ranges);
      const core::StepOptions options{.function = function,
                                      .chunk_rows = 7,
                                      .memory_budget_bytes = 16 * 3 * kHidden * 4,
                                      .logits_dtype = torch::kFloat,
                                      .teacher = reference::TestTeacher(*head, function)};
      const Outcome single = RunCall(*head, batch, options, Mode::kFused, {}, {});
      const Outcome sharded = RunCall(*head, batch, options, Mode::kFused, {}, ranges);
      EXPECT_LE(reference::RelativeError(sharded.output, single.output, kFloor), 1e-5);
      EXPECT_LE(reference::RelativeError(sharded.grad_weight, single.grad_weight, kFloor), 1e-5);
      EXPECT_LE(reference::RelativeError(sharded.grad_bias, single.grad_bias, kFloor), 1e-5);
      EXPECT_LE(reference::RelativeError(sharded.grad_hidden, single.grad_hidden, kFloor),
                1.0 / 128);
      const reference::ReferenceResult ref = reference::NaiveReference(*head, batch, options);
      EXPECT_LE(reference::RelativeError(sharded.output, ref.output, kFloor), 1e-5);
    }
  }
}

// Every registered function has cases above: a new function is tested on a group by construction.
// (The generation outputs, logits and sample, have no loss: VocabParallelGeneration below.)
TEST(VocabParallelCoverage, EveryBuiltinFunctionHasACase) {
  for (const std::string& name : core::FunctionRegistry::Builtin().Names()) {
    const core::TransformFunction& fn = **core::FunctionRegistry::Builtin().Find(name);
    if (!fn.vocab_decomposable || fn.output != core::OutputKind::kPerToken) continue;
    int cases = 0;
    for (const FunctionCase& c : Cases()) cases += c.function == name ? 1 : 0;
    EXPECT_GE(cases, 2) << name << ": add a plain and a softcap + temperature case";
  }
}

// The generation outputs on a group: each chunk's rows gathered over the whole vocabulary, so
// every rank returns what one engine returns — the logits (softcap and temperature applied, in
// the asked dtype) to fp32 rounding of the GEMM, the drawn tokens and their log-probs exactly
// for greedy and for seeded top-k / top-p draws — whatever the chunking.
TEST(VocabParallelGeneration, LogitsAndSampleOnAGroupEqualOneEngine) {
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  torch::manual_seed(4);
  const core::TokenBatch batch{.hidden = torch::randn({13, kHidden})};
  struct Case {
    std::string function;
    core::FunctionParams params;
    torch::ScalarType output_dtype = torch::kFloat;
  };
  const std::vector<Case> cases = {
      {"logits", {{"softcap", 2.5}, {"temperature", 0.7}}},
      {"logits", {}, torch::kBFloat16},
      {"sample", {{"greedy", 1.0}}},
      {"sample", {{"top_k", 5.0}, {"seed", 9.0}, {"temperature", 0.8}}},
      {"sample", {{"top_p", 0.9}, {"seed", 3.0}}}};
  for (const Case& c : cases) {
    for (const int64_t chunk_rows : {int64_t{0}, int64_t{4}}) {
      core::StepOptions options;
      options.function = c.function;
      options.reduction = Reduction::kNone;
      options.params = c.params;
      options.output_dtype = c.output_dtype;
      options.chunk_rows = chunk_rows;
      auto one = core::Forward(*head, batch, options);
      ASSERT_TRUE(one.ok()) << one.status();
      for (const int k : {1, 2, 3}) {
        SCOPED_TRACE(absl::StrCat(c.function, " chunk_rows ", chunk_rows, " K ", k));
        std::vector<core::ForwardResult> by_rank(static_cast<size_t>(k));
        testing::InProcessGroup group(k);
        OnShards(group, *head, Ranges(k), options,
                 [&](int rank, const core::Head& shard, core::StepOptions opts) {
                   auto r = core::Forward(shard, batch, opts);
                   ASSERT_TRUE(r.ok()) << "rank " << rank << ": " << r.status();
                   by_rank[static_cast<size_t>(rank)] = *std::move(r);
                 });
        for (const core::ForwardResult& r : by_rank) {
          ASSERT_EQ(r.output.sizes(), one->output.sizes());
          EXPECT_EQ(r.output.scalar_type(), one->output.scalar_type());
          EXPECT_LE(reference::RelativeError(r.output.to(torch::kDouble),
                                             one->output.to(torch::kDouble), kFloor),
                    c.output_dtype == torch::kBFloat16 ? 1e-2 : 1e-5);
          if (one->token_ids.defined()) {
            EXPECT_TRUE(torch::equal(r.token_ids, one->token_ids));
          }
          // Every rank answers the same bits as the front.
          EXPECT_TRUE(torch::equal(r.output, by_rank[0].output));
        }
      }
    }
  }
}

// A group of one is today's engine (the whole-head vocabulary operations): the same bits.
TEST(VocabParallelGroupOfOne, EqualsTheUnshardedEngineBitForBit) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  for (const FunctionCase& c : Cases()) {
    SCOPED_TRACE(c.label);
    const core::TokenBatch batch =
        reference::MakeTestBatch(*head, kRows, c.function, Reduction::kMean);
    core::StepOptions options;
    options.function = c.function;
    options.teacher = reference::TestTeacher(*head, c.function);
    options.params = c.params;
    options.chunk_rows = 7;
    const Outcome single = RunCall(*head, batch, options, Mode::kFused, {}, {});
    const Outcome group = RunCall(*head, batch, options, Mode::kFused, {}, Ranges(1));
    EXPECT_TRUE(torch::equal(group.output, single.output));
    EXPECT_TRUE(torch::equal(group.grad_hidden, single.grad_hidden));
    EXPECT_TRUE(torch::equal(group.grad_weight, single.grad_weight));
    EXPECT_TRUE(torch::equal(group.grad_bias, single.grad_bias));
  }
}

// A bfloat16 head: the ranks' dX partials are summed in fp32 and rounded once, dW accumulates in
// fp32; the group stays within the bf16 tolerance of the engine parity test (a few bf16 ulps)
// of the naive reference.
TEST(VocabParallelHalfPrecision, Bfloat16GroupMatchesTheReference) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kBFloat16, /*bias=*/true);
  for (const FunctionCase& c : Cases()) {
    SCOPED_TRACE(c.label);
    const core::TokenBatch batch = EdgeTargets(
        reference::MakeTestBatch(*head, kRows, c.function, Reduction::kMean), Ranges(3));
    core::StepOptions options;
    options.function = c.function;
    options.teacher = reference::TestTeacher(*head, c.function);
    options.params = c.params;
    options.chunk_rows = 7;
    const reference::ReferenceResult ref = reference::NaiveReference(*head, batch, options);
    const Outcome group = RunCall(*head, batch, options, Mode::kFused, {}, Ranges(3));
    EXPECT_EQ(group.grad_hidden.scalar_type(), torch::kBFloat16);
    const Outcome naive{ref.output.to(torch::kDouble), ref.grad_hidden, ref.grad_weight,
                        ref.grad_bias};
    ExpectClose(group, naive, 3e-2, "bf16 group vs naive reference");
  }
}

// Each rank sizes its chunks and blocks for the largest shard, so all ranks run the same ones.
TEST(VocabParallelPlan, EveryRankRunsTheSameChunksAndBlocks) {
  auto head = reference::MakeTestHead(4099, 16, torch::kFloat, /*bias=*/false);
  const std::vector<ShardRange> ranges = {{0, 1000}, {1000, 3099}};
  testing::InProcessGroup group(2);
  core::StepOptions options;
  options.memory_budget_bytes = 2 << 20;
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 300, "cross_entropy", Reduction::kMean);
  std::vector<core::StepStats> stats(2);
  OnShards(group, *head, ranges, options,
           [&](int rank, const core::Head& shard, const core::StepOptions& opts) {
             auto result = core::FusedForwardBackward(shard, batch, opts, nullptr);
             ASSERT_TRUE(result.ok()) << result.status();
             stats[static_cast<size_t>(rank)] = result->stats;
           });
  EXPECT_EQ(stats[0].chunk_rows, stats[1].chunk_rows);
  EXPECT_EQ(stats[0].block_rows, stats[1].block_rows);
  EXPECT_EQ(stats[0].num_chunks, stats[1].num_chunks);
  EXPECT_GT(stats[0].num_chunks, 1) << "the budget should force several chunks";
}

// A function that reduces over the vocabulary by itself (a max) declares it; a group refuses it
// before any compute, naming it, while one engine runs it.
TEST(VocabParallelRefusal, ANonDecomposableFunctionIsRefusedOnAGroup) {
  const core::FunctionRegistry registry(
      {core::TransformFunction{.name = "max_logit",
                               .help = "the largest logit (needs the whole row)",
                               .needs_targets = false,
                               .vocab_decomposable = false,
                               .forward = [](const core::ChunkInputs& in) {
                                 return core::FunctionOutput{std::get<0>(in.logits.max(1)), {}};
                               }}});
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  core::TokenBatch batch = reference::MakeTestBatch(*head, kRows, "sigmoid_sum", Reduction::kSum);
  core::StepOptions options;
  options.function = "max_logit";
  options.registry = &registry;
  options.reduction = Reduction::kSum;
  EXPECT_TRUE(core::Forward(*head, batch, options).ok());

  testing::InProcessGroup group(2, std::chrono::milliseconds(2000));
  const std::vector<ShardRange> ranges = Ranges(2);
  OnShards(group, *head, ranges, options,
           [&](int, const core::Head& shard, const core::StepOptions& opts) {
             auto result = core::Forward(shard, batch, opts);
             ASSERT_FALSE(result.ok());
             EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
             EXPECT_NE(result.status().message().find("\"max_logit\""), std::string::npos)
                 << result.status();
             EXPECT_NE(result.status().message().find("vocabulary-decomposable"),
                       std::string::npos);
           });
}

// Targets are checked against the whole vocabulary, not the shard's rows.
TEST(VocabParallelValidation, TargetsAreGlobalTokenIds) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  const std::vector<ShardRange> ranges = Ranges(3);
  core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  batch.targets[4] = kVocab;  // one past the end of the whole head
  testing::InProcessGroup group(3, std::chrono::milliseconds(2000));
  OnShards(group, *head, ranges, {},
           [&](int, const core::Head& shard, const core::StepOptions& options) {
             auto result = core::FusedForwardBackward(shard, batch, options, nullptr);
             ASSERT_FALSE(result.ok());
             EXPECT_EQ(result.status().message(),
                       "targets[4]: expected a token id in [0, 29) or ignore_index (-100); got 29");
           });
}

TEST(VocabParallelValidation, AShardDescriptionThatDoesNotFitIsRefused) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  testing::InProcessGroup group(2, std::chrono::milliseconds(2000));
  struct Case {
    std::vector<ShardRange> ranges;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{0, 11}}, "shard.ranges: expected one per rank (2); got 1"},
      {{{0, 11}, {12, 18}},
       "shard.ranges[1]: expected at least one row from offset 11; got rows "
       "[12, 30)"},
      {{{0, 29}, {29, 0}},
       "shard.ranges[1]: expected at least one row from offset 29; got rows "
       "[29, 29)"},
      {{{0, 10}, {10, 19}}, "shard.ranges[0]: expected the head's 11 rows; got 10"},
  };
  auto shard = ShardOf(*head, {0, 11});
  for (const Case& c : cases) {
    core::VocabShard vocab_shard{.group = group.member(0), .ranges = c.ranges};
    core::StepOptions options;
    options.shard = &vocab_shard;
    auto result = core::Forward(*shard, batch, options);
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(result.status().message(), c.message);
  }
}

// One rank's should_stop (a cancelled or expired request) stops every rank before the same chunk.
TEST(VocabParallelStop, OneRanksStopStopsEveryRankAtTheSameChunk) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  const std::vector<ShardRange> ranges = Ranges(3);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  testing::InProcessGroup group(3, std::chrono::milliseconds(5000));
  std::vector<int> chunks_started(3, 0);
  core::StepOptions chunked;
  chunked.chunk_rows = 4;
  OnShards(group, *head, ranges, chunked,
           [&](int rank, const core::Head& shard, core::StepOptions options) {
             int& started = chunks_started[static_cast<size_t>(rank)];
             options.should_stop = [&started, rank] { return ++started == 3 && rank == 1; };
             auto result = core::FusedForwardBackward(shard, batch, options, nullptr);
             ASSERT_FALSE(result.ok());
             EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled) << result.status();
           });
  EXPECT_EQ(chunks_started, std::vector<int>({3, 3, 3}));
}

// A rank that never makes its call: the others fail with a status naming it, none hangs.
TEST(VocabParallelFailure, AMissingRankFailsTheOthersWithoutHanging) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  const std::vector<ShardRange> ranges = Ranges(3);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", Reduction::kMean);
  testing::InProcessGroup group(3, std::chrono::milliseconds(300));
  std::vector<absl::Status> statuses(3);
  OnShards(group, *head, ranges, {},
           [&](int rank, const core::Head& shard, const core::StepOptions& options) {
             if (rank == 2) return;  // dead
             core::GradientBuffers grads = shard.NewGradientBuffers();
             statuses[static_cast<size_t>(rank)] =
                 core::FusedForwardBackward(shard, batch, options, &grads).status();
           });
  // The first rank to give up names the missing one; the group is then broken for the other.
  EXPECT_FALSE(statuses[0].ok());
  EXPECT_FALSE(statuses[1].ok());
  const absl::Status& first =
      statuses[0].code() == absl::StatusCode::kDeadlineExceeded ? statuses[0] : statuses[1];
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  EXPECT_NE(first.message().find("rank(s) 2"), std::string::npos) << first;
}

TEST(SplitVocabulary, ContiguousNearEvenRanges) {
  auto ranges = core::SplitVocabulary(10, 3);
  ASSERT_TRUE(ranges.ok());
  EXPECT_EQ(*ranges, (std::vector<ShardRange>{{0, 4}, {4, 3}, {7, 3}}));
  ranges = core::SplitVocabulary(128256, 8);
  ASSERT_TRUE(ranges.ok());
  EXPECT_EQ(ranges->back().offset + ranges->back().rows, 128256);
  EXPECT_EQ(ranges->front().rows, 16032);
  EXPECT_EQ(core::SplitVocabulary(2, 3).status().message(),
            "group_size: expected 1 to vocab_size (2) ranks; got 3");
  EXPECT_FALSE(core::SplitVocabulary(5, 0).ok());
}

}  // namespace
}  // namespace remotehead
