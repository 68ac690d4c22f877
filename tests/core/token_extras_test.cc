// Per-token extras (StepOptions::token_extras): every function's diagnostics row by row in every
// mode — [N], 0 at ignored rows, summing to StepStats::extras, independent of the chunking and
// the same in the three modes — the values of the ones users read (cross-entropy's nll and
// z-loss, a distillation's divergence and the student's entropy) against naive float64
// definitions, and the precise refusal of a name a call does not report, with no state changed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

using core::Reduction;
using reference::FunctionCase;

constexpr int64_t kVocab = 57;
constexpr int64_t kHidden = 12;
constexpr int64_t kRows = 23;

// The call of `c` on `head` asking for every extra it reports.
core::StepOptions OptionsFor(const core::Head& head, const FunctionCase& c,
                             const core::TokenBatch& batch, Reduction reduction) {
  core::StepOptions options;
  options.function = c.function;
  options.params = c.params;
  options.reduction = reduction;
  options.teacher = reference::TestTeacher(head, c.function);
  const core::TransformFunction& fn = **core::FunctionRegistry::Builtin().Find(c.function);
  const core::FunctionParams params =
      *core::FunctionRegistry::Builtin().ResolveParams(fn, c.params);
  options.token_extras = fn.ReportedExtras(params, batch.aux);
  return options;
}

// 0 at the rows whose target is ignored; the sum over the others is the summary's.
void ExpectConsistent(const core::TokenExtras& extras, const core::StepStats& stats,
                      const core::TokenBatch& batch, const std::vector<std::string>& names) {
  ASSERT_EQ(extras.size(), names.size());
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const torch::Tensor& values = extras.at(name);
    ASSERT_EQ(values.sizes(), torch::IntArrayRef({kRows}));
    EXPECT_EQ(values.scalar_type(), torch::kFloat);
    if (batch.targets.defined()) {
      const torch::Tensor ignored = batch.targets.to(torch::kCPU) == -100;
      EXPECT_TRUE(values.masked_select(ignored).eq(0).all().item<bool>());
    }
    const double sum = values.to(torch::kDouble).sum().item<double>();
    EXPECT_LE(reference::RelativeError(sum, stats.extras.at(name), 1e-3), 1e-6)
        << sum << " vs the summary's " << stats.extras.at(name);
  }
}

class EveryFunction : public ::testing::TestWithParam<FunctionCase> {};

TEST_P(EveryFunction, EachModeReturnsTheReportedExtrasRowByRowWhateverTheChunking) {
  const FunctionCase& c = GetParam();
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, c.function, Reduction::kSum);
  core::StepOptions options = OptionsFor(*head, c, batch, Reduction::kSum);
  const std::vector<std::string> names = options.token_extras;

  options.chunk_rows = 5;
  options.block_rows = 2;
  auto fused = core::FusedForwardBackward(*head, batch, options, nullptr);
  ASSERT_TRUE(fused.ok()) << fused.status();
  ExpectConsistent(fused->token_extras, fused->stats, batch, names);

  options.chunk_rows = kRows;
  options.block_rows = 0;
  auto forward = core::Forward(*head, batch, options);
  ASSERT_TRUE(forward.ok()) << forward.status();
  ExpectConsistent(forward->token_extras, forward->stats, batch, names);
  auto backward = core::Backward(*head, batch, options, torch::ones({}), nullptr);
  ASSERT_TRUE(backward.ok()) << backward.status();
  ExpectConsistent(backward->token_extras, backward->stats, batch, names);

  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const torch::Tensor& chunked = fused->token_extras.at(name);
    EXPECT_LE(reference::RelativeError(chunked, forward->token_extras.at(name), 1e-3), 1e-6);
    EXPECT_LE(reference::RelativeError(backward->token_extras.at(name),
                                       forward->token_extras.at(name), 1e-3),
              1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Functions, EveryFunction,
    ::testing::ValuesIn(reference::DerivedCases(reference::CaseSet::kDefaultsAndAllOptions)),
    [](const auto& info) { return info.param.label; });

