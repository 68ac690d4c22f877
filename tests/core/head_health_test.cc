// The head's health (StepStats::health, engine.h) against a float64 full-logits reference: the
// entropy, lse² and max-logit sums over the valid tokens of the logits the function saw (after
// the logit scale, softcap and temperature), whatever the chunking; only calls that accumulate
// dW compute it; on a head group every rank holds the whole vocabulary's values, the same bit for
// bit, equal to one engine's.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "core/in_process_group.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/vocab_group.h"

// Its own namespace: the file is compiled in one unit with the target's other files
// (cmake/RemoteheadUnity.cmake), whose shapes and helpers have the same names.
namespace remotehead::head_health_test {
namespace {

constexpr int64_t kVocab = 37;
constexpr int64_t kHidden = 12;
constexpr int64_t kRows = 29;

// The transforms of TransformLogits, all engaged: logits of a few units, capped by the tanh.
core::FunctionParams Transforms() {
  return {{core::kLogitScaleParam, 6.0}, {core::kSoftcapParam, 4.0}, {core::kTemperatureParam, 0.7}};
}

// Σ over the valid rows in float64 on the whole [N, V] logits.
core::HeadHealth Reference(const core::Head& head, const core::TokenBatch& batch) {
  torch::Tensor z = batch.hidden.to(torch::kDouble).matmul(head.weight().to(torch::kDouble).t());
  if (head.has_bias()) z = z + head.bias().to(torch::kDouble);
  z = torch::tanh(z * 6.0 / 4.0) * 4.0 / 0.7;
  const torch::Tensor valid = batch.targets.ne(-100);
  z = z.index({valid});
  const torch::Tensor lse = torch::logsumexp(z, 1);
  const torch::Tensor entropy = -(torch::softmax(z, 1) * torch::log_softmax(z, 1)).sum(1);
  const torch::Tensor max = std::get<0>(z.max(1));
  return {.tokens = z.size(0),
          .entropy_sum = entropy.sum().item<double>(),
          .lse_sq_sum = lse.square().sum().item<double>(),
          .logit_max_sum = max.sum().item<double>(),
          .logit_max = max.max().item<double>()};
}

void ExpectClose(const core::HeadHealth& actual, const core::HeadHealth& expected, double tol) {
  EXPECT_EQ(actual.tokens, expected.tokens);
  EXPECT_LE(reference::RelativeError(actual.entropy_sum, expected.entropy_sum), tol);
  EXPECT_LE(reference::RelativeError(actual.lse_sq_sum, expected.lse_sq_sum), tol);
  EXPECT_LE(reference::RelativeError(actual.logit_max_sum, expected.logit_max_sum), tol);
  EXPECT_LE(reference::RelativeError(actual.logit_max, expected.logit_max), tol);
}

void ExpectEqual(const core::HeadHealth& a, const core::HeadHealth& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.entropy_sum, b.entropy_sum);
  EXPECT_EQ(a.lse_sq_sum, b.lse_sq_sum);
  EXPECT_EQ(a.logit_max_sum, b.logit_max_sum);
  EXPECT_EQ(a.logit_max, b.logit_max);
}

core::StepOptions Options(int64_t chunk_rows, int64_t block_rows) {
  return {.function = "cross_entropy",
          .params = Transforms(),
          .chunk_rows = chunk_rows,
          .block_rows = block_rows,
          .head_health = true};
}

TEST(HeadHealth, EqualsTheFloat64ReferenceForEveryChunkingAndDtype) {
  for (torch::ScalarType dtype : {torch::kDouble, torch::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    const double tol = dtype == torch::kDouble ? 1e-12 : 2e-6;
    auto head = reference::MakeTestHead(kVocab, kHidden, dtype, /*bias=*/true, 1, dtype);
    const core::TokenBatch batch =
        reference::MakeTestBatch(*head, kRows, "cross_entropy", core::Reduction::kMean);
    const core::HeadHealth expected = Reference(*head, batch);
    ASSERT_GT(expected.tokens, 0);
    ASSERT_LT(expected.tokens, kRows) << "some targets are ignored";
    for (const auto& [chunk, block] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {7, 3}, {kRows, 5}, {kRows, kRows}}) {
      SCOPED_TRACE(::testing::Message() << "chunk_rows " << chunk << ", block_rows " << block);
      core::GradientBuffers grads = head->NewGradientBuffers();
      auto fused = core::FusedForwardBackward(*head, batch, Options(chunk, block), &grads);
      ASSERT_TRUE(fused.ok()) << fused.status();
      ExpectClose(fused->stats.health, expected, tol);
      auto backward = core::Backward(*head, batch, Options(chunk, block),
                                     torch::ones({}, torch::kDouble), &grads);
      ASSERT_TRUE(backward.ok()) << backward.status();
      ExpectClose(backward->stats.health, expected, tol);
    }
  }
}

TEST(HeadHealth, OnlyCallsThatAccumulateDwComputeIt) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/false);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", core::Reduction::kMean);
  const core::StepOptions options = Options(7, 3);
  auto forward = core::Forward(*head, batch, options);
  ASSERT_TRUE(forward.ok()) << forward.status();
  EXPECT_EQ(forward->stats.health.tokens, 0) << "a Forward (old / reference log-probs)";
  auto no_dw = core::FusedForwardBackward(*head, batch, options, /*grads=*/nullptr);
  ASSERT_TRUE(no_dw.ok()) << no_dw.status();
  EXPECT_EQ(no_dw->stats.health.tokens, 0) << "dX only";
  // Off unless asked for: a pass over the logits that no other head makes.
  core::StepOptions off = options;
  off.head_health = core::StepOptions{}.head_health;
  EXPECT_FALSE(off.head_health);
  core::GradientBuffers grads = head->NewGradientBuffers();
  auto switched_off = core::FusedForwardBackward(*head, batch, off, &grads);
  ASSERT_TRUE(switched_off.ok()) << switched_off.status();
  EXPECT_EQ(switched_off->stats.health.tokens, 0);
  // And the loss and dW do not depend on it.
  core::GradientBuffers grads_on = head->NewGradientBuffers();
  auto on = core::FusedForwardBackward(*head, batch, options, &grads_on);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_GT(on->stats.health.tokens, 0);
  EXPECT_EQ(on->loss, switched_off->loss);
  EXPECT_TRUE(torch::equal(grads_on.weight, grads.weight));
}

