// The generation outputs of a Forward (function "logits" and "sample", OutputKind in
// functions.h), against independent references:
// - logits equal the naive X·Wᵀ (+ b) with softcap and temperature (fp32 head: relative 1e-6;
//   bf16 head: the bf16 product upcast, within one bf16 rounding), in the requested dtype, and
//   do not depend on the chunk size;
// - sample: greedy is the argmax; a seeded draw is torch::multinomial of HF's warped
//   probabilities with a CPU generator seeded seed + row, whatever the chunking; top-k / top-p
//   draw only inside their sets; the log-prob is log_softmax of the transformed logits;
// - refusals: a gradient mode, a scalar reduction, targets, bad params.
// The logits, their dtype and greedy sampling run on every device (tests/support/devices.h:
// the CUDA twin skipped, saying so, without a GPU). On CUDA a chunk's GEMM may sum in another
// order than the whole product's (cuBLAS picks its algorithm by shape): fp32 within 1e-5, bf16
// within one bf16 rounding, and greedy picks a largest logit (ties within that tolerance).
// (On a head group both run too: vocab_parallel_test.cc.)
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>

#include "absl/strings/match.h"
#include "core/reference.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/sampling.h"
#include "remotehead/core/vocab_group.h"
#include "support/devices.h"

namespace remotehead {
namespace {

using core::Reduction;

constexpr int64_t kVocab = 97;
constexpr int64_t kHidden = 16;
constexpr int64_t kRows = 11;

core::TokenBatch Hidden(const core::Head& head, int64_t rows = kRows, uint64_t seed = 3) {
  torch::manual_seed(seed);
  core::TokenBatch batch;
  batch.hidden = torch::randn({rows, head.hidden_size()}).to(head.device(), head.dtype());
  return batch;
}

core::StepOptions Generation(const std::string& function, core::FunctionParams params = {},
                             int64_t chunk_rows = 0) {
  core::StepOptions o;
  o.function = function;
  o.reduction = Reduction::kNone;
  o.params = std::move(params);
  o.chunk_rows = chunk_rows;
  return o;
}

// The naive logits, in fp32: the head's-dtype product, upcast, soft-capped, divided.
torch::Tensor NaiveLogits(const core::Head& head, const torch::Tensor& x, double softcap = 0,
                          double temperature = 1) {
  torch::Tensor z = torch::mm(x, head.weight().t());
  if (head.has_bias()) z = z + head.bias();
  z = z.to(torch::kFloat);
  if (softcap > 0) z = torch::tanh(z / softcap) * softcap;
  return z / temperature;
}

class GenerationOnDevice : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device()); }
  torch::Device device() const { return torch::Device(GetParam()); }
  std::unique_ptr<core::Head> Head(torch::ScalarType dtype, bool bias) const {
    return reference::MakeTestHead(kVocab, kHidden, dtype, bias, /*seed=*/1, torch::kFloat,
                                   device());
  }
  // fp32: the same sums on the CPU; another GEMM order on CUDA.
  double Tolerance() const { return device().is_cuda() ? 1e-5 : 1e-6; }
};

TEST_P(GenerationOnDevice, LogitsEqualTheNaiveProductWhateverTheChunking) {
  for (const bool bias : {false, true}) {
    auto head = Head(torch::kFloat, bias);
    const core::TokenBatch batch = Hidden(*head);
    const torch::Tensor expected = NaiveLogits(*head, batch.hidden, 2.5, 0.7).cpu();
    for (const int64_t chunk : {0, 1, 4, 64}) {
      auto r = core::Forward(*head, batch,
                             Generation("logits", {{"softcap", 2.5}, {"temperature", 0.7}}, chunk));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->output.sizes(), (std::vector<int64_t>{kRows, kVocab}));
      EXPECT_EQ(r->output.scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::allclose(r->output.cpu(), expected, Tolerance(), Tolerance()))
          << "chunk_rows " << chunk;
      EXPECT_FALSE(r->token_ids.defined());
    }
  }
}

TEST_P(GenerationOnDevice, LogitsComeInTheRequestedDtype) {
  auto head = Head(torch::kBFloat16, false);
  const core::TokenBatch batch = Hidden(*head);
  core::StepOptions options = Generation("logits");
  options.output_dtype = torch::kBFloat16;
  auto r = core::Forward(*head, batch, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output.scalar_type(), torch::kBFloat16);
  const torch::Tensor naive = NaiveLogits(*head, batch.hidden).to(torch::kBFloat16).cpu();
  if (device().is_cuda()) {  // one bf16 rounding apart at most
    EXPECT_TRUE(torch::allclose(r->output.cpu().to(torch::kFloat), naive.to(torch::kFloat),
                                1.0 / 128, 1e-3));
  } else {
    EXPECT_TRUE(torch::equal(r->output.cpu(), naive));
  }
  options.output_dtype = torch::kLong;
  auto bad = core::Forward(*head, batch, options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "output_dtype: expected a floating dtype; got Long");
}