// The float64 values of the extras users read, from the full logits.
class ExtraValues : public ::testing::Test {
 protected:
  void SetUp() override {
    head_ = reference::MakeTestHead(kVocab, kHidden, torch::kDouble, /*bias=*/true);
  }
  torch::Tensor Logits(const core::Head& head, const torch::Tensor& hidden) const {
    return torch::addmm(head.bias(), hidden, head.weight().t());
  }
  std::unique_ptr<core::Head> head_;
};

TEST_F(ExtraValues, CrossEntropysNllAndZLossAreTheTextbookOnes) {
  core::TokenBatch batch =
      reference::MakeTestBatch(*head_, kRows, "cross_entropy", Reduction::kMean);
  core::StepOptions options;
  options.params = {{"z_loss", 0.3}, {"label_smoothing", 0.1}, {"temperature", 1.7}};
  options.token_extras = {"z_loss", "nll"};
  auto r = core::Forward(*head_, batch, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token_extras.at("nll").scalar_type(), torch::kDouble);
  const torch::Tensor z = Logits(*head_, batch.hidden) / 1.7;
  const torch::Tensor valid = batch.targets != -100;
  const torch::Tensor safe = batch.targets.masked_fill(valid.logical_not(), 0);
  const torch::Tensor nll =
      torch::nll_loss(torch::log_softmax(z, 1), safe, {}, at::Reduction::None);
  const torch::Tensor lse = torch::logsumexp(z, 1);
  EXPECT_LE(
      reference::RelativeError(r->token_extras.at("nll"), nll.masked_fill(valid.logical_not(), 0)),
      1e-12);
  EXPECT_LE(reference::RelativeError(r->token_extras.at("z_loss"),
                                     (0.3 * lse.square()).masked_fill(valid.logical_not(), 0)),
            1e-12);
}

