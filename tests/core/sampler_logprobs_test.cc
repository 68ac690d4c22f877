// token_logprobs under the sampler's distribution (core/sampler_kept_set.h): the log-probability
// of a token under the top-k / top-p / min-p truncated, renormalised distribution, against the
// float64 full-logits reference written independently (reference::ReferenceKeptMask: sort,
// cumulative sum, mask, log_softmax) and its autograd:
// - the kept set ("kept" for every (row, token) pair) and the log-probs, targets inside and
//   outside it, for each truncation, their combinations and both orders (min_p_first), with a
//   temperature, on continuous logits and on logits full of ties (a row where all tokens tie);
// - Forward, Backward and FusedForwardBackward at several chunk and block sizes: per-token
//   outputs (−inf outside the kept set), loss, dX, dW, db;
// - on an in-process head group (uneven shards, V large enough that top-p asks for more values
//   twice): equal to one head;
// - against the server's own draw ("sample"): every drawn token is kept, and its log-prob is the
//   log of the probability torch.multinomial drew it with;
// - without a truncation the result is the plain log-softmax, bit for bit.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/in_process_group.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead {
namespace {

using core::Reduction;

constexpr int64_t kVocab = 300;  // > 4·64: top-p without top-k asks for values three times
constexpr int64_t kHidden = 16;
constexpr double kInf = std::numeric_limits<double>::infinity();

struct SamplerCase {
  std::string label;
  core::FunctionParams params;
};

void PrintTo(const SamplerCase& c, std::ostream* os) { *os << c.label; }

std::vector<SamplerCase> SamplerCases() {
  return {
      {"top_k", {{"top_k", 7}}},
      {"top_p", {{"top_p", 0.8}}},
      {"top_p_flat", {{"top_p", 0.97}, {"temperature", 3.0}}},
      {"min_p", {{"min_p", 0.1}}},
      {"top_k_top_p", {{"top_k", 40}, {"top_p", 0.7}, {"temperature", 0.7}}},
      {"all_hf_order", {{"top_k", 50}, {"top_p", 0.8}, {"min_p", 0.2}, {"temperature", 1.3}}},
      {"all_vllm_order",
       {{"top_k", 50}, {"top_p", 0.8}, {"min_p", 0.2}, {"min_p_first", 1}, {"temperature", 1.3}}},
      {"top_p_min_p_first", {{"top_p", 0.6}, {"min_p", 0.3}, {"min_p_first", 1}}},
      {"top_k_one", {{"top_k", 1}}},
      {"min_p_one", {{"min_p", 1.0}}},
  };
}

// A head whose logits are full of ties: small multiples of powers of two in W and X, so every dot
// product is exact in any order (float32 too) and many columns hold equal values; row 0 of
// TiedHidden is zero, a row where every token ties.
std::unique_ptr<core::Head> TiedHead(torch::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(5);
  const torch::Tensor w = at::randint(-2, 3, {kVocab / 10, kHidden}, gen, torch::kLong)
                              .to(torch::kDouble)
                              .mul(0.25)
                              .repeat({10, 1});
  auto head = core::Head::FromTensors(w.to(dtype), torch::Tensor(),
                                      core::HeadOptions{.grad_dtype = dtype});
  EXPECT_TRUE(head.ok()) << head.status();
  return *std::move(head);
}

torch::Tensor TiedHidden(int64_t rows, torch::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(6);
  torch::Tensor x = at::randint(-2, 3, {rows, kHidden}, gen, torch::kLong).to(torch::kDouble);
  x[0].zero_();
  return x.mul(0.5).to(dtype);
}

// The float64 transformed logits of the reference (temperature only in these cases).
torch::Tensor ReferenceLogits(const core::Head& head, const torch::Tensor& x,
                              const core::FunctionParams& params) {
  torch::Tensor z = torch::mm(x.to(torch::kDouble), head.weight().to(torch::kDouble).t());
  if (head.has_bias()) z = z + head.bias().to(torch::kDouble);
  const auto t = params.find("temperature");
  return t == params.end() ? z : z / t->second;
}

// −inf in the same places, and the finite values within `tolerance` of the reference.
void ExpectSameLogprobs(const torch::Tensor& actual, const torch::Tensor& expected,
                        double tolerance) {
  const torch::Tensor a = actual.to(torch::kDouble).cpu();
  const torch::Tensor e = expected.to(torch::kDouble).cpu();
  ASSERT_TRUE(torch::equal(a.isneginf(), e.isneginf()))
      << "−inf at " << a.isneginf().nonzero().flatten() << " expected at "
      << e.isneginf().nonzero().flatten();
  const torch::Tensor finite = e.isfinite();
  EXPECT_LE(reference::RelativeError(a.masked_select(finite), e.masked_select(finite), 1e-6),
            tolerance);
}

core::StepOptions Options(const core::FunctionParams& params, Reduction reduction) {
  core::StepOptions o;
  o.function = "token_logprobs";
  o.params = params;
  o.reduction = reduction;
  o.token_extras = {"kept"};
  return o;
}

class SamplerKeptSet
    : public ::testing::TestWithParam<std::tuple<SamplerCase, torch::ScalarType, bool>> {};

// Every (row, token) pair as a target: "kept" is the whole kept set, the log-probs every token's.
TEST_P(SamplerKeptSet, EveryTokenMatchesTheReference) {
  const auto& [c, dtype, tied] = GetParam();
  const double tolerance = dtype == torch::kDouble ? 1e-12 : 1e-5;
  constexpr int64_t kRows = 6;
  auto head = tied ? TiedHead(dtype)
                   : reference::MakeTestHead(kVocab, kHidden, dtype, /*bias=*/true, 1, dtype);
  const torch::Tensor x = tied ? TiedHidden(kRows, dtype)
                               : reference::MakeTestBatch(*head, kRows, "token_logprobs",
                                                          Reduction::kNone).hidden;
  core::TokenBatch batch;
  batch.hidden = x.repeat_interleave(kVocab, 0);
  batch.targets = torch::arange(kVocab, torch::kLong).repeat({kRows});
  auto r = core::Forward(*head, batch, Options(c.params, Reduction::kNone));
  ASSERT_TRUE(r.ok()) << r.status();
  const torch::Tensor z = ReferenceLogits(*head, x, c.params);
  const torch::Tensor keep = reference::ReferenceKeptMask(z, c.params);
  EXPECT_TRUE(torch::equal(r->token_extras.at("kept").reshape({kRows, kVocab}).to(torch::kBool),
                           keep))
      << "kept per row " << r->token_extras.at("kept").reshape({kRows, kVocab}).sum(1)
      << " expected " << keep.sum(1);
  const torch::Tensor expected =
      torch::where(keep, torch::log_softmax(z.masked_fill(keep.logical_not(), -kInf), 1), -kInf);
  ExpectSameLogprobs(r->output, expected.flatten(), tolerance);
  if (tied) {  // the row of equal logits keeps every token, each with probability 1/V
    EXPECT_TRUE(keep[0].all().item<bool>());
    EXPECT_NEAR(r->output[0].item<double>(), -std::log(static_cast<double>(kVocab)), 1e-6);
  }
}

std::string KeptSetName(
    const ::testing::TestParamInfo<std::tuple<SamplerCase, torch::ScalarType, bool>>& info) {
  const auto& [c, dtype, tied] = info.param;
  return absl::StrCat(c.label, dtype == torch::kDouble ? "_f64" : "_f32", tied ? "_ties" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SamplerKeptSet,
    ::testing::Combine(::testing::ValuesIn(SamplerCases()),
                       ::testing::Values(torch::kDouble, torch::kFloat), ::testing::Bool()),
    KeptSetName);

// Targets: ~20% ignored, the rest alternately random (mostly outside a truncated set), the
// largest logit and a token drawn inside the kept set.
core::TokenBatch MixedTargets(const core::Head& head, int64_t rows,
                              const core::FunctionParams& params, bool all_kept) {
  core::TokenBatch batch = reference::MakeTestBatch(head, rows, "cross_entropy", Reduction::kSum);
  const torch::Tensor z = ReferenceLogits(head, batch.hidden, params);
  const torch::Tensor keep = reference::ReferenceKeptMask(z, params);
  auto gen = at::detail::createCPUGenerator(11);
  const torch::Tensor inside = at::multinomial(keep.to(torch::kDouble), 1, false, gen).squeeze(1);
  const torch::Tensor kind = torch::arange(rows, torch::kLong).remainder(3);
  torch::Tensor t = torch::where(kind == 1, z.argmax(1), inside);
  if (!all_kept) t = torch::where(kind == 0, batch.targets.clamp_min(0), t);
  batch.targets = torch::where(batch.targets < 0, batch.targets, t);
  return batch;
}

class SamplerEngineModes : public ::testing::TestWithParam<SamplerCase> {};

// Forward and Backward (reduction none, an upstream per token) and the fused call (reduction sum)
// at several chunk and block sizes against the float64 reference's values and autograd.
TEST_P(SamplerEngineModes, ForwardBackwardAndFusedMatchTheReference) {
  const SamplerCase& c = GetParam();
  constexpr int64_t kRows = 37;
  for (torch::ScalarType dtype : {torch::kDouble, torch::kFloat}) {
    SCOPED_TRACE(dtype == torch::kDouble ? "float64" : "float32");
    const double tolerance = dtype == torch::kDouble ? 1e-12 : 1e-5;
    auto head = reference::MakeTestHead(kVocab, kHidden, dtype, /*bias=*/true, 1, dtype);
    for (const bool all_kept : {false, true}) {
      SCOPED_TRACE(all_kept ? "targets kept" : "targets inside and outside");
      const core::TokenBatch batch = MixedTargets(*head, kRows, c.params, all_kept);
      const torch::Tensor upstream = torch::randn({kRows}, torch::kDouble);
      const reference::ReferenceResult none =
          reference::NaiveReference(*head, batch, Options(c.params, Reduction::kNone), upstream);
      const reference::ReferenceResult sum =
          reference::NaiveReference(*head, batch, Options(c.params, Reduction::kSum));
      // A kept set of one token (top_k = 1, min_p = 1) has log p' = 0 and no gradient.
      if (!c.label.ends_with("_one")) {
        ASSERT_GT(reference::MaxAbs(sum.grad_weight), 0.0);
      }
      for (const auto& [chunk, block] : std::vector<std::pair<int64_t, int64_t>>{
               {1, 0}, {7, 3}, {kRows, 5}, {kRows, 0}}) {
        SCOPED_TRACE(absl::StrCat("chunk_rows ", chunk, " block_rows ", block));
        core::StepOptions o = Options(c.params, Reduction::kNone);
        o.chunk_rows = chunk;
        o.block_rows = block;
        auto forward = core::Forward(*head, batch, o);
        ASSERT_TRUE(forward.ok()) << forward.status();
        ExpectSameLogprobs(forward->output, none.output, tolerance);
        core::GradientBuffers grads = head->NewGradientBuffers();
        auto backward = core::Backward(*head, batch, o, upstream, &grads);
        ASSERT_TRUE(backward.ok()) << backward.status();
        EXPECT_LE(reference::RelativeError(backward->grad_hidden, none.grad_hidden), tolerance);
        EXPECT_LE(reference::RelativeError(grads.weight, none.grad_weight), tolerance);
        EXPECT_LE(reference::RelativeError(grads.bias, none.grad_bias), tolerance);

        o.reduction = Reduction::kSum;
        core::GradientBuffers fused_grads = head->NewGradientBuffers();
        auto fused = core::FusedForwardBackward(*head, batch, o, &fused_grads);
        ASSERT_TRUE(fused.ok()) << fused.status();
        const double expected_loss = sum.output.item<double>();
        if (std::isinf(expected_loss)) {  // a target outside the kept set has probability 0
          EXPECT_FALSE(all_kept);
          EXPECT_EQ(fused->loss, expected_loss);
        } else {
          EXPECT_LE(reference::RelativeError(fused->loss, expected_loss), tolerance);
        }
        EXPECT_LE(reference::RelativeError(fused->grad_hidden, sum.grad_hidden), tolerance);
        EXPECT_LE(reference::RelativeError(fused_grads.weight, sum.grad_weight), tolerance);
        EXPECT_LE(reference::RelativeError(fused_grads.bias, sum.grad_bias), tolerance);
        EXPECT_TRUE(torch::equal(fused->token_extras.at("kept"), forward->token_extras.at("kept")));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, SamplerEngineModes, ::testing::ValuesIn(SamplerCases()),
                         [](const auto& info) { return info.param.label; });

// On three uneven shards (largest values gathered from each, the top-p loop's collectives made
// alike by every rank): the outputs, "kept" and the gradients equal one head's.
TEST(SamplerHeadGroup, EqualsOneHead) {
  const std::vector<core::ShardRange> ranges = {{0, 40}, {40, 190}, {230, 70}};
  constexpr int64_t kRows = 29;
  for (const SamplerCase& c : SamplerCases()) {
    for (const bool tied : {false, true}) {
      SCOPED_TRACE(absl::StrCat(c.label, tied ? " ties" : ""));
      auto head = tied ? TiedHead(torch::kDouble)
                       : reference::MakeTestHead(kVocab, kHidden, torch::kDouble, true, 1,
                                                 torch::kDouble);
      core::TokenBatch batch = MixedTargets(*head, kRows, c.params, false);
      if (tied) batch.hidden = TiedHidden(kRows, torch::kDouble);
      const torch::Tensor upstream = torch::randn({kRows}, torch::kDouble);
      core::StepOptions o = Options(c.params, Reduction::kNone);
      o.chunk_rows = 11;
      auto one = core::Forward(*head, batch, o);
      ASSERT_TRUE(one.ok()) << one.status();
      core::GradientBuffers one_grads = head->NewGradientBuffers();
      auto one_back = core::Backward(*head, batch, o, upstream, &one_grads);
      ASSERT_TRUE(one_back.ok()) << one_back.status();

      testing::InProcessGroup group(static_cast<int>(ranges.size()));
      std::vector<core::ForwardResult> forwards(ranges.size());
      std::vector<torch::Tensor> dw(ranges.size());
      torch::Tensor dx;
      testing::OnShards(group, *head, ranges, o,
                        [&](int rank, const core::Head& shard, core::StepOptions opts) {
                          auto f = core::Forward(shard, batch, opts);
                          ASSERT_TRUE(f.ok()) << "rank " << rank << ": " << f.status();
                          forwards[static_cast<size_t>(rank)] = *std::move(f);
                          core::GradientBuffers grads = shard.NewGradientBuffers();
                          auto b = core::Backward(shard, batch, opts, upstream, &grads);
                          ASSERT_TRUE(b.ok()) << "rank " << rank << ": " << b.status();
                          dw[static_cast<size_t>(rank)] = grads.weight;
                          if (rank == 0) dx = b->grad_hidden;
                        });
      for (const core::ForwardResult& f : forwards) {
        ExpectSameLogprobs(f.output, one->output, 1e-12);
        EXPECT_TRUE(torch::equal(f.token_extras.at("kept"), one->token_extras.at("kept")));
      }
      EXPECT_LE(reference::RelativeError(dx, one_back->grad_hidden, 1e-9), 1e-12);
      EXPECT_LE(reference::RelativeError(torch::cat(dw), one_grads.weight, 1e-9), 1e-12);
    }
  }
}

// The server's own draw and token_logprobs agree by construction: each token "sample" draws is in
// the kept set of token_logprobs with the same params, and its log-prob there is the log of the
// probability the draw used — softmax of the logits masked to the kept set, drawn by
// torch::multinomial with a CPU generator seeded seed + row (sampling.h).
TEST(SamplerAgreesWithSample, DrawnTokensAreKeptWithTheDrawsProbability) {
  constexpr int64_t kRows = 64;
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  const core::TokenBatch hidden{
      .hidden = reference::MakeTestBatch(*head, kRows, "sample", Reduction::kNone).hidden};
  for (const SamplerCase& c : SamplerCases()) {
    SCOPED_TRACE(c.label);
    core::FunctionParams draw = c.params;
    draw["seed"] = 123;
    core::StepOptions sample{.function = "sample", .params = draw, .reduction = Reduction::kNone};
    auto drawn = core::Forward(*head, hidden, sample);
    ASSERT_TRUE(drawn.ok()) << drawn.status();
    core::StepOptions logits_call = sample;
    logits_call.function = "logits";
    logits_call.params = c.params;
    logits_call.params.erase("top_k");
    logits_call.params.erase("top_p");
    logits_call.params.erase("min_p");
    logits_call.params.erase("min_p_first");
    auto logits = core::Forward(*head, hidden, logits_call);
    ASSERT_TRUE(logits.ok()) << logits.status();

    const torch::Tensor z = logits->output;  // the engine's transformed fp32 logits
    const torch::Tensor keep = reference::ReferenceKeptMask(z.to(torch::kDouble), c.params);
    const torch::Tensor probs = z.masked_fill(keep.logical_not(), -kInf).softmax(1);
    torch::Tensor expected = torch::empty({kRows}, torch::kLong);
    for (int64_t i = 0; i < kRows; ++i) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(123 + i);
      expected[i] = torch::multinomial(probs[i], 1, false, gen)[0];
    }
    EXPECT_TRUE(torch::equal(drawn->token_ids, expected));

    core::TokenBatch scored = hidden;
    scored.targets = drawn->token_ids;
    auto logp = core::Forward(*head, scored, Options(c.params, Reduction::kNone));
    ASSERT_TRUE(logp.ok()) << logp.status();
    EXPECT_TRUE(logp->token_extras.at("kept").eq(1).all().item<bool>());
    const torch::Tensor used = probs.gather(1, drawn->token_ids.unsqueeze(1)).squeeze(1);
    EXPECT_LE(reference::RelativeError(logp->output, used.to(torch::kDouble).log(), 1e-6), 1e-5);
  }
}

// No truncation (min_p_first alone truncates nothing): the plain log-softmax, bit for bit — the
// negation of cross_entropy's, which reads the same LogSoftmaxAtTarget — and "kept" all ones.
TEST(SamplerOff, IsThePlainLogSoftmaxBitForBit) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 50, "cross_entropy", Reduction::kNone);
  core::StepOptions ce{.function = "cross_entropy", .reduction = Reduction::kNone};
  auto nll = core::Forward(*head, batch, ce);
  ASSERT_TRUE(nll.ok()) << nll.status();
  for (const core::FunctionParams& params :
       {core::FunctionParams{}, core::FunctionParams{{"min_p_first", 1}, {"top_p", 1}}}) {
    auto logp = core::Forward(*head, batch, Options(params, Reduction::kNone));
    ASSERT_TRUE(logp.ok()) << logp.status();
    EXPECT_TRUE(torch::equal(logp->output, -nll->output));
    const torch::Tensor valid = batch.targets != -100;
    EXPECT_TRUE(torch::equal(logp->token_extras.at("kept"), valid.to(torch::kFloat)));
  }
}

TEST(SamplerParams, AreCheckedNamingTheParam) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 4, "token_logprobs", Reduction::kNone);
  const std::vector<std::pair<core::FunctionParams, std::string>> cases = {
      {{{"top_k", 2.5}}, "params[\"top_k\"]: expected a whole number; got 2.5"},
      {{{"min_p_first", 0.5}}, "params[\"min_p_first\"]: expected 0 or 1; got 0.5"},
      {{{"min_p", 1.5}}, "params[\"min_p\"]: expected a finite value in [0, 1]; got 1.5"},
      {{{"top_p", 0}}, "params[\"top_p\"]: expected a finite value in [1e-09, 1]; got 0"},
  };
  for (const auto& [params, message] : cases) {
    auto r = core::Forward(*head, batch, Options(params, Reduction::kNone));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(message), std::string::npos) << r.status();
  }
  core::StepOptions sample{.function = "sample",
                           .params = {{"min_p_first", 0.5}},
                           .reduction = Reduction::kNone};
  auto refused = core::Forward(*head, core::TokenBatch{.hidden = batch.hidden}, sample);
  EXPECT_EQ(refused.status().message(), "params[\"min_p_first\"]: expected 0 or 1; got 0.5");
}

}  // namespace
}  // namespace remotehead
