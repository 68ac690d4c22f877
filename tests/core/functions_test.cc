// The function registry: names, parameter resolution and range checks, and the seed's "other
// functions" (sigmoid-sum, MSE to one-hot) checked against their literal PyTorch definitions.
#include "remotehead/core/functions.h"

#include <gtest/gtest.h>

#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

using core::FunctionRegistry;

TEST(FunctionRegistry, HasEveryBuiltinFunction) {
  const std::vector<std::string> expected = {"cross_entropy", "entropy",       "grpo",
                                             "logits",        "mse_onehot",    "sample",
                                             "sigmoid_sum",   "token_logprobs"};
  EXPECT_EQ(FunctionRegistry::Builtin().Names(), expected);
  auto missing = FunctionRegistry::Builtin().Find("softmax_xyz");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(),
            "function: expected one of cross_entropy, entropy, grpo, logits, mse_onehot, sample, "
            "sigmoid_sum, token_logprobs; got \"softmax_xyz\"");
}

TEST(FunctionRegistry, ResolveParamsFillsDefaultsAndKeepsGivenValues) {
  const auto& registry = FunctionRegistry::Builtin();
  const core::TransformFunction* grpo = *registry.Find("grpo");
  auto params = registry.ResolveParams(*grpo, {{"epsilon_high", 0.28}, {"temperature", 0.9}});
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->at("epsilon_low"), 0.2);
  EXPECT_EQ(params->at("epsilon_high"), 0.28);
  EXPECT_EQ(params->at("beta"), 0.0);
  EXPECT_EQ(params->at("temperature"), 0.9);
  EXPECT_EQ(params->at("softcap"), 0.0);
}

TEST(FunctionRegistry, UnknownOrOutOfRangeParamsAreRejected) {
  const auto& registry = FunctionRegistry::Builtin();
  const core::TransformFunction* ce = *registry.Find("cross_entropy");
  EXPECT_EQ(registry.ResolveParams(*ce, {{"beta", 1.0}}).status().message(),
            "params[\"beta\"]: function cross_entropy expects only label_smoothing, z_loss, "
            "temperature, softcap");
  EXPECT_EQ(registry.ResolveParams(*ce, {{"label_smoothing", 1.5}}).status().message(),
            "params[\"label_smoothing\"]: expected a finite value in [0, 1]; got 1.5");
  EXPECT_EQ(registry.ResolveParams(*ce, {{"temperature", 0.0}}).status().message(),
            "params[\"temperature\"]: expected a finite value in [1e-06, inf]; got 0");
  EXPECT_EQ(registry.ResolveParams(*ce, {{"z_loss", NAN}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The seed's sigmoid-sum: sum(sigmoid(X·Wᵀ)) with reduction sum, and its gradients.
TEST(SeedFunctions, SigmoidSumEqualsTorchDefinition) {
  auto head = reference::MakeTestHead(300, 16, torch::kFloat, false);
  torch::Tensor x = torch::randn({40, 16});
  core::StepOptions options{
      .function = "sigmoid_sum", .reduction = core::Reduction::kSum, .chunk_rows = 9};
  auto result = core::FusedForwardBackward(*head, {.hidden = x}, options, &head->grads());
  ASSERT_TRUE(result.ok()) << result.status();

  torch::Tensor xr = x.clone().requires_grad_(true);
  torch::Tensor wr = head->weight().clone().requires_grad_(true);
  torch::Tensor loss = torch::sigmoid(torch::mm(xr, wr.t())).sum();
  loss.backward();
  EXPECT_LE(reference::RelativeError(result->loss, loss.item<double>()), 1e-6);
  // Both sides are fp32 sums over the vocabulary in different orders: relative 1e-5.
  EXPECT_LE(reference::RelativeError(result->grad_hidden, xr.grad()), 1e-5);
  EXPECT_LE(reference::RelativeError(head->grads().weight, wr.grad()), 1e-5);
}

// The seed's MSE: torch.nn.MSELoss(reduction="mean")(logits, one_hot(labels)).
TEST(SeedFunctions, MseOnehotMeanEqualsTorchMseLoss) {
  auto head = reference::MakeTestHead(120, 16, torch::kFloat, false);
  torch::Tensor x = torch::randn({33, 16});
  torch::Tensor labels = torch::randint(120, {33}, torch::kLong);
  core::StepOptions options{.function = "mse_onehot", .chunk_rows = 5};
  auto result =
      core::FusedForwardBackward(*head, {.hidden = x, .targets = labels}, options, &head->grads());
  ASSERT_TRUE(result.ok()) << result.status();

  torch::Tensor xr = x.clone().requires_grad_(true);
  torch::Tensor wr = head->weight().clone().requires_grad_(true);
  torch::Tensor logits = torch::mm(xr, wr.t());
  torch::Tensor loss =
      torch::mse_loss(logits, torch::nn::functional::one_hot(labels, 120).to(torch::kFloat));
  loss.backward();
  EXPECT_LE(reference::RelativeError(result->loss, loss.item<double>()), 1e-6);
  EXPECT_LE(reference::RelativeError(result->grad_hidden, xr.grad()), 1e-5);
  EXPECT_LE(reference::RelativeError(head->grads().weight, wr.grad()), 1e-5);
}

}  // namespace
}  // namespace remotehead
