// The C++ client against an in-process server on a loopback port: every typed call gives what
// the engine (core/) gives when called directly on the same head, uploads and exports round-trip
// bit-exactly, FetchGradients returns the registry's accumulators, and server errors come back
// with the server's code and message.
//
// The server accepts no message larger than the client's chunk_bytes (4 KiB here), so every
// test also checks that the client splits its requests as promised; the server streams its
// results in 1 KiB chunks, so every result is assembled from many messages (client_fixture.h;
// the calls that write files on the server are in client_files_test.cc).
#include "remotehead/client/client.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client_fixture.h"
#include "core/reference.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/optimizer.h"
#include "remotehead/server/rpc/head_service.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

namespace remotehead {
namespace {

TEST_F(ClientTest, LifecycleCallsDescribeTheRegistryAndKeepTheServersErrors) {
  auto described = client_->DescribeHead("lm");
  ASSERT_TRUE(described.ok()) << described.status();
  EXPECT_EQ(described->head_id, "lm");
  EXPECT_EQ(described->vocab_size, kVocab);
  EXPECT_EQ(described->hidden_size, kHidden);
  EXPECT_EQ(described->dtype, torch::kFloat);
  EXPECT_TRUE(described->has_bias);
  EXPECT_EQ(described->device, "cpu");
  EXPECT_EQ(described->weight_version, 0);

  const auto duplicate =
      client_->CreateHead("lm", rc::InitSpec{.vocab_size = 10, .hidden_size = 4});
  EXPECT_EQ(duplicate.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(duplicate.status().message(),
            "head_id: expected a new id; got \"lm\", which already exists");

  ASSERT_TRUE(
      client_
          ->CreateHead("small",
                       rc::InitSpec{.vocab_size = 10, .hidden_size = 4, .dtype = torch::kBFloat16})
          .ok());
  auto heads = client_->ListHeads();
  ASSERT_TRUE(heads.ok()) << heads.status();
  ASSERT_EQ(heads->size(), 2u);
  EXPECT_EQ((*heads)[0].head_id, "lm");
  EXPECT_EQ((*heads)[1].head_id, "small");
  EXPECT_EQ((*heads)[1].dtype, torch::kBFloat16);
  EXPECT_FALSE((*heads)[1].has_bias);

  ASSERT_TRUE(client_->DropHead("small").ok());
  const absl::Status missing = client_->DropHead("small");
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(
      missing.message(),
      "head_id: expected the id of a head on this server; got \"small\", which it does not have");
  EXPECT_EQ(client_->DescribeHead("small").status().code(), absl::StatusCode::kNotFound);
}

// Every function and reduction the fused path serves, with the per-token inputs each needs
// (weights for weighted_sum; GRPO's advantages and old / ref log-probs as aux tensors).
TEST_F(ClientTest, ForwardBackwardEqualsTheEngineForEveryFunctionAndReduction) {
  struct Case {
    std::string function;
    core::Reduction reduction;
    core::FunctionParams params;
    std::optional<double> normalizer;
  };
  const std::vector<Case> cases = {
      {"cross_entropy", core::Reduction::kMean, {{"label_smoothing", 0.1}, {"z_loss", 1e-3}}},
      {"cross_entropy", core::Reduction::kSum, {}, 123.0},
      {"token_logprobs", core::Reduction::kWeightedSum, {}},
      {"grpo", core::Reduction::kMean, {{"beta", 0.05}, {"epsilon_high", 0.28}}},
      {"entropy", core::Reduction::kMean, {{"temperature", 0.7}}, 80.0},
  };
  int micro_batch = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.function);
    const core::TokenBatch batch = reference::MakeTestBatch(Head(), kRows, c.function, c.reduction);
    const core::StepOptions options{.function = c.function,
                                    .params = c.params,
                                    .reduction = c.reduction,
                                    .normalizer = c.normalizer,
                                    .chunk_rows = 8};
    core::GradientBuffers expected = Head().NewGradientBuffers();
    auto direct = core::FusedForwardBackward(Head(), batch, options, &expected);
    ASSERT_TRUE(direct.ok()) << direct.status();
    // The naive float64 reference, independent of the engine.
    const auto naive = reference::NaiveReference(Head(), batch, options);

    ASSERT_TRUE(client_->ZeroGradients("lm").ok());
    rc::StepSpec spec = SpecFor(options);
    spec.gradient_id = rc::GradientId{.trainer = "client-test", .micro_batch = micro_batch++};
    auto r = client_->ForwardBackward(spec, InputsFor(batch));
    ASSERT_TRUE(r.ok()) << r.status();

    // Engine vs server: the same fp32 arithmetic, rows split differently (client chunks).
    EXPECT_NEAR(r->loss, direct->loss, 1e-6 * std::max(1.0, std::abs(direct->loss)));
    EXPECT_EQ(r->grad_hidden.scalar_type(), torch::kFloat);
    EXPECT_LE(reference::RelativeError(r->grad_hidden, direct->grad_hidden), 1e-6);
    EXPECT_LE(reference::RelativeError(HeadWeightGrad(), expected.weight), 1e-5);
    // Both vs the float64 reference (the engine parity suite's fp32 tolerance).
    EXPECT_NEAR(r->loss, naive.output.item<double>(),
                2e-5 * std::max(1.0, std::abs(naive.output.item<double>())));
    EXPECT_LE(reference::RelativeError(r->grad_hidden, naive.grad_hidden), 2e-5);
    EXPECT_EQ(r->summary.valid_tokens, direct->stats.valid_tokens);
    EXPECT_EQ(r->summary.extras.size(), direct->stats.extras.size());
    for (const auto& [name, value] : direct->stats.extras) {
      EXPECT_NEAR(r->summary.extras.at(name), value, 1e-4 * std::max(1.0, std::abs(value))) << name;
    }
    EXPECT_FALSE(r->summary.replayed);
  }
}

// A bfloat16 head: the client sends hidden in the head's dtype and returns dX in the caller's.
TEST_F(ClientTest, HalfPrecisionHeadTakesHiddenInItsDtypeAndReturnsDxInTheCallers) {
  ASSERT_TRUE(client_
                  ->CreateHead("bf", rc::InitSpec{.vocab_size = kVocab,
                                                  .hidden_size = kHidden,
                                                  .seed = 9,
                                                  .init_std = 0.2,
                                                  .dtype = torch::kBFloat16})
                  .ok());
  const core::Head& bf = testing::HeadOf(**server_.registry().Get("bf"));
  const torch::Tensor hidden = torch::randn({kRows, kHidden});
  core::TokenBatch batch{.hidden = hidden.to(torch::kBFloat16), .targets = batch_.targets};
  auto direct = core::FusedForwardBackward(bf, batch, {.chunk_rows = 8}, nullptr);
  ASSERT_TRUE(direct.ok()) << direct.status();

  auto r = client_->ForwardBackward({.head_id = "bf",
                                     .chunk_rows = 8,
                                     .accumulate_weight_grad = false,
                                     .wire_dtype = torch::kBFloat16},
                                    {.hidden = hidden, .targets = batch_.targets});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->grad_hidden.scalar_type(), torch::kFloat);
  EXPECT_LE(reference::RelativeError(r->loss, direct->loss), 1e-5);
  // bf16 results of differently split GEMMs: one bf16 rounding step of the largest value.
  EXPECT_LE(reference::RelativeError(r->grad_hidden, direct->grad_hidden), 1e-2);
}

