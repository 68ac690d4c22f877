// TransformFunction::ignored_rows_contribute_nothing held to the engine: for every function that
// declares it, in every mode and reduction (sum, mean, weighted sum, none; with and without a
// normalizer), a batch with ignored rows gives what the batch of its contributing rows alone
// (TokenBatch::Select(ContributingRows)) gives — the loss, the valid tokens, the extras' sums,
// dW, and dX, per-token outputs and token extras at the contributing rows — and exactly 0 in dX,
// the outputs and the token extras at the ignored rows. The functions that take no targets (the
// generation outputs) declare false. A bf16 head is checked the same way under CUDA's plan
// rules. The server relies on this to drop those rows before it computes
// (server/src/step/row_compaction.h), and the clients to leave them out.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

using core::Reduction;
using reference::FunctionCase;

constexpr int64_t kVocab = 61;
constexpr int64_t kHidden = 12;
constexpr int64_t kRows = 29;

bool Declares(const core::TransformFunction& fn) { return fn.ignored_rows_contribute_nothing; }

TEST(RowCompactionDeclaration, EveryPerTokenFunctionDeclaresItAndNoGenerationOutputDoes) {
  for (const core::TransformFunction* fn : core::FunctionRegistry::Builtin().Functions()) {
    SCOPED_TRACE(fn->name);
    EXPECT_EQ(fn->ignored_rows_contribute_nothing, fn->output == core::OutputKind::kPerToken);
  }
}

struct Case {
  FunctionCase function;
  Reduction reduction;
  bool normalizer;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.function.label << "_" << core::ReductionName(c.reduction)
      << (c.normalizer ? "_normalized" : "");
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const FunctionCase& f :
       reference::DerivedCases(reference::CaseSet::kDefaultsAndAllOptions, Declares)) {
    for (Reduction r : {Reduction::kSum, Reduction::kMean, Reduction::kWeightedSum}) {
      for (bool normalizer : {false, true}) cases.push_back({f, r, normalizer});
    }
    cases.push_back({f, Reduction::kNone, false});
  }
  return cases;
}

core::StepOptions OptionsFor(const core::Head& head, const Case& c, const core::TokenBatch& batch) {
  core::StepOptions options;
  options.function = c.function.function;
  options.params = c.function.params;
  options.reduction = c.reduction;
  if (c.normalizer) options.normalizer = 37.0;
  options.teacher = reference::TestTeacher(head, c.function.function);
  const core::TransformFunction& fn = **core::FunctionRegistry::Builtin().Find(options.function);
  options.token_extras = fn.ReportedExtras(
      *core::FunctionRegistry::Builtin().ResolveParams(fn, options.params), batch.aux);
  options.chunk_rows = 7;  // several chunks, ignored rows in each
  return options;
}

// `full` at the contributing rows equals `kept` (to float rounding: other chunks), and is
// exactly 0 at the ignored rows.
void ExpectPlaced(const torch::Tensor& full, const torch::Tensor& kept, const torch::Tensor& keep,
                  const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(full.size(0), kRows);
  EXPECT_LE(reference::RelativeError(full.index_select(0, keep), kept), 2e-6);
  torch::Tensor ignored = torch::ones({kRows}, torch::kBool);
  ignored.index_fill_(0, keep, false);
  EXPECT_TRUE(full.index({ignored}).eq(0).all().item<bool>());
}

class EveryDeclaringFunction : public ::testing::TestWithParam<Case> {};

TEST_P(EveryDeclaringFunction, IgnoredRowsChangeNothingAndGetZeros) {
  const Case& c = GetParam();
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, c.function.function, Reduction::kWeightedSum);
  if (c.reduction != Reduction::kWeightedSum) batch.weights = torch::Tensor();
  if (!batch.targets.defined()) {  // a function that takes targets only as a mask
    batch.targets = torch::randint(0, kVocab, {kRows}, torch::kLong);
  }
  batch.targets.index_put_({torch::arange(0, kRows, 3)}, -100);  // a third ignored, at least
  const torch::Tensor keep = core::ContributingRows(batch.targets, -100);
  ASSERT_LT(keep.size(0), kRows);
  const core::TokenBatch kept = batch.Select(keep);
  const core::StepOptions options = OptionsFor(*head, c, batch);

  auto expect_same_stats = [&](const core::StepStats& a, const core::StepStats& b) {
    EXPECT_EQ(a.valid_tokens, b.valid_tokens);
    EXPECT_EQ(a.denominator, b.denominator);
    ASSERT_EQ(a.extras.size(), b.extras.size());
    for (const auto& [name, sum] : a.extras) {
      EXPECT_LE(reference::RelativeError(sum, b.extras.at(name), 1e-3), 2e-6) << name;
    }
  };
  auto expect_same_extras = [&](const core::TokenExtras& a, const core::TokenExtras& b) {
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, values] : a) ExpectPlaced(values, b.at(name), keep, name);
  };

  if (c.reduction == Reduction::kNone) {
    auto all = core::Forward(*head, batch, options);
    auto some = core::Forward(*head, kept, options);
    ASSERT_TRUE(all.ok() && some.ok()) << all.status() << some.status();
    ExpectPlaced(all->output, some->output, keep, "outputs");
    expect_same_stats(all->stats, some->stats);
    expect_same_extras(all->token_extras, some->token_extras);
    const torch::Tensor dy = torch::linspace(-1, 1, kRows);
    core::GradientBuffers g_all = head->NewGradientBuffers(), g_some = head->NewGradientBuffers();
    auto b_all = core::Backward(*head, batch, options, dy, &g_all);
    auto b_some = core::Backward(*head, kept, options, dy.index_select(0, keep), &g_some);
    ASSERT_TRUE(b_all.ok() && b_some.ok()) << b_all.status() << b_some.status();
    ExpectPlaced(b_all->grad_hidden, b_some->grad_hidden, keep, "backward dX");
    EXPECT_LE(reference::RelativeError(g_all.weight, g_some.weight), 2e-6);
    EXPECT_LE(reference::RelativeError(g_all.bias, g_some.bias), 2e-6);
    return;
  }
  core::GradientBuffers g_all = head->NewGradientBuffers(), g_some = head->NewGradientBuffers();
  auto all = core::FusedForwardBackward(*head, batch, options, &g_all);
  auto some = core::FusedForwardBackward(*head, kept, options, &g_some);
  ASSERT_TRUE(all.ok() && some.ok()) << all.status() << some.status();
  // A sum of terms of both signs (GRPO's): other chunks round it differently.
  EXPECT_LE(reference::RelativeError(all->loss, some->loss, 0.1), 1e-5);
  ExpectPlaced(all->grad_hidden, some->grad_hidden, keep, "dX");
  EXPECT_LE(reference::RelativeError(g_all.weight, g_some.weight), 2e-6);
  EXPECT_LE(reference::RelativeError(g_all.bias, g_some.bias), 2e-6);
  expect_same_stats(all->stats, some->stats);
  expect_same_extras(all->token_extras, some->token_extras);
}

