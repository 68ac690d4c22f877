// Gradient accumulation: micro-batches with the whole batch's normaliser add up exactly to one
// call on the whole batch — the property Hugging Face's num_items_in_batch relies on.
#include <gtest/gtest.h>

#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

using core::Reduction;

class Accumulation : public ::testing::TestWithParam<Reduction> {};

TEST_P(Accumulation, MicroBatchesWithGlobalNormalizerEqualOneBigCall) {
  const Reduction reduction = GetParam();
  auto head = reference::MakeTestHead(211, 32, torch::kFloat, /*bias=*/true);
  const core::TokenBatch whole = reference::MakeTestBatch(*head, 90, "cross_entropy", reduction);
  core::StepOptions options{.reduction = reduction, .chunk_rows = 16};

  core::GradientBuffers big = head->NewGradientBuffers();
  auto one_call = core::FusedForwardBackward(*head, whole, options, &big);
  ASSERT_TRUE(one_call.ok()) << one_call.status();

  // The normaliser a trainer would send: the token count (mean) or the same constant 1.
  options.normalizer = one_call->stats.denominator;
  core::GradientBuffers accumulated = head->NewGradientBuffers();
  double loss_sum = 0;
  int64_t start = 0;
  for (const int64_t rows : {int64_t{25}, int64_t{41}, int64_t{24}}) {  // uneven micro-batches
    auto micro = core::FusedForwardBackward(*head, whole.Slice(start, rows), options, &accumulated);
    ASSERT_TRUE(micro.ok()) << micro.status();
    loss_sum += micro->loss;
    // Relative to dX's magnitude: another CPU's BLAS kernels sum in another order (an absolute
    // 1e-7 failed at |ΔdX| = 3e-7 on one).
    EXPECT_LE(
        reference::RelativeError(micro->grad_hidden, one_call->grad_hidden.narrow(0, start, rows)),
        1e-5);
    start += rows;
  }
  EXPECT_LE(reference::RelativeError(loss_sum, one_call->loss), 1e-6);
  EXPECT_LE(reference::RelativeError(accumulated.weight, big.weight), 1e-6);
  EXPECT_LE(reference::RelativeError(accumulated.bias, big.bias), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(ScalarReductions, Accumulation,
                         ::testing::Values(Reduction::kMean, Reduction::kSum,
                                           Reduction::kWeightedSum),
                         [](const auto& info) {
                           return std::string(core::ReductionName(info.param));
                         });

// Two-phase accumulation: per-token outputs now, upstream gradients later, into one buffer.
TEST(Accumulation, TwoPhaseBackwardAccumulatesLikeOneCall) {
  auto head = reference::MakeTestHead(150, 16, torch::kFloat, false);
  const core::TokenBatch whole =
      reference::MakeTestBatch(*head, 60, "token_logprobs", Reduction::kNone);
  const core::StepOptions options{
      .function = "token_logprobs", .reduction = Reduction::kNone, .chunk_rows = 7};
  const torch::Tensor upstream = torch::randn({60});
  core::GradientBuffers big = head->NewGradientBuffers();
  ASSERT_TRUE(core::Backward(*head, whole, options, upstream, &big).ok());
  core::GradientBuffers accumulated = head->NewGradientBuffers();
  for (int64_t start : {0, 30}) {
    auto dx = core::Backward(*head, whole.Slice(start, 30), options, upstream.narrow(0, start, 30),
                             &accumulated);
    ASSERT_TRUE(dx.ok()) << dx.status();
  }
  EXPECT_LE(reference::RelativeError(accumulated.weight, big.weight), 1e-6);
}

// A mean over zero valid tokens is 0 with zero gradients, not NaN: an all-padding micro-batch
// must not poison the accumulated gradient.
TEST(Accumulation, AllIgnoredMicroBatchContributesNothing) {
  auto head = reference::MakeTestHead(50, 8, torch::kFloat, false);
  core::TokenBatch batch = reference::MakeTestBatch(*head, 12, "cross_entropy", Reduction::kMean);
  batch.targets.fill_(-100);
  auto r = core::FusedForwardBackward(*head, batch, {}, &head->grads());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->loss, 0.0);
  EXPECT_EQ(r->stats.valid_tokens, 0);
  EXPECT_EQ(reference::MaxAbs(r->grad_hidden), 0.0);
  EXPECT_EQ(reference::MaxAbs(head->grads().weight), 0.0);
}

}  // namespace
}  // namespace remotehead
