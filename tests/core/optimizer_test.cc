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
                      double grad_scale) {
  core::OptimizerState state;
  for (int step = 0; step < 4; ++step) {
    const torch::Tensor gw = torch::randn(ref_w.sizes());
    const torch::Tensor gb = torch::randn(ref_b.sizes());
    head.grads().weight.copy_(gw);
    head.grads().bias.copy_(gb);
    ref_w.mutable_grad() = gw * grad_scale;
    ref_b.mutable_grad() = gb * grad_scale;
    ASSERT_TRUE(our_step(head, &state).ok());
    reference_optimizer.step();
    EXPECT_LE(reference::RelativeError(head.weight(), ref_w), 1e-5) << "step " << step;
    EXPECT_LE(reference::RelativeError(head.bias(), ref_b), 1e-5) << "step " << step;
  }
  EXPECT_EQ(head.version(), 4);
  EXPECT_EQ(state.steps, 4);
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

TEST(Optimizer, BadHyperParametersAndMixedOptimizersAreRejected) {
  auto head = reference::MakeTestHead(10, 4, torch::kFloat, false);
  core::OptimizerState state;
  const torch::Tensor before = head->weight().clone();
  EXPECT_EQ(core::SgdStep(*head, {.lr = 0}, 1.0, &state).message(),
            "sgd.lr: expected a finite value in (0, inf); got 0");
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
