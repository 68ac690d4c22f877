// Head construction, deterministic initialisation, gradient buffers and their errors.
#include "remotehead/core/head.h"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "core/reference.h"

namespace remotehead {
namespace {

using core::Head;

TEST(Head, SameSeedGivesIdenticalWeightsAndOtherSeedsDiffer) {
  core::HeadInit init{.vocab_size = 50, .hidden_size = 8, .seed = 7};
  auto a = Head::Initialize(init, {});
  auto b = Head::Initialize(init, {});
  init.seed = 8;
  auto c = Head::Initialize(init, {});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_TRUE(torch::equal((*a)->weight(), (*b)->weight()));
  EXPECT_FALSE(torch::equal((*a)->weight(), (*c)->weight()));
  EXPECT_NEAR((*a)->weight().std().item<double>(), 0.02, 0.004);
  EXPECT_EQ((*a)->vocab_size(), 50);
  EXPECT_EQ((*a)->hidden_size(), 8);
  EXPECT_FALSE((*a)->has_bias());
}

// A head group's shard made from the seed: exactly those rows of the whole head, in any dtype.
TEST(Head, InitializeRowsAreTheRowsOfTheWholeHead) {
  for (const torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    const core::HeadInit init{
        .vocab_size = 29, .hidden_size = 8, .dtype = dtype, .bias = true, .seed = 3};
    auto whole = Head::Initialize(init, {});
    ASSERT_TRUE(whole.ok());
    for (const auto& [offset, rows] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 15}, {15, 14}, {20, 9}, {0, 29}}) {
      auto shard = Head::InitializeRows(init, {}, offset, rows);
      ASSERT_TRUE(shard.ok()) << shard.status();
      EXPECT_TRUE(torch::equal((*shard)->weight(), (*whole)->weight().narrow(0, offset, rows)));
      EXPECT_EQ((*shard)->bias().size(0), rows);
      EXPECT_EQ((*shard)->dtype(), dtype);
    }
  }
  const core::HeadInit init{.vocab_size = 29, .hidden_size = 8};
  for (const auto& [offset, rows] :
       std::vector<std::pair<int64_t, int64_t>>{{-1, 3}, {28, 2}, {0, 0}}) {
    const auto bad = Head::InitializeRows(init, {}, offset, rows);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("rows: expected a range within [0, 29)"),
              std::string::npos)
        << bad.status();
  }
}

TEST(Head, FromTensorsCopiesAndKeepsDtype) {
  torch::Tensor w = torch::randn({10, 4}).to(torch::kBFloat16);
  torch::Tensor b = torch::randn({10}).to(torch::kBFloat16);
  auto head = Head::FromTensors(w, b, {});
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->dtype(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal((*head)->weight(), w));
  EXPECT_NE((*head)->weight().data_ptr(), w.data_ptr()) << "the head must own its weights";
  EXPECT_TRUE((*head)->has_bias());
  // fp32 accumulators by default, even for a bf16 head.
  EXPECT_EQ((*head)->grads().weight.scalar_type(), torch::kFloat);
  EXPECT_EQ((*head)->grads().bias.scalar_type(), torch::kFloat);
}

TEST(Head, GradDtypeMayBeTheHeadsOwnAndZeroGradClears) {
  auto head = Head::FromTensors(torch::randn({6, 3}).to(torch::kBFloat16), {},
                                {.grad_dtype = torch::kBFloat16});
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->grads().weight.scalar_type(), torch::kBFloat16);
  (*head)->grads().weight.fill_(3);
  (*head)->ZeroGrad();
  EXPECT_EQ((*head)->grads().weight.abs().sum().item<double>(), 0.0);
  const core::GradientBuffers scratch = (*head)->NewGradientBuffers();
  EXPECT_EQ(scratch.weight.sizes(), (*head)->weight().sizes());
  EXPECT_FALSE(scratch.bias.defined());
}

