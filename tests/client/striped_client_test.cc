// The C++ client striping each step over ClientOptions::streams parallel streams
// (StepHeader.stripe), against an in-process server that takes no message over 4 KiB and sends
// results in 1 KiB chunks (so every stream carries many): for 1, 2 and 4 streams a ForwardBackward
// (with per-token extras), a per-token Forward, a Backward and a Backward by inputs handle give
// what the engine gives on the same head and what one stream gives; a replay under the same
// gradient id adds nothing; a bad row on one stream fails the step with the server's code and
// commits nothing; the option is checked.
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/reference.h"
#include "remotehead/client/client.h"
#include "remotehead/core/engine.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

// Its own namespace: the file is compiled in one unit with the target's other files
// (cmake/RemoteheadUnity.cmake), whose shapes and helpers have the same names.
namespace remotehead::striped_client_test {
namespace {

namespace rc = client;

constexpr int64_t kVocab = 300;
constexpr int64_t kHidden = 32;
constexpr int64_t kRows = 50;
constexpr int64_t kChunkBytes = 4096;

class StripedClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.started());
    for (int streams : {1, 2, 4}) {
      auto c = rc::Client::Create(
          {.target = server_.target(), .chunk_bytes = kChunkBytes, .streams = streams});
      ASSERT_TRUE(c.ok()) << c.status();
      clients_[streams] = *c;
    }
    auto info = clients_[1]->CreateHead("lm", rc::InitSpec{.vocab_size = kVocab,
                                                           .hidden_size = kHidden,
                                                           .bias = true,
                                                           .seed = 5,
                                                           .init_std = 1.0 / std::sqrt(kHidden)});
    ASSERT_TRUE(info.ok()) << info.status();
    entry_ = *server_.registry().Get("lm");
    // 50 rows of 32 floats with their targets: 7 row messages of at most 4 KiB.
    batch_ = reference::MakeTestBatch(Head(), kRows, "cross_entropy", core::Reduction::kMean);
  }

  const core::Head& Head() { return testing::HeadOf(*entry_); }
  torch::Tensor HeadWeightGrad() { return testing::HeadOf(*entry_).grads().weight.clone(); }
  rc::StepInputs Inputs() const { return {.hidden = batch_.hidden, .targets = batch_.targets}; }

  testing::InProcessServer server_{{.response_chunk_bytes = 1024}, kChunkBytes};
  std::map<int, std::shared_ptr<rc::Client>> clients_;
  std::shared_ptr<server::HeadEntry> entry_;
  core::TokenBatch batch_;
};