TEST_F(ClientTest, TwoPhaseForwardAndBackwardEqualTheEngine) {
  const core::StepOptions per_token{
      .function = "token_logprobs", .reduction = core::Reduction::kNone, .chunk_rows = 8};
  auto expected = core::Forward(Head(), batch_, per_token);
  ASSERT_TRUE(expected.ok()) << expected.status();
  auto forward = client_->Forward(SpecFor(per_token), InputsFor(batch_));
  ASSERT_TRUE(forward.ok()) << forward.status();
  ASSERT_EQ(forward->outputs.sizes(), (std::vector<int64_t>{kRows}));
  EXPECT_LE(reference::RelativeError(forward->outputs, expected->output), 1e-5);
  EXPECT_EQ(reference::MaxAbs(HeadWeightGrad()), 0.0) << "Forward accumulates nothing";

  // Scalar Forward: the loss alone.
  const core::StepOptions mean{.chunk_rows = 8};
  auto expected_loss = core::Forward(Head(), batch_, mean);
  ASSERT_TRUE(expected_loss.ok());
  auto loss = client_->Forward(SpecFor(mean), InputsFor(batch_));
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(loss->outputs.dim(), 0);
  EXPECT_LE(
      reference::RelativeError(loss->outputs.item<double>(), expected_loss->output.item<double>()),
      1e-6);
  EXPECT_LE(reference::RelativeError(loss->summary.loss, expected_loss->output.item<double>()),
            1e-6);

  // Backward with per-token dL/dy.
  const torch::Tensor upstream = torch::randn({kRows});
  core::GradientBuffers grads = Head().NewGradientBuffers();
  auto dx = core::Backward(Head(), batch_, per_token, upstream, &grads);
  ASSERT_TRUE(dx.ok()) << dx.status();
  rc::StepSpec spec = SpecFor(per_token);
  spec.gradient_id = rc::GradientId{.trainer = "client-test", .step = 1};
  auto backward = client_->Backward(spec, InputsFor(batch_), upstream);
  ASSERT_TRUE(backward.ok()) << backward.status();
  // The server leaves the ignored rows out before it chunks (row compaction), so its chunks of 8
  // are not the engine's here: equal to fp32 rounding of another summation order (measured up to
  // 1.01e-6 with torch 2.11), as the outputs above.
  EXPECT_LE(reference::RelativeError(backward->grad_hidden, dx->grad_hidden), 1e-5);
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), grads.weight), 1e-5);

  // Backward of a scalar reduction: dL/d(loss) = 0.5.
  ASSERT_TRUE(client_->ZeroGradients("lm").ok());
  const torch::Tensor half = torch::tensor(0.5);
  core::GradientBuffers scalar_grads = Head().NewGradientBuffers();
  auto scalar_dx = core::Backward(Head(), batch_, mean, half, &scalar_grads);
  ASSERT_TRUE(scalar_dx.ok()) << scalar_dx.status();
  rc::StepSpec mean_spec = SpecFor(mean);
  mean_spec.gradient_id = rc::GradientId{.trainer = "client-test", .step = 2};
  auto scalar = client_->Backward(mean_spec, InputsFor(batch_), half);
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  // Compacted chunks (above): fp32 rounding of another order.
  EXPECT_LE(reference::RelativeError(scalar->grad_hidden, scalar_dx->grad_hidden), 1e-5);
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), scalar_grads.weight), 1e-5);
}

