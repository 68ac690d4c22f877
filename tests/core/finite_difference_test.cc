// Autograd-derived gradients vs central finite differences of the engine's own forward, in
// float64 on a tiny head, for every function: catches a wrong derivative that a reference
// sharing the same formula could not.
#include <gtest/gtest.h>

#include "core/function_cases.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

using FdCase = reference::FunctionCase;

class FiniteDifference : public ::testing::TestWithParam<FdCase> {};

TEST_P(FiniteDifference, GradientsMatchCentralDifferences) {
  const FdCase& c = GetParam();
  auto head = reference::MakeTestHead(7, 4, torch::kDouble, /*bias=*/true, /*seed=*/3,
                                      /*grad_dtype=*/torch::kDouble);
  core::TokenBatch batch =
      reference::MakeTestBatch(*head, 5, c.function, core::Reduction::kWeightedSum, 4);
  batch.hidden = batch.hidden.to(torch::kDouble);
  core::StepOptions options{.function = c.function,
                            .params = c.params,
                            .reduction = core::Reduction::kWeightedSum,
                            .chunk_rows = 2,
                            .teacher = reference::TestTeacher(*head, c.function)};

  auto fused = core::FusedForwardBackward(*head, batch, options, &head->grads());
  ASSERT_TRUE(fused.ok()) << fused.status();
  auto loss_at = [&](const core::TokenBatch& b) {
    auto r = core::Forward(*head, b, options);
    EXPECT_TRUE(r.ok()) << r.status();
    return r->output.item<double>();
  };
  EXPECT_NEAR(fused->loss, loss_at(batch), 1e-12);

  constexpr double kStep = 1e-6;
  // Central differences are accurate to O(h²) ≈ 1e-12 plus rounding ≈ 1e-10 / h.
  constexpr double kTol = 1e-6;
  auto check = [&](torch::Tensor param, const torch::Tensor& analytic, const char* what) {
    torch::NoGradGuard no_grad;
    auto flat = param.view(-1);
    const auto grad = analytic.reshape(-1);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double saved = flat[i].item<double>();
      flat[i] = saved + kStep;
      const double up = loss_at(batch);
      flat[i] = saved - kStep;
      const double down = loss_at(batch);
      flat[i] = saved;
      EXPECT_NEAR(grad[i].item<double>(), (up - down) / (2 * kStep), kTol)
          << what << "[" << i << "]";
    }
  };
  check(batch.hidden, fused->grad_hidden, "dX");
  check(head->mutable_weight(), head->grads().weight, "dW");
  check(head->mutable_bias(), head->grads().bias, "db");
}

// Every registered function with its defaults, each own param, softcap + temperature, and all
// options together (function_cases.h) — but the surrogate objectives, whose gradient is by
// definition not their value's derivative (TransformFunction::surrogate_gradient: the engine
// parity suite holds them to their references' autograd).
INSTANTIATE_TEST_SUITE_P(AllFunctions, FiniteDifference,
                         ::testing::ValuesIn(reference::DerivedCases(
                             reference::CaseSet::kEveryOption,
                             [](const core::TransformFunction& fn) {
                               return !fn.surrogate_gradient;
                             })),
                         [](const ::testing::TestParamInfo<FdCase>& info) {
                           return info.param.label;
                         });

}  // namespace
}  // namespace remotehead