TEST_F(StripedClientTest, EveryStreamCountGivesTheEnginesAndOneStreamsResults) {
  core::GradientBuffers expected_dw = Head().NewGradientBuffers();
  auto expected = core::FusedForwardBackward(Head(), batch_, {.chunk_rows = 8}, &expected_dw);
  ASSERT_TRUE(expected.ok()) << expected.status();
  const core::StepOptions per_token{
      .function = "token_logprobs", .reduction = core::Reduction::kNone, .chunk_rows = 8};
  auto expected_out = core::Forward(Head(), batch_, per_token);
  ASSERT_TRUE(expected_out.ok()) << expected_out.status();
  const torch::Tensor upstream = torch::randn({kRows}, torch::TensorOptions().dtype(torch::kFloat));
  core::GradientBuffers unused = Head().NewGradientBuffers();
  auto expected_dx = core::Backward(Head(), batch_, per_token, upstream, &unused);
  ASSERT_TRUE(expected_dx.ok()) << expected_dx.status();

  std::optional<rc::ForwardBackwardResult> one;
  int64_t step = 0;
  for (const auto& [streams, c] : clients_) {
    SCOPED_TRACE(absl::StrCat(streams, " streams"));
    ASSERT_TRUE(c->ZeroGradients("lm").ok());
    auto fb = c->ForwardBackward({.head_id = "lm",
                                  .chunk_rows = 8,
                                  .gradient_id = rc::GradientId{"striped", step++, 0},
                                  .token_extras = {"nll"}},
                                 Inputs());
    ASSERT_TRUE(fb.ok()) << fb.status();
    EXPECT_LE(reference::RelativeError(fb->loss, expected->loss), 1e-6);
    EXPECT_LE(reference::RelativeError(fb->grad_hidden, expected->grad_hidden), 1e-5);
    EXPECT_LE(reference::RelativeError(HeadWeightGrad(), expected_dw.weight), 1e-5);
    // Per-token nll over every row: its sum (ignored rows 0) is the summary's.
    EXPECT_LE(reference::RelativeError(fb->token_extras.at("nll").sum().item<double>(),
                                       fb->summary.extras.at("nll")),
              1e-5);
    if (!one.has_value()) one = *fb;
    EXPECT_LE(reference::RelativeError(fb->grad_hidden, one->grad_hidden), 1e-6);
    EXPECT_LE(reference::RelativeError(fb->token_extras.at("nll"), one->token_extras.at("nll")),
              1e-6);

    rc::StepSpec spec{.head_id = "lm",
                      .function = "token_logprobs",
                      .reduction = rc::Reduction::kNone,
                      .chunk_rows = 8};
    auto out = c->Forward(spec, Inputs());
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_LE(reference::RelativeError(out->outputs, expected_out->output), 1e-5);

    spec.accumulate_weight_grad = false;
    auto dx = c->Backward(spec, Inputs(), upstream);
    ASSERT_TRUE(dx.ok()) << dx.status();
    EXPECT_LE(reference::RelativeError(dx->grad_hidden, expected_dx->grad_hidden), 1e-5);

    // A Backward by a Forward's retained inputs: only dL/dy travels, still striped.
    rc::StepSpec retain = spec;
    retain.retain_inputs_seconds = 30;
    auto kept = c->Forward(retain, Inputs());
    ASSERT_TRUE(kept.ok()) << kept.status();
    rc::StepSpec by_handle = spec;
    by_handle.inputs_handle = kept->summary.inputs_handle;
    auto handled = c->Backward(by_handle, {.hidden = torch::zeros_like(batch_.hidden)}, upstream);
    ASSERT_TRUE(handled.ok()) << handled.status();
    EXPECT_LE(reference::RelativeError(handled->grad_hidden, expected_dx->grad_hidden), 1e-5);
  }
}

TEST_F(StripedClientTest, AReplayUnderTheSameGradientIdAddsNothing) {
  const rc::StepSpec spec{.head_id = "lm", .gradient_id = rc::GradientId{"replay", 0, 0}};
  auto first = clients_[4]->ForwardBackward(spec, Inputs());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->summary.replayed);
  const torch::Tensor after_first = HeadWeightGrad();
  auto replay = clients_[2]->ForwardBackward(spec, Inputs());
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->summary.replayed);
  EXPECT_LE(reference::RelativeError(replay->grad_hidden, first->grad_hidden), 1e-6);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), after_first));
}

TEST_F(StripedClientTest, ABadRowOnOneStreamFailsTheStepAndCommitsNothing) {
  const torch::Tensor before = HeadWeightGrad();
  rc::StepInputs bad = Inputs();
  bad.targets = batch_.targets.clone();
  bad.targets[kRows - 1] = kVocab;  // in the last row message, on stream 6 mod 4 = 2
  const rc::StepSpec spec{.head_id = "lm", .gradient_id = rc::GradientId{"bad", 0, 0}};
  auto failed = clients_[4]->ForwardBackward(spec, bad);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(failed.status().message(),
                                "expected a token id in [0, 300) or ignore_index (-100); got 300"))
      << failed.status();
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));
  // The same gradient id, now well formed, is new work.
  auto retried = clients_[4]->ForwardBackward(spec, Inputs());
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_FALSE(retried->summary.replayed);
}

TEST_F(StripedClientTest, StreamsOutOfRangeAreRefused) {
  for (int streams : {0, 65}) {
    auto c = rc::Client::Create({.target = server_.target(), .streams = streams});
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c.status().message(), absl::StrCat("streams: expected 1 to 64; got ", streams));
  }
}

}  // namespace
}  // namespace remotehead::striped_client_test
