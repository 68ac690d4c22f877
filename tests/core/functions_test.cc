// The function registry: every function has a reference and the reference table no other
// function, the cases the suites derive from the registry are valid, parameter resolution and
// range checks, and the seed's "other functions" (sigmoid-sum, MSE to one-hot) checked against
// their literal PyTorch definitions.
#include "remotehead/core/functions.h"

#include <torch/nn/functional.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

using core::FunctionRegistry;

// The reference table (reference.h) and the registry name the same functions: a function
// registered without a reference, or a reference left after its function, fails here. A per-token
// function's entry has a per-token reference; a generation output's has none (generation_test).
TEST(FunctionRegistry, EveryFunctionHasAReferenceAndEveryReferenceAFunction) {
  const auto& registry = FunctionRegistry::Builtin();
  const auto& references = reference::ReferenceFunctions();
  for (const core::TransformFunction* fn : registry.Functions()) {
    const auto entry = references.find(fn->name);
    if (entry == references.end()) {
      ADD_FAILURE() << fn->name << ": registered without a reference; add its entry to "
                    << "ReferenceFunctions() in tests/core/reference.cc";
      continue;
    }
    EXPECT_EQ(static_cast<bool>(entry->second.per_token) + static_cast<bool>(entry->second.sampled),
              fn->output == core::OutputKind::kPerToken && !fn->needs_teacher ? 1 : 0)
        << fn->name << ": a per-token function needs a per_token (or sampled) reference, a "
        << "generation output none";
    EXPECT_EQ(static_cast<bool>(entry->second.two_head), fn->needs_teacher)
        << fn->name << ": a two-head function needs a two_head reference (and only it)";
    for (const auto& [param, value] : entry->second.test_values) {
      bool own = false;
      for (const core::ParamSpec& spec : fn->params) own = own || spec.name == param;
      EXPECT_TRUE(own) << fn->name << ": test_values names " << param << ", not one of its params";
    }
  }
  for (const auto& [name, entry] : references) {
    EXPECT_TRUE(registry.Find(name).ok()) << name << ": a reference for no registered function";
  }
}

TEST(FunctionRegistry, AnUnknownNameIsRefusedNamingTheKnownOnes) {
  std::vector<std::string> known;
  for (const auto& [name, entry] : reference::ReferenceFunctions()) known.push_back(name);
  auto missing = FunctionRegistry::Builtin().Find("softmax_xyz");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(),
            "function: expected one of " + absl::StrJoin(known, ", ") + "; got \"softmax_xyz\"");
}

// The cases the engine's suites derive (function_cases.h) are valid calls that test what they
// say: every param they set resolves, every own param of every function has a case of its own
// with a value other than its default, and the function's validate accepts each case with the
// aux inputs MakeTestBatch gives it (which include every required one).
TEST(FunctionRegistry, DerivedCasesAreValidAndCoverEveryParam) {
  const auto& registry = FunctionRegistry::Builtin();
  auto head = reference::MakeTestHead(11, 4, torch::kFloat, false);
  const std::vector<reference::FunctionCase> cases = reference::DerivedCases();
  std::set<std::string> labels;
  for (const reference::FunctionCase& c : cases) {
    SCOPED_TRACE(c.label);
    EXPECT_TRUE(labels.insert(c.label).second) << "two cases named " << c.label;
    const core::TransformFunction* fn = *registry.Find(c.function);
    auto params = registry.ResolveParams(*fn, c.params);
    ASSERT_TRUE(params.ok()) << params.status();
    const core::TokenBatch batch =
        reference::MakeTestBatch(*head, 6, c.function, core::Reduction::kMean);
    for (const std::string& aux : fn->required_aux) EXPECT_TRUE(batch.aux.contains(aux)) << aux;
    if (fn->validate) {
      const absl::Status valid = fn->validate(*params, batch.aux, batch.targets.defined());
      EXPECT_TRUE(valid.ok()) << valid;
    }
  }
  for (const core::TransformFunction* fn : registry.Functions()) {
    if (fn->output != core::OutputKind::kPerToken) continue;
    EXPECT_TRUE(labels.contains(fn->name)) << fn->name << ": no case with the defaults";
    EXPECT_TRUE(labels.contains(fn->name + "_softcap_temp")) << fn->name;
    for (const core::ParamSpec& spec : fn->params) {
      SCOPED_TRACE(fn->name + "." + spec.name);
      const double value = reference::TestValue(fn->name, spec);
      EXPECT_NE(value, spec.default_value);
      EXPECT_GE(value, spec.min_value);
      EXPECT_LE(value, spec.max_value);
      EXPECT_TRUE(labels.contains(fn->name + "_" + spec.name));
    }
  }
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
            "temperature, softcap, logit_scale");
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