// A Forward that retains its inputs lets the Backward send dL/dy alone: the hidden handed to
// that Backward is zeros here, so only the server's kept rows can give the right dX.
TEST_F(ClientTest, BackwardByInputsHandleSendsOnlyTheUpstreamGradient) {
  const core::StepOptions per_token{
      .function = "token_logprobs", .reduction = core::Reduction::kNone, .chunk_rows = 8};
  rc::StepSpec spec = SpecFor(per_token);
  spec.retain_inputs_seconds = 30;
  auto forward = client_->Forward(spec, InputsFor(batch_));
  ASSERT_TRUE(forward.ok()) << forward.status();
  ASSERT_FALSE(forward->summary.inputs_handle.empty());

  const torch::Tensor upstream = torch::randn({kRows});
  core::GradientBuffers grads = Head().NewGradientBuffers();
  auto dx = core::Backward(Head(), batch_, per_token, upstream, &grads);
  ASSERT_TRUE(dx.ok()) << dx.status();
  rc::StepSpec backward_spec = SpecFor(per_token);
  backward_spec.inputs_handle = forward->summary.inputs_handle;
  backward_spec.gradient_id = rc::GradientId{.trainer = "client-test"};
  const rc::StepInputs shape_only{.hidden = torch::zeros_like(batch_.hidden)};
  auto backward = client_->Backward(backward_spec, shape_only, upstream);
  ASSERT_TRUE(backward.ok()) << backward.status();
  // Compacted chunks (above): fp32 rounding of another order.
  EXPECT_LE(reference::RelativeError(backward->grad_hidden, dx->grad_hidden), 1e-5);
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), grads.weight), 1e-5);
  // A successful Backward releases the handle.
  const auto again = client_->Backward(backward_spec, shape_only, upstream);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound) << again.status();

  // A scalar MEAN by handle sends no rows; the client still needs the targets to count tokens.
  const core::StepOptions mean{.chunk_rows = 8};
  rc::StepSpec mean_spec = SpecFor(mean);
  mean_spec.retain_inputs_seconds = 30;
  auto loss = client_->Forward(mean_spec, InputsFor(batch_));
  ASSERT_TRUE(loss.ok()) << loss.status();
  mean_spec.retain_inputs_seconds = 0;
  mean_spec.inputs_handle = loss->summary.inputs_handle;
  mean_spec.accumulate_weight_grad = false;
  const auto uncounted = client_->Backward(mean_spec, shape_only, torch::tensor(0.5));
  EXPECT_EQ(uncounted.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(uncounted.status().message(),
            "inputs.targets: a Backward by inputs_handle with reduction MEAN and no normalizer "
            "needs the targets (or spec.valid_tokens) to count the valid tokens; got neither");
  auto scalar_dx = core::Backward(Head(), batch_, mean, torch::tensor(0.5), nullptr);
  ASSERT_TRUE(scalar_dx.ok());
  auto scalar = client_->Backward(
      mean_spec, {.hidden = torch::zeros_like(batch_.hidden), .targets = batch_.targets},
      torch::tensor(0.5));
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  // Compacted chunks (above): fp32 rounding of another order.
  EXPECT_LE(reference::RelativeError(scalar->grad_hidden, scalar_dx->grad_hidden), 1e-5);
}