// …and a bf16 head planned by CUDA's rules (core::PlanRules: each block's gradient over the
// chunk's bf16 logits, dW accumulating it rounded), one reduction per function: dropping the
// ignored rows changes which rows share a chunk, not what each row contributes (bf16's rounding
// of dX allowed).
TEST_P(EveryDeclaringFunction, IgnoredRowsChangeNothingUnderCudasPlanRules) {
  const Case& c = GetParam();
  if (c.reduction != Reduction::kMean || c.normalizer) GTEST_SKIP() << "one reduction a function";
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kBFloat16, /*bias=*/true);
  core::TokenBatch batch = reference::MakeTestBatch(*head, kRows, c.function.function, c.reduction);
  if (!batch.targets.defined()) batch.targets = torch::randint(0, kVocab, {kRows}, torch::kLong);
  batch.targets.index_put_({torch::arange(0, kRows, 3)}, -100);
  const torch::Tensor keep = core::ContributingRows(batch.targets, -100);
  core::StepOptions options = OptionsFor(*head, c, batch);
  options.plan_rules = core::PlanRules::kCuda;
  options.block_rows = 3;  // several blocks a chunk, each writing its gradient over the logits
  core::GradientBuffers g_all = head->NewGradientBuffers(), g_some = head->NewGradientBuffers();
  auto all = core::FusedForwardBackward(*head, batch, options, &g_all);
  auto some = core::FusedForwardBackward(*head, batch.Select(keep), options, &g_some);
  ASSERT_TRUE(all.ok() && some.ok()) << all.status() << some.status();
  EXPECT_LE(reference::RelativeError(all->loss, some->loss, 0.1), 1e-5);
  const torch::Tensor dx = all->grad_hidden.to(torch::kFloat);
  EXPECT_LE(reference::RelativeError(dx.index_select(0, keep),
                                     some->grad_hidden.to(torch::kFloat), 1e-3),
            8e-3);
  torch::Tensor ignored = torch::ones({kRows}, torch::kBool);
  ignored.index_fill_(0, keep, false);
  EXPECT_TRUE(dx.index({ignored}).eq(0).all().item<bool>());
  EXPECT_LE(reference::RelativeError(g_all.weight, g_some.weight, 1e-3), 1e-5);
  EXPECT_LE(reference::RelativeError(g_all.bias, g_some.bias, 1e-3), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Functions, EveryDeclaringFunction, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::ostringstream name;
                           PrintTo(info.param, &name);
                           return name.str();
                         });

// The engine names a bad row by StepOptions::row_numbers — its index in the caller's request —
// when the rows it computes are not consecutive there.
TEST(RowNumbers, ErrorsNameTheRequestRow) {
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  core::TokenBatch batch = reference::MakeTestBatch(*head, 4, "cross_entropy", Reduction::kSum);
  batch.targets = torch::tensor({1, 2, 3, 4}, torch::kLong);
  batch.hidden[2][0] = NAN;
  const std::vector<int64_t> rows = {3, 8, 40, 41};
  core::StepOptions options{.reduction = Reduction::kSum};
  options.row_numbers = &rows;
  auto r = core::FusedForwardBackward(*head, batch, options, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "hidden[40]: expected finite values; got NaN or Inf");
  batch.hidden[2][0] = 0;
  batch.targets[3] = kVocab;
  r = core::FusedForwardBackward(*head, batch, options, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.status().message()).find("targets[41]: expected a token id"),
            std::string::npos)
      << r.status();
}

}  // namespace
}  // namespace remotehead