// vespo couples its rows (the engine's two passes, engine_coupled.cc): the pass that trains
// (dW) computes the health, as in an ordinary call.
TEST(HeadHealth, ARowCoupledCallCountsItsTrainingPass) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "vespo", core::Reduction::kMean);
  core::StepOptions options = Options(7, 3);
  options.function = "vespo";
  core::GradientBuffers grads = head->NewGradientBuffers();
  auto fused = core::FusedForwardBackward(*head, batch, options, &grads);
  ASSERT_TRUE(fused.ok()) << fused.status();
  ExpectClose(fused->stats.health, Reference(*head, batch), 2e-6);
  auto forward = core::Forward(*head, batch, options);
  ASSERT_TRUE(forward.ok()) << forward.status();
  EXPECT_EQ(forward->stats.health.tokens, 0);
}

TEST(HeadHealth, EveryRankOfAGroupHoldsTheWholeVocabularysValues) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, kRows, "cross_entropy", core::Reduction::kMean);
  core::GradientBuffers grads = head->NewGradientBuffers();
  auto one = core::FusedForwardBackward(*head, batch, Options(7, 3), &grads);
  ASSERT_TRUE(one.ok()) << one.status();
  for (const std::vector<core::ShardRange>& ranges :
       {std::vector<core::ShardRange>{{0, 15}, {15, 22}},
        std::vector<core::ShardRange>{{0, 5}, {5, 30}, {35, 2}}}) {
    SCOPED_TRACE(::testing::Message() << ranges.size() << " ranks");
    const int k = static_cast<int>(ranges.size());
    testing::InProcessGroup group(k);
    std::vector<core::HeadHealth> by_rank(ranges.size());
    group.RunOnAll([&](int rank) {
      const core::ShardRange& r = ranges[static_cast<size_t>(rank)];
      auto shard = core::Head::FromTensors(head->weight().narrow(0, r.offset, r.rows),
                                           head->bias().narrow(0, r.offset, r.rows),
                                           core::HeadOptions{});
      ASSERT_TRUE(shard.ok()) << shard.status();
      const core::VocabShard vocab_shard{.group = group.member(rank), .ranges = ranges};
      core::StepOptions options = Options(7, 3);
      options.shard = &vocab_shard;
      core::GradientBuffers shard_grads = (*shard)->NewGradientBuffers();
      auto result = core::FusedForwardBackward(**shard, batch, options, &shard_grads);
      ASSERT_TRUE(result.ok()) << "rank " << rank << ": " << result.status();
      by_rank[static_cast<size_t>(rank)] = result->stats.health;
    });
    for (const core::HeadHealth& h : by_rank) ExpectEqual(h, by_rank[0]);
    ExpectClose(by_rank[0], one->stats.health, 1e-6);
    ExpectClose(by_rank[0], Reference(*head, batch), 2e-6);
  }
}

}  // namespace
}  // namespace remotehead::head_health_test