TEST_F(ClientTest, UploadThenExportRoundTripsBitExactly) {
  for (const torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const std::string id = absl::StrCat("up-", c10::toString(dtype));
    const torch::Tensor w = torch::randn({kVocab, kHidden}).to(dtype);
    const torch::Tensor b = torch::randn({kVocab}).to(dtype);
    auto info = client_->UploadHead(id, w, b);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->dtype, dtype);
    EXPECT_TRUE(info->has_bias);
    EXPECT_TRUE(torch::equal(testing::HeadOf(**server_.registry().Get(id)).weight(), w));

    auto exported = client_->ExportWeights(id);
    ASSERT_TRUE(exported.ok()) << exported.status();
    EXPECT_TRUE(torch::equal(exported->weight, w));
    EXPECT_TRUE(torch::equal(exported->bias, b));
    auto as_double = client_->ExportWeights(id, torch::kDouble);
    ASSERT_TRUE(as_double.ok()) << as_double.status();
    EXPECT_TRUE(torch::equal(as_double->weight, w.to(torch::kDouble)));
  }
  // No bias; a non-contiguous source is sent by value.
  const torch::Tensor wt = torch::randn({kHidden, kVocab}).t();
  ASSERT_TRUE(client_->UploadHead("nobias", wt).ok());
  auto exported = client_->ExportWeights("nobias");
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_TRUE(torch::equal(exported->weight, wt));
  EXPECT_FALSE(exported->bias.defined());

  // Pinned to what the caller holds: another version or server process streams nothing.
  auto info = client_->DescribeHead("nobias");
  ASSERT_TRUE(info.ok()) << info.status();
  auto pinned = client_->ExportWeights(
      "nobias", {},
      {.expected_incarnation = info->incarnation, .expected_weight_version = info->weight_version});
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_TRUE(torch::equal(pinned->weight, wt));
  auto moved_on =
      client_->ExportWeights("nobias", {}, {.expected_weight_version = info->weight_version + 1});
  EXPECT_EQ(moved_on.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(moved_on.status().message(),
            absl::StrCat("expected_weight_version: expected the head's current version ",
                         info->weight_version, "; got ", info->weight_version + 1));
  auto restarted = client_->ExportWeights("nobias", {}, {.expected_incarnation = "another"});
  EXPECT_EQ(restarted.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(restarted.status().message(), "the server restarted"))
      << restarted.status();
}