TEST_P(GenerationOnDevice, GreedyIsTheArgmaxWithItsLogProb) {
  auto head = Head(torch::kFloat, true);
  const core::TokenBatch batch = Hidden(*head);
  auto r =
      core::Forward(*head, batch, Generation("sample", {{"greedy", 1}, {"temperature", 0.5}}, 4));
  ASSERT_TRUE(r.ok()) << r.status();
  const torch::Tensor z = NaiveLogits(*head, batch.hidden, 0, 0.5).cpu();
  const torch::Tensor ids = r->token_ids.cpu();
  if (device().is_cuda()) {  // a largest logit, to the GEMM's rounding
    const torch::Tensor picked = z.gather(1, ids.unsqueeze(1)).squeeze(1);
    EXPECT_TRUE((picked >= std::get<0>(z.max(1)) - 1e-4).all().item<bool>());
  } else {
    EXPECT_TRUE(torch::equal(ids, z.argmax(1)));
  }
  EXPECT_TRUE(torch::allclose(r->output.cpu(),
                              z.log_softmax(1).gather(1, ids.unsqueeze(1)).squeeze(1), Tolerance(),
                              Tolerance()));
}

INSTANTIATE_TEST_SUITE_P(Devices, GenerationOnDevice, ::testing::ValuesIn(testing::TestDevices()),
                         [](const auto& info) { return testing::DeviceLabel(info.param); });

// Hugging Face's warpers, written out: top-k then top-p on the transformed logits.
torch::Tensor WarpedProbabilities(torch::Tensor z, int64_t top_k, double top_p) {
  const float inf = std::numeric_limits<float>::infinity();
  if (top_k > 0) {
    const torch::Tensor kth = std::get<0>(z.topk(top_k, 1)).narrow(1, top_k - 1, 1);
    z = z.masked_fill(z < kth, -inf);
  }
  if (top_p < 1) {
    const auto [sorted, idx] = z.sort(1, false);
    torch::Tensor remove = sorted.softmax(1).cumsum(1) <= 1 - top_p;
    remove.narrow(1, z.size(1) - 1, 1).fill_(false);
    z = z.masked_fill(remove.scatter(1, idx, remove), -inf);
  }
  return z.softmax(1);
}

TEST(GenerationSample, SeededDrawIsMultinomialWithOneGeneratorPerRow) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  const core::TokenBatch batch = Hidden(*head);
  const core::FunctionParams params = {
      {"temperature", 1.3}, {"top_k", 30}, {"top_p", 0.9}, {"seed", 77}};
  const torch::Tensor z = NaiveLogits(*head, batch.hidden, 0, 1.3);
  const torch::Tensor probs = WarpedProbabilities(z, 30, 0.9);
  torch::Tensor expected = torch::empty({kRows}, torch::kLong);
  for (int64_t i = 0; i < kRows; ++i) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(77 + i);
    expected[i] = torch::multinomial(probs[i], 1, false, gen)[0];
  }
  for (const int64_t chunk : {1, 3, 64}) {
    auto r = core::Forward(*head, batch, Generation("sample", params, chunk));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(torch::equal(r->token_ids, expected)) << "chunk_rows " << chunk;
    EXPECT_TRUE(torch::allclose(
        r->output, z.log_softmax(1).gather(1, expected.unsqueeze(1)).squeeze(1), 1e-6, 1e-6));
  }
  // A request's rows are numbered from first_row: row i of a later batch draws with seed + i.
  core::StepOptions later = Generation("sample", params);
  later.first_row = 5;
  auto tail = core::Forward(*head, batch.Slice(5, kRows - 5), later);
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_TRUE(torch::equal(tail->token_ids, expected.narrow(0, 5, kRows - 5)));
}

