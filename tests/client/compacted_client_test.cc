// The C++ client leaves out the rows that contribute nothing (StepSpec::compact_rows, on by
// default, for a function listed with ignored_rows_contribute_nothing) and puts zeros in their
// place: against an in-process server, a step that compacts and one that sends every row give
// the same bits — loss, dX, per-token outputs, token extras, dW — in a fused step (mean, and
// weighted sum with a normalizer), a per-token Forward and a Backward by the Forward's retained
// inputs (not given the targets: the client remembers what the Forward left out).
// tests/python/test_conformance.py checks that it sends what the Python client sends.
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/reference.h"
#include "remotehead/client/client.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/error_reason.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

// Its own namespace: the file is compiled in one unit with the target's other files
// (cmake/RemoteheadUnity.cmake), whose shapes and helpers have the same names.
namespace remotehead::compacted_client_test {
namespace {

namespace rc = client;

constexpr int64_t kVocab = 300;
constexpr int64_t kHidden = 32;
constexpr int64_t kRows = 50;

class CompactedClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.started());
    auto c = rc::Client::Create({.target = server_.target()});
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *c;
    auto info = client_->CreateHead("lm", rc::InitSpec{.vocab_size = kVocab,
                                                       .hidden_size = kHidden,
                                                       .bias = true,
                                                       .seed = 5,
                                                       .init_std = 1.0 / std::sqrt(kHidden)});
    ASSERT_TRUE(info.ok()) << info.status();
    entry_ = *server_.registry().Get("lm");
    batch_ = reference::MakeTestBatch(testing::HeadOf(*entry_), kRows, "grpo",
                                      core::Reduction::kWeightedSum);
    batch_.targets.index_put_({torch::arange(0, kRows / 2)}, -100);  // half ignored at least
    ignored_ = batch_.targets == -100;
  }

  rc::StepInputs Inputs(bool weights) const {
    return {.hidden = batch_.hidden,
            .targets = batch_.targets,
            .weights = weights ? batch_.weights : torch::Tensor(),
            .aux = batch_.aux};
  }
  torch::Tensor TakeWeightGrad() {
    torch::Tensor dw = testing::HeadOf(*entry_).grads().weight.clone();
    EXPECT_TRUE(client_->ZeroGradients("lm").ok());
    return dw;
  }

  testing::InProcessServer server_{{}};
  std::shared_ptr<rc::Client> client_;
  std::shared_ptr<server::HeadEntry> entry_;
  core::TokenBatch batch_;
  torch::Tensor ignored_;
};

TEST_F(CompactedClientTest, TheFunctionListingSaysWhichFunctionsCompact) {
  auto listed = client_->ListFunctions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  for (const rc::FunctionInfo& f : *listed) {
    EXPECT_EQ(f.ignored_rows_contribute_nothing, f.output_kind == rc::OutputKind::kPerToken)
        << f.name;
  }
}

TEST_F(CompactedClientTest, AFusedStepGivesTheSameBitsCompactedOrNot) {
  for (const bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted_sum" : "mean");
    rc::StepSpec spec{.head_id = "lm",
                      .function = "grpo",
                      .reduction = weighted ? rc::Reduction::kWeightedSum : rc::Reduction::kMean,
                      .chunk_rows = 8,
                      .token_extras = {"clipped", "kl"}};
    if (weighted) spec.normalizer = 41.0;
    std::vector<rc::ForwardBackwardResult> results;
    std::vector<torch::Tensor> dw;
    for (const bool compact : {false, true}) {
      spec.compact_rows = compact;
      spec.gradient_id = rc::GradientId{"fb", weighted, compact};
      auto r = client_->ForwardBackward(spec, Inputs(weighted));
      ASSERT_TRUE(r.ok()) << r.status();
      results.push_back(*std::move(r));
      dw.push_back(TakeWeightGrad());
    }
    EXPECT_EQ(results[0].loss, results[1].loss);
    EXPECT_EQ(results[0].summary.extras, results[1].summary.extras);
    EXPECT_TRUE(torch::equal(results[0].grad_hidden, results[1].grad_hidden));
    EXPECT_TRUE(torch::equal(dw[0], dw[1]));
    for (const auto& [name, values] : results[0].token_extras) {
      EXPECT_TRUE(torch::equal(values, results[1].token_extras.at(name))) << name;
    }
    EXPECT_TRUE(results[1].grad_hidden.index({ignored_}).eq(0).all().item<bool>());
  }
}