// A float64 head is float64 end to end: its accumulators, and so its dW, are float64 (the GEMM
// runs on the float64 logits gradient), and the memory model counts 8 + 8 bytes per element.
// The other dtypes accumulate in float32 (core::AccumulationDtype, the one home of the rule).
TEST(Head, Float64HeadAccumulatesInFloat64AndCountsIt) {
  EXPECT_EQ(core::AccumulationDtype(torch::kDouble), torch::kDouble);
  for (const torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    EXPECT_EQ(core::AccumulationDtype(dtype), torch::kFloat) << core::DtypeName(dtype);
  }
  auto head = reference::MakeTestHead(97, 24, torch::kDouble, /*bias=*/true);
  EXPECT_EQ(head->grads().weight.scalar_type(), torch::kDouble);
  EXPECT_EQ(head->grads().bias.scalar_type(), torch::kDouble);
  EXPECT_EQ(*core::HeadMemoryBytes(97, 24, torch::kDouble, true), 97 * 25 * (8 + 8));
  EXPECT_EQ(*core::HeadMemoryBytes(97, 24, torch::kBFloat16, true), 97 * 25 * (2 + 4));
  EXPECT_EQ(*core::HeadMemoryBytes(97, 24, torch::kDouble, true, torch::kFloat), 97 * 25 * (8 + 4));

  const core::TokenBatch batch =
      reference::MakeTestBatch(*head, 40, "cross_entropy", core::Reduction::kMean);
  const core::StepOptions options{.chunk_rows = 16};
  auto ours = core::FusedForwardBackward(*head, batch, options, &head->grads());
  ASSERT_TRUE(ours.ok()) << ours.status();
  const reference::ReferenceResult ref = reference::NaiveReference(*head, batch, options);
  // A few roundings of float64 per element (an fp32 GEMM left errors of 3e-5 here).
  EXPECT_LE(reference::RelativeError(head->grads().weight, ref.grad_weight), 1e-12);
  EXPECT_LE(reference::RelativeError(head->grads().bias, ref.grad_bias), 1e-12);
  EXPECT_LE(reference::RelativeError(ours->grad_hidden, ref.grad_hidden), 1e-12);
}

TEST(Head, VersionStartsAtZeroAndBumps) {
  auto head = reference::MakeTestHead(5, 2, torch::kFloat, false);
  EXPECT_EQ(head->version(), 0);
  head->BumpVersion();
  EXPECT_EQ(head->version(), 1);
}

struct BadHeadCase {
  std::string label;
  torch::Tensor weight;
  torch::Tensor bias;
  core::HeadOptions options;
  absl::StatusCode code;
  std::string message;
};

TEST(Head, BadInputsAreRejectedWithPreciseMessages) {
  const std::vector<BadHeadCase> cases = {
      {"1-D weight",
       torch::randn({5}),
       {},
       {},
       absl::StatusCode::kInvalidArgument,
       "weight: expected a 2-D tensor [vocab_size, hidden_size] with both sizes >= 1; got [5]"},
      {"int weight",
       torch::ones({3, 2}, torch::kInt),
       {},
       {},
       absl::StatusCode::kInvalidArgument,
       "weight.dtype: expected float32, bfloat16, float16 or float64; got int32"},
      {"bias size",
       torch::randn({3, 2}),
       torch::randn({4}),
       {},
       absl::StatusCode::kInvalidArgument,
       "bias: expected shape [3]; got [4]"},
      {"nan weight",
       torch::full({3, 2}, NAN),
       {},
       {},
       absl::StatusCode::kInvalidArgument,
       "weight: expected finite values; got NaN or Inf"},
      {"grad dtype",
       torch::randn({3, 2}),
       {},
       {.grad_dtype = torch::kHalf},
       absl::StatusCode::kInvalidArgument,
       "grad_dtype: expected float32 or the head's dtype (float32); got float16"},
  };
  for (const BadHeadCase& c : cases) {
    auto head = Head::FromTensors(c.weight, c.bias, c.options);
    ASSERT_FALSE(head.ok()) << c.label;
    EXPECT_EQ(head.status().code(), c.code) << c.label;
    EXPECT_EQ(head.status().message(), c.message) << c.label;
  }
  EXPECT_EQ(core::ParseHeadDtype("int8").status().message(),
            "dtype: expected one of float32, bfloat16, float16, float64; got \"int8\"");
  EXPECT_EQ(*core::ParseHeadDtype("bf16"), torch::kBFloat16);
  auto init = Head::Initialize({.vocab_size = 0, .hidden_size = 4}, {});
  EXPECT_EQ(init.status().message(), "vocab_size, hidden_size: expected >= 1; got 0, 4");
}

TEST(Head, CudaDeviceWithoutCudaIsAPreconditionFailure) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA is available on this machine";
  auto head = Head::FromTensors(torch::randn({3, 2}), {}, {.device = torch::Device("cuda:0")});
  EXPECT_EQ(head.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(head.status().message().find("CUDA is not available"), std::string::npos);
}

}  // namespace
}  // namespace remotehead