TEST(GenerationSample, TopKAndTopPDrawOnlyInsideTheirSets) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  const core::TokenBatch batch = Hidden(*head, 64);
  const torch::Tensor z = NaiveLogits(*head, batch.hidden);
  auto topk = core::Forward(*head, batch, Generation("sample", {{"top_k", 3}, {"seed", 5}}));
  ASSERT_TRUE(topk.ok()) << topk.status();
  const torch::Tensor allowed = std::get<1>(z.topk(3, 1));
  EXPECT_TRUE((allowed == topk->token_ids.unsqueeze(1)).any(1).all().item<bool>());
  auto topp = core::Forward(*head, batch, Generation("sample", {{"top_p", 1e-6}, {"seed", 5}}));
  ASSERT_TRUE(topp.ok()) << topp.status();
  EXPECT_TRUE(torch::equal(topp->token_ids, z.argmax(1)));  // only the most likely survives
}

TEST(GenerationRefusals, NameTheFieldExpectedAndActual) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  core::TokenBatch batch = Hidden(*head);
  core::GradientBuffers grads = head->NewGradientBuffers();
  core::StepOptions mean = Generation("logits");
  mean.reduction = Reduction::kMean;
  auto fused = core::FusedForwardBackward(*head, batch, mean, &grads);
  EXPECT_EQ(fused.status().message(),
            "function: \"logits\" is a generation output with no gradient: expected a Forward; "
            "got ForwardBackward");
  auto scalar = core::Forward(*head, batch, mean);
  EXPECT_EQ(scalar.status().message(),
            "function.reduction: \"logits\" returns rows, not a loss: expected none; got mean");
  core::TokenBatch with_targets = batch;
  with_targets.targets = torch::zeros({kRows}, torch::kLong);
  auto targets = core::Forward(*head, with_targets, Generation("sample"));
  EXPECT_EQ(targets.status().message(),
            "targets: function sample takes none (it is computed from hidden alone); got [11]");
  auto greedy = core::Forward(*head, batch, Generation("sample", {{"greedy", 0.5}}));
  EXPECT_EQ(greedy.status().message(), "params[\"greedy\"]: expected 0 or 1; got 0.5");
  auto top_k = core::Forward(*head, batch, Generation("sample", {{"top_k", 2.5}}));
  EXPECT_EQ(top_k.status().message(), "params[\"top_k\"]: expected a whole number; got 2.5");
  // Nothing was accumulated by any refused call.
  EXPECT_EQ(grads.weight.abs().sum().item<double>(), 0.0);
}

// Logits that overflow (a head whose weights are too large, or a temperature that makes them
// infinite) have no probabilities: every sampling mode refuses them naming the cause and the
// row, instead of failing inside torch::multinomial.
TEST(GenerationSample, NonFiniteLogitsAreRefusedNamingTheCause) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  const core::TokenBatch batch = Hidden(*head);
  const std::vector<core::FunctionParams> modes = {
      {{"top_p", 0.9}}, {{"top_k", 5.0}}, {{"greedy", 1.0}}, {}};
  torch::NoGradGuard no_grad;
  // Logits that only the temperature makes infinite (finite X·Wᵀ in row 2, divided by 1e-6):
  // the request's parameter is named.
  core::TokenBatch large = batch;
  large.hidden = batch.hidden.clone();
  large.hidden[2].fill_(1e35);
  for (core::FunctionParams params : modes) {
    params["temperature"] = 1e-6;
    auto r = core::Forward(*head, large, Generation("sample", params));
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(),
                                  "got inf or nan in row 2 once divided by "
                                  "params[\"temperature\"] = 1e-06"))
        << r.status();
  }
  // Weights that overflow X·Wᵀ in row 4 only: the head is named, with the row.
  core::TokenBatch one_big = batch;
  one_big.hidden = batch.hidden.clone();
  one_big.hidden[4].fill_(3e38);
  for (const core::FunctionParams& params : modes) {
    for (const int64_t chunk : {0, 2}) {
      auto r = core::Forward(*head, one_big, Generation("sample", params, chunk));
      ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      EXPECT_TRUE(absl::StrContains(r.status().message(),
                                    "got inf or nan in row 4: hidden[4] times the head's weights "
                                    "overflows float32"))
          << r.status();
    }
  }
}

TEST(GenerationMemory, TheModelCountsTheRowsOfLogits) {
  auto head = reference::MakeTestHead(kVocab, kHidden, torch::kFloat, false);
  core::StepOptions options = Generation("logits");
  options.output_dtype = torch::kDouble;
  auto plan = core::PlanCall(*head, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->output_row_bytes, kVocab * 8);
  EXPECT_EQ(plan->Memory(10, core::CallMode::kForward).output_bytes, 10 * kVocab * 8);
  auto sample = core::PlanCall(*head, Generation("sample"));
  ASSERT_TRUE(sample.ok()) << sample.status();
  EXPECT_EQ(sample->output_row_bytes, 8 + 4);
}

}  // namespace
}  // namespace remotehead