TEST_F(CompactedClientTest, AForwardAndABackwardByHandleGiveTheSameBitsCompactedOrNot) {
  const torch::Tensor dy = torch::linspace(-1, 1, kRows);
  std::vector<torch::Tensor> outputs, dx, dw;
  for (const bool compact : {false, true}) {
    rc::StepSpec spec{.head_id = "lm",
                      .function = "token_logprobs",
                      .reduction = rc::Reduction::kNone,
                      .chunk_rows = 8,
                      .retain_inputs_seconds = 60,
                      .compact_rows = compact};
    auto forward = client_->Forward(spec, {.hidden = batch_.hidden, .targets = batch_.targets});
    ASSERT_TRUE(forward.ok()) << forward.status();
    outputs.push_back(forward->outputs);
    spec.retain_inputs_seconds = 0;
    spec.inputs_handle = forward->summary.inputs_handle;
    spec.gradient_id = rc::GradientId{"by-handle", 0, compact};
    // Without the targets: the client remembers what the Forward of the handle left out.
    auto backward = client_->Backward(spec, {.hidden = batch_.hidden}, dy);
    ASSERT_TRUE(backward.ok()) << backward.status();
    dx.push_back(backward->grad_hidden);
    dw.push_back(TakeWeightGrad());
  }
  EXPECT_TRUE(torch::equal(outputs[0], outputs[1]));
  EXPECT_TRUE(outputs[1].index({ignored_}).eq(0).all().item<bool>());
  EXPECT_TRUE(torch::equal(dx[0], dx[1]));
  EXPECT_TRUE(torch::equal(dw[0], dw[1]));
}

// The server names a row by its index among the rows it received; with rows left out that is
// not the caller's. The client rewrites the field (ErrorInfo metadata "field", and the message
// it leads) to the caller's row: the same answer compacted or not, word for word.
TEST_F(CompactedClientTest, AnErrorNamesTheCallersRowCompactedOrNot) {
  torch::Tensor targets = batch_.targets.clone();
  targets[30] = kVocab + 5;
  torch::Tensor targets_ok = batch_.targets.clone();
  targets_ok[40] = 7;  // a row that travels
  core::AuxTensors aux = batch_.aux;
  aux["advantages"] = aux["advantages"].clone();
  aux["advantages"][40] = 2.5;
  aux["old_logprobs"] = aux["old_logprobs"].clone();
  aux["old_logprobs"][40] = std::numeric_limits<float>::infinity();
  struct Case {
    rc::StepInputs inputs;
    std::string message, field;
  };
  const std::vector<Case> cases = {
      {{.hidden = batch_.hidden, .targets = targets, .aux = batch_.aux},
       "targets[30]: expected a token id in [0, 300) or ignore_index (-100); got 305",
       "targets[30]"},
      {{.hidden = batch_.hidden, .targets = targets_ok, .aux = aux},
       "aux[\"old_logprobs\"][40]: expected a finite value; got inf",
       "aux[\"old_logprobs\"][40]"},
  };
  for (const Case& c : cases) {
    for (const bool compact : {false, true}) {
      SCOPED_TRACE(c.field + (compact ? " compacted" : " every row"));
      const rc::StepSpec spec{.head_id = "lm",
                              .function = "grpo",
                              .reduction = rc::Reduction::kMean,
                              .gradient_id = rc::GradientId{"bad-row", compact, 0},
                              .compact_rows = compact};
      auto result = client_->ForwardBackward(spec, c.inputs);
      ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
      EXPECT_EQ(result.status().message(), c.message);
      const std::optional<core::ErrorReason> reason = core::GetReason(result.status());
      ASSERT_TRUE(reason.has_value());
      EXPECT_EQ(reason->reason, "INVALID_FIELD");
      EXPECT_EQ(reason->metadata.at("field"), c.field);
    }
  }
}

}  // namespace
}  // namespace remotehead::compacted_client_test