TEST_F(ClientTest, FetchGradientsReturnsTheRegistrysAccumulators) {
  rc::StepSpec spec{.head_id = "lm", .gradient_id = rc::GradientId{.trainer = "t"}};
  ASSERT_TRUE(client_->ForwardBackward(spec, InputsFor(batch_)).ok());
  spec.gradient_id->micro_batch = 1;
  ASSERT_TRUE(client_->ForwardBackward(spec, InputsFor(batch_)).ok());
  torch::Tensor dw, db;
  {
    dw = testing::HeadOf(*entry_).grads().weight.clone();
    db = testing::HeadOf(*entry_).grads().bias.clone();
  }
  auto grads = client_->FetchGradients("lm");
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(grads->weight_grad.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(grads->weight_grad, dw));
  EXPECT_TRUE(torch::equal(grads->bias_grad, db));
  EXPECT_EQ(grads->info.accumulated_micro_batches, 2);
  auto bf16 = client_->FetchGradients("lm", torch::kBFloat16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_TRUE(torch::equal(bf16->weight_grad, dw.to(torch::kBFloat16)));

  auto zeroed = client_->ZeroGradients("lm");
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  EXPECT_EQ(zeroed->accumulated_micro_batches, 0);
  auto after = client_->FetchGradients("lm");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(reference::MaxAbs(after->weight_grad), 0.0);
  EXPECT_EQ(reference::MaxAbs(after->bias_grad), 0.0);
}

// The memory mode (grad_dtype = the head's bf16) through every way of making a head: the head
// reports it, its dW comes back in bf16 and equals the server's accumulator, and a dtype that is
// neither float32 nor the head's is refused naming the field.
TEST_F(ClientTest, HeadsMadeInTheMemoryModeAccumulateInTheirOwnDtype) {
  auto created = client_->CreateHead(
      "memory-init", rc::InitSpec{.vocab_size = 64, .hidden_size = 16, .dtype = torch::kBFloat16,
                                  .grad_dtype = torch::kBFloat16});
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->grad_dtype, torch::kBFloat16);
  const torch::Tensor w = torch::randn({64, 16}).to(torch::kBFloat16);
  auto uploaded = client_->UploadHead("memory-upload", w, {}, {.grad_dtype = torch::kBFloat16});
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(uploaded->grad_dtype, torch::kBFloat16);
  auto fp32 = client_->UploadHead("memory-default", w);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_EQ(fp32->grad_dtype, torch::kFloat);

  const rc::StepSpec spec{.head_id = "memory-upload", .gradient_id = rc::GradientId{.trainer = "m"}};
  const torch::Tensor x = torch::randn({8, 16}).to(torch::kBFloat16);
  const torch::Tensor t = torch::randint(0, 64, {8}, torch::kLong);
  ASSERT_TRUE(client_->ForwardBackward(spec, {.hidden = x, .targets = t}).ok());
  auto grads = client_->FetchGradients("memory-upload");
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(grads->weight_grad.scalar_type(), torch::kBFloat16);
  EXPECT_GT(reference::MaxAbs(grads->weight_grad), 0.0);

  auto refused = client_->UploadHead("memory-fp16", w, {}, {.grad_dtype = torch::kHalf});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "header.grad_dtype: expected float32 or the head's dtype (bfloat16); got float16");
  for (const char* id : {"memory-init", "memory-upload", "memory-default"}) {
    EXPECT_TRUE(client_->DropHead(id).ok());
  }
}

