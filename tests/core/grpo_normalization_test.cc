// GRPO's loss normalisations as TRL's GRPOTrainer writes them — grpo, bnpo, dr_grpo, dapo —
// are each one engine call: per-token weights and/or a normalizer. The reference is TRL's
// formula on the [B, T] per-token loss matrix, differentiated by autograd in float64.
#include <gtest/gtest.h>

#include "core/reference.h"
#include "remotehead/core/engine.h"

// Its own namespace: the file is compiled in one unit with the target's other files
// (cmake/RemoteheadUnity.cmake), whose shapes and helpers have the same names.
namespace remotehead::grpo_normalization_test {
namespace {

using core::Reduction;

constexpr int64_t kSequences = 4;  // B completions
constexpr int64_t kMaxLen = 9;     // T (max_completion_length)
constexpr int64_t kVocab = 53;
constexpr int64_t kHidden = 16;

struct Normalisation {
  std::string loss_type;
  // TRL: the loss from per_token_loss [B, T] and completion_mask [B, T] (both float64).
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> trl_loss;
  // The engine call that expresses it.
  std::function<void(const torch::Tensor& mask, core::TokenBatch&, core::StepOptions&)> engine;
};

class GrpoNormalisation : public ::testing::TestWithParam<Normalisation> {};

void PrintTo(const Normalisation& n, std::ostream* os) { *os << n.loss_type; }

TEST_P(GrpoNormalisation, OneEngineCallEqualsTrlsFormula) {
  const Normalisation& norm = GetParam();
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  const int64_t rows = kSequences * kMaxLen;
  core::TokenBatch batch = reference::MakeTestBatch(*head, rows, "grpo", Reduction::kNone);
  // Completions of different lengths (1, 3, 6, 9 tokens), the rest padding.
  torch::Tensor mask = torch::zeros({kSequences, kMaxLen}, torch::kDouble);
  const int64_t lengths[kSequences] = {1, 3, 6, 9};
  for (int64_t b = 0; b < kSequences; ++b) mask[b].narrow(0, 0, lengths[b]).fill_(1);
  batch.targets = batch.targets.clamp_min(0).masked_fill(mask.reshape(-1) == 0, -100);
  const core::FunctionParams params = {{"beta", 0.04}, {"epsilon_high", 0.28}};

  // Reference: TRL's loss on float64 full logits, autograd to X.
  torch::Tensor x = batch.hidden.to(torch::kDouble).requires_grad_(true);
  torch::Tensor z = torch::mm(x, head->weight().to(torch::kDouble).t());
  torch::Tensor per_token =
      reference::ReferencePerToken("grpo", z, batch, batch.targets.clamp_min(0), params)
          .reshape({kSequences, kMaxLen});
  torch::Tensor loss = norm.trl_loss(per_token, mask);
  loss.backward();

  core::StepOptions options{.function = "grpo", .params = params, .chunk_rows = 7};
  norm.engine(mask, batch, options);
  auto result = core::FusedForwardBackward(*head, batch, options, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->loss, loss.item<double>(),
              1e-5 * std::max(1.0, std::abs(loss.item<double>())));
  EXPECT_LE(reference::RelativeError(result->grad_hidden, x.grad()), 2e-5);
}

torch::Tensor Lengths(const torch::Tensor& mask) { return mask.sum(-1).clamp_min(1.0); }

INSTANTIATE_TEST_SUITE_P(
    TrlLossTypes, GrpoNormalisation,
    ::testing::Values(
        // grpo: mean over each sequence's tokens, then over sequences.
        Normalisation{
            "grpo",
            [](const torch::Tensor& l, const torch::Tensor& m) {
              return ((l * m).sum(-1) / Lengths(m)).mean();
            },
            [](const torch::Tensor& m, core::TokenBatch& b, core::StepOptions& o) {
              o.reduction = Reduction::kWeightedSum;
              b.weights =
                  (m / (Lengths(m).unsqueeze(1) * kSequences)).reshape(-1).to(torch::kFloat);
            }},
        // bnpo: mean over all completion tokens of the batch.
        Normalisation{"bnpo",
                      [](const torch::Tensor& l, const torch::Tensor& m) {
                        return (l * m).sum() / m.sum().clamp_min(1.0);
                      },
                      [](const torch::Tensor&, core::TokenBatch&, core::StepOptions& o) {
                        o.reduction = Reduction::kMean;
                      }},
        // dr_grpo: sum over tokens / (B · max_completion_length).
        Normalisation{"dr_grpo",
                      [](const torch::Tensor& l, const torch::Tensor& m) {
                        return (l * m).sum() / static_cast<double>(kSequences * kMaxLen);
                      },
                      [](const torch::Tensor&, core::TokenBatch&, core::StepOptions& o) {
                        o.reduction = Reduction::kSum;
                        o.normalizer = static_cast<double>(kSequences * kMaxLen);
                      }},
        // dapo: sum over tokens / completion tokens of the whole (global) batch, here 2× ours.
        Normalisation{"dapo",
                      [](const torch::Tensor& l, const torch::Tensor& m) {
                        return (l * m).sum() / (2.0 * m.sum());
                      },
                      [](const torch::Tensor& m, core::TokenBatch&, core::StepOptions& o) {
                        o.reduction = Reduction::kSum;
                        o.normalizer = 2.0 * m.sum().item<double>();
                      }}),
    [](const ::testing::TestParamInfo<Normalisation>& info) { return info.param.loss_type; });

}  // namespace
}  // namespace remotehead::grpo_normalization_test
