// Every bad input gets InvalidArgument with a message naming the field, the expected and the
// actual value — and leaves the accumulated gradients bit-identical.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "core/reference.h"
#include "remotehead/core/engine.h"

namespace remotehead {
namespace {

using core::Reduction;

constexpr int64_t kVocab = 40;
constexpr int64_t kHidden = 8;
constexpr int64_t kRows = 10;

struct BadCase {
  std::string label;
  std::function<void(core::TokenBatch&, core::StepOptions&)> corrupt;
  std::string message;  // the exact status message
};

class Validation : public ::testing::Test {
 protected:
  void SetUp() override {
    head_ = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
    // Non-zero accumulated state, so "unchanged" is a real check.
    head_->grads().weight.normal_();
    head_->grads().bias.normal_();
    weight_before_ = head_->grads().weight.clone();
    bias_before_ = head_->grads().bias.clone();
  }

  core::TokenBatch GoodBatch(const std::string& function = "cross_entropy") {
    return reference::MakeTestBatch(*head_, kRows, function, Reduction::kMean);
  }

  void ExpectStateUnchanged() {
    EXPECT_TRUE(torch::equal(head_->grads().weight, weight_before_));
    EXPECT_TRUE(torch::equal(head_->grads().bias, bias_before_));
  }

  void ExpectRejectedEverywhere(const BadCase& c) {
    SCOPED_TRACE(c.label);
    core::TokenBatch batch = GoodBatch();
    core::StepOptions options;
    c.corrupt(batch, options);
    auto fused = core::FusedForwardBackward(*head_, batch, options, &head_->grads());
    ASSERT_FALSE(fused.ok());
    EXPECT_EQ(fused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(fused.status().message(), c.message);
    auto forward = core::Forward(*head_, batch, options);
    EXPECT_EQ(forward.status().message(), c.message);
    auto backward = core::Backward(*head_, batch, options, torch::ones({}), &head_->grads());
    EXPECT_EQ(backward.status().message(), c.message);
    ExpectStateUnchanged();
  }

  std::unique_ptr<core::Head> head_;
  torch::Tensor weight_before_;
  torch::Tensor bias_before_;
};

TEST_F(Validation, GoodInputIsAccepted) {
  core::TokenBatch batch = GoodBatch();
  auto r = core::Forward(*head_, batch, {});
  ASSERT_TRUE(r.ok()) << r.status();
}

// The finite-values check sums the rows first (engine_inputs.cc): finite values whose sum
// overflows are still finite values, and a NaN among them is still found and named.
TEST_F(Validation, FiniteValuesWhoseSumOverflowsAreAccepted) {
  core::TokenBatch batch = GoodBatch();
  batch.hidden[2][1] = 3e38f;
  batch.hidden[5][0] = 3e38f;
  ASSERT_FALSE(std::isfinite(batch.hidden.sum().item<double>()));
  auto r = core::Forward(*head_, batch, {});
  EXPECT_TRUE(r.ok()) << r.status();
  batch.hidden[7][2] = NAN;
  r = core::Forward(*head_, batch, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "hidden[7]: expected finite values; got NaN or Inf");
}

TEST_F(Validation, BadInputsAreRejectedWithPreciseMessagesAndNoStateChange) {
  using B = core::TokenBatch;
  using O = core::StepOptions;
  const std::vector<BadCase> cases = {
      {"unknown function", [](B&, O& o) { o.function = "softmax"; },
       "function: expected one of cispo, cross_entropy, distill_jsd, distill_kl, "
       "distill_reverse_kl, distill_topk_kl, distill_topk_reverse_kl, entropy, grpo, logits, "
       "mse_onehot, sample, sapo, sigmoid_sum, token_logprobs, vespo; got \"softmax\""},
      {"unknown param", [](B&, O& o) { o.params["epsilon"] = 0.1; },
       "params[\"epsilon\"]: function cross_entropy expects only label_smoothing, z_loss, "
       "temperature, softcap, logit_scale"},
      {"param out of range", [](B&, O& o) { o.params["label_smoothing"] = -0.5; },
       "params[\"label_smoothing\"]: expected a finite value in [0, 1]; got -0.5"},
      {"wrong hidden size",
       [](B& b, O&) {
         b.hidden = torch::randn({kRows, kHidden + 1});
       },
       "hidden: expected shape [N, 8]; got [10, 9]"},
      {"hidden 3-D",
       [](B& b, O&) {
         b.hidden = torch::randn({2, 5, kHidden});
       },
       "hidden: expected shape [N, 8]; got [2, 5, 8]"},
      {"missing hidden", [](B& b, O&) { b.hidden = torch::Tensor(); },
       "hidden: expected shape [N, 8]; got no tensor"},
      {"hidden dtype", [](B& b, O&) { b.hidden = b.hidden.to(torch::kBFloat16); },
       "hidden.dtype: expected float32 (the head's); got bfloat16"},
      {"NaN in hidden", [](B& b, O&) { b.hidden[6][3] = NAN; },
       "hidden[6]: expected finite values; got NaN or Inf"},
      {"Inf in hidden, chunked",
       [](B& b, O& o) {
         b.hidden[9][0] = INFINITY;
         o.chunk_rows = 4;
       },
       "hidden[9]: expected finite values; got NaN or Inf"},
      {"target too large", [](B& b, O&) { b.targets[3] = kVocab; },
       "targets[3]: expected a token id in [0, 40) or ignore_index (-100); got 40"},
      {"negative target", [](B& b, O&) { b.targets[0] = -1; },
       "targets[0]: expected a token id in [0, 40) or ignore_index (-100); got -1"},
      {"custom ignore_index",
       [](B& b, O& o) {
         b.targets.clamp_min_(0);
         b.targets[2] = -100;
         o.ignore_index = -1;
       },
       "targets[2]: expected a token id in [0, 40) or ignore_index (-1); got -100"},
      {"targets length", [](B& b, O&) { b.targets = b.targets.narrow(0, 0, kRows - 1); },
       "targets: expected shape [10] (one per row of hidden); got [9]"},
      {"float targets", [](B& b, O&) { b.targets = b.targets.to(torch::kFloat); },
       "targets: expected dtype int64 or int32; got float32"},
      {"missing targets", [](B& b, O&) { b.targets = torch::Tensor(); },
       "targets: function cross_entropy needs per-token targets [10]; got none"},
      {"weights without weighted_sum", [](B& b, O&) { b.weights = torch::ones({kRows}); },
       "weights: only used by reduction weighted_sum; got weights with reduction mean"},
      {"weighted_sum without weights", [](B&, O& o) { o.reduction = Reduction::kWeightedSum; },
       "weights: reduction weighted_sum needs per-token weights [10]; got none"},
      {"NaN weight",
       [](B& b, O& o) {
         o.reduction = Reduction::kWeightedSum;
         b.weights = torch::ones({kRows});
         b.weights[4] = NAN;
       },
       "weights[4]: expected a finite value; got nan"},
      {"unknown aux", [](B& b, O&) { b.aux["advantages"] = torch::ones({kRows}); },
       "aux[\"advantages\"]: function cross_entropy accepts no per-token inputs"},
      {"zero normalizer", [](B&, O& o) { o.normalizer = 0.0; },
       "normalizer: expected a finite value > 0; got 0"},
      {"NaN upstream scale", [](B&, O& o) { o.upstream_scale = NAN; },
       "upstream_scale: expected a finite value; got nan"},
      {"negative chunk_rows", [](B&, O& o) { o.chunk_rows = -3; },
       "chunk_rows: expected >= 1 (or 0 to derive it from memory_budget_bytes); got -3"},
      {"negative block_rows", [](B&, O& o) { o.block_rows = -1; },
       "block_rows: expected >= 1 (or 0 for the default); got -1"},
      {"budget below one row", [](B&, O& o) { o.memory_budget_bytes = 100; },
       "memory_budget_bytes: expected at least 2784 (one row of cross_entropy at V=40); got 100"},
      {"negative budget", [](B&, O& o) { o.memory_budget_bytes = -1; },
       "memory_budget_bytes: expected >= 1 (or 0 for the default 100663296); got -1"},
  };
  for (const BadCase& c : cases) ExpectRejectedEverywhere(c);
}

TEST_F(Validation, GrpoAuxInputsAreChecked) {
  core::StepOptions options{.function = "grpo", .params = {{"beta", 0.1}}};
  core::TokenBatch batch = GoodBatch("grpo");
  batch.aux.erase("ref_logprobs");
  EXPECT_EQ(core::FusedForwardBackward(*head_, batch, options, &head_->grads()).status().message(),
            "aux[\"ref_logprobs\"]: expected per-token reference log-probs because beta = 0.1 > "
            "0; got none");
  batch = GoodBatch("grpo");
  batch.aux.erase("advantages");
  EXPECT_EQ(core::FusedForwardBackward(*head_, batch, options, &head_->grads()).status().message(),
            "aux[\"advantages\"]: function grpo needs this per-token input; got none");
  batch = GoodBatch("grpo");
  batch.aux["old_logprobs"] = torch::zeros({kRows + 2});
  EXPECT_EQ(core::FusedForwardBackward(*head_, batch, options, &head_->grads()).status().message(),
            "aux[\"old_logprobs\"]: expected shape [10] (one per row of hidden); got [12]");
  batch = GoodBatch("grpo");
  batch.aux["kl_coef"] = torch::zeros({kRows});
  EXPECT_EQ(core::FusedForwardBackward(*head_, batch, options, &head_->grads()).status().message(),
            "aux[\"kl_coef\"]: function grpo accepts only advantages, old_logprobs, ref_logprobs, "
            "importance_sampling_ratio, policy_mask, sampling_logprobs, sequence_ids");
  ExpectStateUnchanged();
}

TEST_F(Validation, ModeSpecificErrors) {
  const core::TokenBatch batch = GoodBatch();
  core::StepOptions none{.reduction = Reduction::kNone};
  EXPECT_EQ(core::FusedForwardBackward(*head_, batch, none, &head_->grads()).status().message(),
            "reduction: fused mode needs a scalar loss (sum, mean or weighted_sum); got none — "
            "use Forward then Backward for per-token outputs");
  EXPECT_EQ(
      core::Backward(*head_, batch, none, torch::ones({3}), &head_->grads()).status().message(),
      "grad_output: expected shape [10] (one per row of hidden); got [3]");
  EXPECT_EQ(core::Backward(*head_, batch, {}, torch::ones({2}), &head_->grads()).status().message(),
            "grad_output: expected one floating value (the gradient of the mean loss); got [2]");
  EXPECT_EQ(
      core::Backward(*head_, batch, {}, torch::full({}, NAN), &head_->grads()).status().message(),
      "grad_output: expected a finite value; got nan");
  core::GradientBuffers wrong{.weight = torch::zeros({kVocab, kHidden + 1})};
  EXPECT_EQ(core::FusedForwardBackward(*head_, batch, {}, &wrong).status().message(),
            "grads.weight: expected [40, 8] float32 or float32 on cpu; got [40, 9] float32 on cpu");
  EXPECT_EQ(core::FusedForwardBackward(*head_, batch, {}, &head_->grads(), torch::zeros({3, 3}))
                .status()
                .message(),
            "grad_hidden_out: expected a contiguous [10, 8] float32 tensor on cpu; got [3, 3]");
  ExpectStateUnchanged();
  EXPECT_EQ(core::ParseReduction("avg").status().message(),
            "reduction: expected one of none, sum, mean, weighted_sum; got \"avg\"");
}

}  // namespace
}  // namespace remotehead