TEST_F(ClientTest, OptimizerStepsEqualTheEnginesOptimizers) {
  const rc::StepSpec spec{.head_id = "lm", .gradient_id = rc::GradientId{.trainer = "t"}};
  ASSERT_TRUE(client_->ForwardBackward(spec, InputsFor(batch_)).ok());
  // The same step on a local copy of the head, by core/ directly.
  std::unique_ptr<core::Head> local;
  {
    local = *core::Head::FromTensors(Head().weight(), Head().bias(), {});
    local->grads().weight.copy_(Head().grads().weight);
    local->grads().bias.copy_(Head().grads().bias);
  }
  core::OptimizerState state;
  ASSERT_TRUE(core::AdamWStep(*local, {.lr = 0.01, .weight_decay = 0.1}, 0.5, &state).ok());
  auto info = client_->OptimizerStep(
      "lm", {.optimizer = rc::AdamW{.lr = 0.01, .weight_decay = 0.1}, .grad_scale = 0.5});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->weight_version, 1);
  EXPECT_EQ(info->accumulated_micro_batches, 1) << "zero_gradients was not asked for";
  {
    EXPECT_TRUE(torch::equal(Head().weight(), local->weight()));
    EXPECT_TRUE(torch::equal(Head().bias(), local->bias()));
  }

  // SGD on another head: w ← w − lr·dW, then the accumulators zeroed.
  ASSERT_TRUE(
      client_->CreateHead("sgd", rc::InitSpec{.vocab_size = kVocab, .hidden_size = kHidden}).ok());
  auto sgd_entry = *server_.registry().Get("sgd");
  const torch::Tensor w0 = testing::HeadOf(*sgd_entry).weight().clone();
  ASSERT_TRUE(
      client_
          ->ForwardBackward({.head_id = "sgd", .gradient_id = rc::GradientId{.trainer = "t"}},
                            InputsFor(batch_))
          .ok());
  const torch::Tensor dw = testing::HeadOf(*sgd_entry).grads().weight.clone();
  auto sgd =
      client_->OptimizerStep("sgd", {.optimizer = rc::Sgd{.lr = 0.5}, .zero_gradients = true});
  ASSERT_TRUE(sgd.ok()) << sgd.status();
  EXPECT_EQ(sgd->weight_version, 1);
  EXPECT_EQ(sgd->accumulated_micro_batches, 0);
  EXPECT_LE(reference::RelativeError(testing::HeadOf(*sgd_entry).weight(), w0 - 0.5 * dw), 1e-6);
  EXPECT_EQ(reference::MaxAbs(testing::HeadOf(*sgd_entry).grads().weight), 0.0);

  // Work pinned to the old version is refused, with the server's code and message.
  const auto stale = client_->ForwardBackward({.head_id = "sgd",
                                               .gradient_id = rc::GradientId{.trainer = "t"},
                                               .expected_weight_version = 0},
                                              InputsFor(batch_));
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stale.status().message(),
            "header.expected_weight_version: expected the head's current version 1; got 0");
  const auto bad_lr = client_->OptimizerStep("sgd", {.optimizer = rc::Sgd{.lr = -1}});
  EXPECT_EQ(bad_lr.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad_lr.status().message(), "sgd.lr: expected a finite value in [0, inf); got -1");
}