TEST_F(ExtraValues, ADistillationsDivergenceAndTheStudentsEntropyAreTheTextbookOnes) {
  for (const std::string function : {"distill_kl", "distill_reverse_kl", "distill_jsd"}) {
    SCOPED_TRACE(function);
    const core::Head* teacher = reference::TestTeacher(*head_, function);
    core::TokenBatch batch = reference::MakeTestBatch(*head_, kRows, function, Reduction::kMean);
    core::StepOptions options;
    options.function = function;
    options.teacher = teacher;
    options.params = {
        {"temperature", 2.0}, {"softcap", 3.0}, {"teacher_logit_scale", 0.7}, {"alpha", 0.25}};
    options.token_extras = {"entropy", "divergence", "nll"};
    options.chunk_rows = 4;
    auto r = core::FusedForwardBackward(*head_, batch, options, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();

    const torch::Tensor untempered = 3.0 * torch::tanh(Logits(*head_, batch.hidden) / 3.0);
    const torch::Tensor ls = torch::log_softmax(untempered / 2.0, 1);
    const torch::Tensor lt =
        torch::log_softmax(0.7 * Logits(*teacher, batch.teacher_hidden) / 2.0, 1);
    const torch::Tensor kl_ts = (lt.exp() * (lt - ls)).sum(1);  // KL(teacher ‖ student)
    const torch::Tensor kl_st = (ls.exp() * (ls - lt)).sum(1);
    torch::Tensor divergence = function == "distill_kl" ? kl_ts : kl_st;
    if (function == "distill_jsd") {  // beta 0.5: the symmetric JSD
      const torch::Tensor lm = torch::logaddexp(ls, lt) - std::log(2.0);
      divergence = 0.5 * (lt.exp() * (lt - lm)).sum(1) + 0.5 * (ls.exp() * (ls - lm)).sum(1);
    }
    const torch::Tensor valid = batch.targets != -100;
    const torch::Tensor safe = batch.targets.masked_fill(valid.logical_not(), 0);
    const torch::Tensor entropy = -(ls.exp() * ls).sum(1);
    const torch::Tensor nll =
        torch::nll_loss(torch::log_softmax(untempered, 1), safe, {}, at::Reduction::None);
    EXPECT_LE(reference::RelativeError(r->token_extras.at("divergence"),
                                       divergence.masked_fill(valid.logical_not(), 0)),
              1e-12);
    EXPECT_LE(reference::RelativeError(r->token_extras.at("entropy"),
                                       entropy.masked_fill(valid.logical_not(), 0)),
              1e-12);
    EXPECT_LE(reference::RelativeError(r->token_extras.at("nll"),
                                       nll.masked_fill(valid.logical_not(), 0)),
              1e-12);
  }
}

// Refused before any compute, naming token_extras[i], what the call reports and why; the
// accumulated gradient is left bit-identical.
TEST(TokenExtrasRefused, ANameTheCallDoesNotReportIsRefusedPrecisely) {
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  head->grads().weight.normal_();
  const torch::Tensor before = head->grads().weight.clone();
  struct Case {
    std::string function;
    core::FunctionParams params;
    std::vector<std::string> names;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"cross_entropy",
       {},
       {"nll", "kl"},
       "token_extras[1]: expected one of the extras function cross_entropy reports (nll); got "
       "\"kl\""},
      {"cross_entropy",
       {},
       {"z_loss"},
       "token_extras[0]: expected one of the extras function cross_entropy reports (nll); got "
       "\"z_loss\", reported only with params[\"z_loss\"] > 0"},
      {"cross_entropy",
       {{"z_loss", 0.1}},
       {"nll", "z_loss", "nll"},
       "token_extras[2]: expected distinct names; got \"nll\" again (token_extras[0])"},
      {"distill_kl",
       {},
       {"entropy", "nll"},
       "token_extras[1]: expected one of the extras function distill_kl reports (divergence, "
       "entropy); got \"nll\", reported only with params[\"alpha\"] > 0"},
      {"grpo",
       {},
       {"kl"},
       "token_extras[0]: expected one of the extras function grpo reports (clipped); got \"kl\", "
       "reported only with aux[\"ref_logprobs\"]"},
      {"mse_onehot",
       {},
       {"nll"},
       "token_extras[0]: expected no name: function mse_onehot reports no extras; got "
       "\"nll\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    core::TokenBatch batch = reference::MakeTestBatch(*head, kRows, c.function, Reduction::kSum);
    batch.aux.erase("ref_logprobs");  // grpo: the KL is not reported
    core::StepOptions options;
    options.function = c.function;
    options.params = c.params;
    options.reduction = Reduction::kSum;
    options.teacher = reference::TestTeacher(*head, c.function);
    options.token_extras = c.names;
    auto fused = core::FusedForwardBackward(*head, batch, options, &head->grads());
    ASSERT_FALSE(fused.ok());
    EXPECT_EQ(fused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(fused.status().message(), c.message);
    EXPECT_EQ(core::Forward(*head, batch, options).status().message(), c.message);
    EXPECT_TRUE(torch::equal(head->grads().weight, before));
  }
}

// A generation output reports no extras; the plan (what a server admits a request by) already
// refuses a name it cannot report whatever the rows bring.
TEST(TokenExtrasRefused, TheCallsPlanRefusesWhatItCanTellWithoutTheRows) {
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  core::StepOptions options;
  options.function = "logits";
  options.reduction = Reduction::kNone;
  options.token_extras = {"nll"};
  EXPECT_EQ(core::PlanCall(*head, options).status().message(),
            "token_extras[0]: expected no name: function logits reports no extras; got \"nll\"");
  options.function = "grpo";
  options.token_extras = {"kl"};  // whether ref_logprobs come is known with the rows only
  EXPECT_TRUE(core::PlanCall(*head, options).ok());
}

// The memory model counts the rows the extras return.
TEST(TokenExtrasMemory, EachNameAddsOneValuePerRowToTheOutput) {
  const auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  core::StepOptions options;
  options.params = {{"z_loss", 0.1}};
  const auto plain = core::PlanCall(*head, options);
  options.token_extras = {"nll", "z_loss"};
  const auto with_extras = core::PlanCall(*head, options);
  ASSERT_TRUE(plain.ok() && with_extras.ok());
  for (const core::CallMode mode : {core::CallMode::kFused, core::CallMode::kForward}) {
    EXPECT_EQ(with_extras->Memory(1000, mode).output_bytes - plain->Memory(1000, mode).output_bytes,
              1000 * 2 * 4);
  }
}

}  // namespace
}  // namespace remotehead
