// Server-side optimizer steps vs torch::optim (the reference implementation of the same rules),
// over several steps with changing gradients, bias included.
#include "remotehead/core/optimizer.h"

#include <torch/optim.h>
#include <gtest/gtest.h>

#include "core/reference.h"

namespace remotehead {
namespace {

// Runs `steps` steps of ours and of `reference_optimizer` on identical parameters/gradients.
template <typename OurStep>
void CompareWithTorch(OurStep our_step, torch::optim::Optimizer& reference_optimizer,
                      torch::Tensor& ref_w, torch::Tensor& ref_b, core::Head& head,
                      double grad_scale, double tolerance = 1e-5) {
  core::OptimizerState state;
  for (int step = 0; step < 4; ++step) {
    const torch::Tensor gw = torch::randn(ref_w.sizes(), ref_w.options());
    const torch::Tensor gb = torch::randn(ref_b.sizes(), ref_b.options());
    head.grads().weight.copy_(gw);
    head.grads().bias.copy_(gb);
    ref_w.mutable_grad() = gw * grad_scale;
    ref_b.mutable_grad() = gb * grad_scale;
    ASSERT_TRUE(our_step(head, &state).ok());
    reference_optimizer.step();
    EXPECT_LE(reference::RelativeError(head.weight(), ref_w), tolerance) << "step " << step;
    EXPECT_LE(reference::RelativeError(head.bias(), ref_b), tolerance) << "step " << step;
  }
  EXPECT_EQ(head.version(), 4);
  EXPECT_EQ(state.steps, 4);
  // The state is kept in the head's accumulation dtype (float64 for a float64 head), and the
  // bytes the server reserves before the first step are the bytes it holds after it.
  EXPECT_EQ(state.weight_buf1.scalar_type(), core::AccumulationDtype(head.dtype()));
}

TEST(Optimizer, SgdWithMomentumAndWeightDecayMatchesTorch) {
  auto head = reference::MakeTestHead(30, 8, torch::kFloat, true);
  torch::Tensor w = head->weight().clone().requires_grad_(true);
  torch::Tensor b = head->bias().clone().requires_grad_(true);
  torch::optim::SGD sgd({w, b}, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  const core::SgdOptions options{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01};
  CompareWithTorch(
      [&](core::Head& h, core::OptimizerState* s) { return core::SgdStep(h, options, 0.5, s); },
      sgd, w, b, *head, 0.5);
}

TEST(Optimizer, AdamWMatchesTorch) {
  auto head = reference::MakeTestHead(30, 8, torch::kFloat, true);
  torch::Tensor w = head->weight().clone().requires_grad_(true);
  torch::Tensor b = head->bias().clone().requires_grad_(true);
  torch::optim::AdamW adamw(
      {w, b}, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-6).weight_decay(0.1));
  const core::AdamWOptions options{
      .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1};
  CompareWithTorch(
      [&](core::Head& h, core::OptimizerState* s) { return core::AdamWStep(h, options, 1.0, s); },
      adamw, w, b, *head, 1.0);
}

// A float64 head computes its steps and keeps its state in float64: torch.optim on the same
// float64 tensors agrees to a few roundings (fp32 arithmetic left errors of ~1e-8 here).
TEST(Optimizer, Float64HeadStepsInFloat64) {
  auto head = reference::MakeTestHead(30, 8, torch::kDouble, true);
  ASSERT_EQ(head->grads().weight.scalar_type(), torch::kDouble);
  const core::AdamWOptions options{.lr = 1e-2, .weight_decay = 0.1};
  EXPECT_EQ(core::OptimizerStateBytesAfterStep(*head, {}, options), 2 * (30 * 9) * 8);
  torch::Tensor w = head->weight().clone().requires_grad_(true);
  torch::Tensor b = head->bias().clone().requires_grad_(true);
  torch::optim::AdamW adamw({w, b}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  CompareWithTorch(
      [&](core::Head& h, core::OptimizerState* s) { return core::AdamWStep(h, options, 1.0, s); },
      adamw, w, b, *head, 1.0, /*tolerance=*/1e-13);

  auto sgd_head = reference::MakeTestHead(30, 8, torch::kDouble, true);
  torch::Tensor sw = sgd_head->weight().clone().requires_grad_(true);
  torch::Tensor sb = sgd_head->bias().clone().requires_grad_(true);
  torch::optim::SGD sgd({sw, sb}, torch::optim::SGDOptions(0.1).momentum(0.9));
  CompareWithTorch(
      [&](core::Head& h, core::OptimizerState* s) {
        return core::SgdStep(h, {.lr = 0.1, .momentum = 0.9}, 2.0, s);
      },
      sgd, sw, sb, *sgd_head, 2.0, /*tolerance=*/1e-13);
}

// lr 0 is a step that changes no parameter, as in torch.optim (a warm-up schedule's first step):
// the state advances exactly as torch's does.
TEST(Optimizer, ZeroLearningRateIsANoOpStepAsInTorch) {
  auto head = reference::MakeTestHead(30, 8, torch::kFloat, true);
  const torch::Tensor before = head->weight().clone();
  torch::Tensor w = head->weight().clone().requires_grad_(true);
  torch::Tensor b = head->bias().clone().requires_grad_(true);
  torch::optim::AdamW adamw({w, b}, torch::optim::AdamWOptions(0.0));
  CompareWithTorch(
      [&](core::Head& h, core::OptimizerState* s) { return core::AdamWStep(h, {.lr = 0}, 1.0, s); },
      adamw, w, b, *head, 1.0);
  EXPECT_TRUE(torch::equal(head->weight(), before));

  auto sgd_head = reference::MakeTestHead(30, 8, torch::kFloat, true);
  const torch::Tensor sgd_before = sgd_head->weight().clone();
  core::OptimizerState state;
  sgd_head->grads().weight.normal_();
  ASSERT_TRUE(core::SgdStep(*sgd_head, {.lr = 0, .momentum = 0.9}, 1.0, &state).ok());
  EXPECT_TRUE(torch::equal(sgd_head->weight(), sgd_before));
  EXPECT_TRUE(torch::equal(state.weight_buf1, sgd_head->grads().weight)) << "momentum = grad";
  EXPECT_EQ(state.steps, 1);
}

TEST(Optimizer, BadHyperParametersAndMixedOptimizersAreRejected) {
  auto head = reference::MakeTestHead(10, 4, torch::kFloat, false);
  core::OptimizerState state;
  const torch::Tensor before = head->weight().clone();
  EXPECT_EQ(core::SgdStep(*head, {.lr = -0.1}, 1.0, &state).message(),
            "sgd.lr: expected a finite value in [0, inf); got -0.1");
  EXPECT_EQ(core::AdamWStep(*head, {.lr = INFINITY}, 1.0, &state).message(),
            "adamw.lr: expected a finite value in [0, inf); got inf");
  EXPECT_EQ(core::AdamWStep(*head, {.lr = 1e-3, .beta2 = 1.0}, 1.0, &state).message(),
            "adamw.beta2: expected a finite value in [0, 1); got 1");
  EXPECT_EQ(core::SgdStep(*head, {.lr = 0.1}, NAN, &state).message(),
            "grad_scale: expected a finite value; got nan");
  EXPECT_TRUE(torch::equal(head->weight(), before));
  EXPECT_EQ(head->version(), 0);
  ASSERT_TRUE(core::SgdStep(*head, {.lr = 0.1}, 1.0, &state).ok());
  const absl::Status mixed = core::AdamWStep(*head, {.lr = 1e-3}, 1.0, &state);
  EXPECT_EQ(mixed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(mixed.message(), "optimizer: expected sgd (this head's optimizer state); got adamw");
}

}  // namespace
}  // namespace remotehead