TEST_F(ClientTest, StepErrorsComeBackWithTheServersCodeAndMessageAndChangeNothing) {
  const torch::Tensor before = HeadWeightGrad();
  const rc::StepSpec spec{.head_id = "lm", .gradient_id = rc::GradientId{.trainer = "t"}};

  rc::StepSpec unknown = spec;
  unknown.head_id = "nope";
  const auto not_found = client_->ForwardBackward(unknown, InputsFor(batch_));
  EXPECT_EQ(not_found.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(
      not_found.status().message(),
      "head_id: expected the id of a head on this server; got \"nope\", which it does not have");

  rc::StepInputs bad_label = InputsFor(batch_);
  bad_label.targets = batch_.targets.clone();
  bad_label.targets[0] = kVocab;
  const auto out_of_range = client_->ForwardBackward(spec, bad_label);
  EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out_of_range.status().message(),
            "targets[0]: expected a token id in [0, 300) or ignore_index (-100); got 300");

  rc::StepSpec no_id = spec;
  no_id.gradient_id.reset();
  const auto anonymous = client_->ForwardBackward(no_id, InputsFor(batch_));
  EXPECT_EQ(anonymous.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(anonymous.status().message(),
            "header.gradient_id: expected a trainer / step / micro_batch identity when "
            "accumulate_weight_grad is set; got none");
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));

  // Caught by the client before anything is sent.
  const int64_t attempts = client_->stats().attempts;
  const auto flat_hidden = client_->ForwardBackward(
      spec, {.hidden = batch_.hidden.flatten(), .targets = batch_.targets});
  EXPECT_EQ(flat_hidden.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(flat_hidden.status().message(),
            "inputs.hidden: expected a floating [N, D] tensor; got Float [1600]");
  const auto short_targets = client_->ForwardBackward(
      spec, {.hidden = batch_.hidden, .targets = batch_.targets.narrow(0, 0, kRows - 1)});
  EXPECT_EQ(short_targets.status().message(), "inputs.targets: expected shape [50]; got [49]");
  EXPECT_EQ(client_->stats().attempts, attempts);
}

// The server here refuses any message over 4 KiB: requests of many rows succeed only because
// the client splits them, and a client told to send larger messages is refused.
TEST_F(ClientTest, ChunkBytesBoundsEveryRequestMessage) {
  const core::TokenBatch big = reference::MakeTestBatch(Head(), 700, "cross_entropy",
                                                        core::Reduction::kMean);  // 87.5 KiB of X
  auto direct = core::FusedForwardBackward(Head(), big, {}, nullptr);
  ASSERT_TRUE(direct.ok());
  auto r =
      client_->ForwardBackward({.head_id = "lm", .accumulate_weight_grad = false}, InputsFor(big));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(reference::RelativeError(r->grad_hidden, direct->grad_hidden), 1e-6);

  auto greedy = *rc::Client::Create({.target = target_, .chunk_bytes = 64 << 10});
  const auto refused =
      greedy->ForwardBackward({.head_id = "lm", .accumulate_weight_grad = false}, InputsFor(big));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();

  auto tiny = *rc::Client::Create({.target = target_, .chunk_bytes = 1024});
  const auto no_room = tiny->UploadHead("wide", torch::zeros({4, 512}));
  EXPECT_EQ(no_room.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(no_room.status().message(),
            "chunk_bytes: expected room for at least one row (2048 bytes + 128 bytes of framing); "
            "got 1024");
}

TEST(ClientOptionsTest, InvalidOptionsAreRefusedNamingTheField) {
  const auto token = rc::Client::Create({.bearer_token = "secret"});
  EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(token.status().message(),
            "bearer_token: expected a TLS channel (options.tls) to send a token over; got an "
            "insecure channel");
  const auto half_mtls =
      rc::Client::Create({.tls = rc::TlsOptions{.client_cert_pem = "-----BEGIN CERTIFICATE-----"}});
  EXPECT_EQ(half_mtls.status().message(),
            "tls.client_cert_pem, tls.client_key_pem: expected both (mutual TLS) or neither; got "
            "only one");
  const auto attempts = rc::Client::Create({.retry = {.max_attempts = 0}});
  EXPECT_EQ(attempts.status().message(), "retry.max_attempts: expected >= 1; got 0");
  const auto chunk = rc::Client::Create({.chunk_bytes = 10});
  EXPECT_EQ(chunk.status().message(), "chunk_bytes: expected >= 1024; got 10");
  EXPECT_TRUE(rc::Client::Create({.tls = rc::TlsOptions{}, .bearer_token = "secret"}).ok());
}

}  // namespace
}  // namespace remotehead
