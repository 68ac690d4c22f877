// RemoteHead inside LibTorch autograd: a small model whose head lives on an in-process server
// gets the loss, hidden.grad, the body's gradients and the server's dW that the same model with
// a local head gets (torch's cross_entropy / log_softmax on the full logits); and the example
// trainer, run against the real remotehead-server binary, learns.
#include <torch/nn.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/reference.h"
#include "remotehead/client/remote_head.h"
#include "remotehead/server/rpc/head_service.h"
#include "support/child_process.h"
#include "support/in_process_server.h"

namespace remotehead {
namespace {

namespace rc = client;
namespace F = torch::nn::functional;

constexpr int64_t kVocab = 97;
constexpr int64_t kHidden = 12;
constexpr int64_t kInput = 6;
// dW / db are float32 accumulators on the server: one float32 rounding of the largest value.
constexpr double kDwTolerance = 1e-6;

// What the local model computes, for comparison.
struct Local {
  torch::Tensor loss, hidden_grad, body_grad, weight_grad, bias_grad;
};

class RemoteHeadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.started());
    client_ = *rc::Client::Create({.target = server_.target(), .chunk_bytes = 2048});
    torch::manual_seed(11);
  }

  // Uploads W [V, D] and b [V] in `dtype` as head `id`; builds a body Linear(kInput → D), inputs
  // [3, 7, kInput] and labels [3, 7] with some ignored positions.
  void MakeModel(const std::string& id, torch::ScalarType dtype) {
    weight_ = (torch::randn({kVocab, kHidden}) * 0.4).to(dtype);
    bias_ = (torch::randn({kVocab}) * 0.1).to(dtype);
    ASSERT_TRUE(client_->UploadHead(id, weight_, bias_).ok());
    body_ = torch::nn::Linear(kInput, kHidden);
    body_->to(dtype);
    x_ = torch::randn({3, 7, kInput}, dtype);
    labels_ = torch::randint(kVocab, {3, 7}, torch::kLong);
    labels_.index_put_({torch::rand({3, 7}) < 0.2}, -100);
  }

  rc::RemoteHead Attach(rc::StepSpec spec) {
    auto head = rc::RemoteHead::Attach(client_, std::move(spec));
    EXPECT_TRUE(head.ok()) << head.status();
    return *std::move(head);
  }

  // The body's forward with hidden kept as a node whose .grad is retained.
  torch::Tensor Hidden() {
    body_->zero_grad();
    torch::Tensor hidden = body_->forward(x_);
    hidden.retain_grad();
    return hidden;
  }

  // The same model with a local head: full logits, torch's own cross_entropy; `objective` maps
  // (logits [N, V], labels [N]) to the scalar that is differentiated.
  Local LocalModel(
      const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& objective) {
    torch::nn::Linear body(kInput, kHidden);
    body->to(x_.scalar_type());
    torch::NoGradGuard copy;
    body->weight.copy_(body_->weight);
    body->bias.copy_(body_->bias);
    torch::Tensor w = weight_.clone().requires_grad_(), b = bias_.clone().requires_grad_();
    Local local;
    {
      torch::AutoGradMode enable(true);
      torch::Tensor hidden = body->forward(x_);
      hidden.retain_grad();
      const torch::Tensor logits = F::linear(hidden, w, b).reshape({-1, kVocab});
      local.loss = objective(logits, labels_.reshape({-1}));
      local.loss.backward();
      local.hidden_grad = hidden.grad();
    }
    local.body_grad = body->weight.grad();
    local.weight_grad = w.grad();
    local.bias_grad = b.grad();
    return local;
  }

  static torch::Tensor MeanCrossEntropy(const torch::Tensor& logits, const torch::Tensor& labels) {
    return F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().ignore_index(-100));
  }

  rc::HeadGradients ServerGradients(const std::string& id) {
    auto grads = client_->FetchGradients(id, torch::kDouble);
    EXPECT_TRUE(grads.ok()) << grads.status();
    return *std::move(grads);
  }

  testing::InProcessServer server_{{.response_chunk_bytes = 1024}};
  std::shared_ptr<rc::Client> client_;
  torch::Tensor weight_, bias_, x_, labels_;
  torch::nn::Linear body_{nullptr};
};

// float64 everywhere: the remote head must agree with the local one to rounding (1e-10 of the
// largest value); float32: to the engine parity suite's fp32 tolerance (2e-5). The server's dW
// and db accumulate in float32 whatever the head's dtype (core's default gradient dtype), so
// they are compared at kDwTolerance at best.
TEST_F(RemoteHeadTest, FusedLossAndGradientsEqualALocalHead) {
  for (const auto& [dtype, tolerance] : std::vector<std::pair<torch::ScalarType, double>>{
           {torch::kDouble, 1e-10}, {torch::kFloat, 2e-5}}) {
    SCOPED_TRACE(c10::toString(dtype));
    const std::string id = absl::StrCat("lm-", c10::toString(dtype));
    MakeModel(id, dtype);
    rc::RemoteHead head = Attach({.head_id = id});
    torch::Tensor hidden = Hidden();
    torch::Tensor loss = head.loss(hidden, labels_);
    EXPECT_EQ(loss.dim(), 0);
    EXPECT_EQ(loss.scalar_type(), dtype);
    loss.backward();
    const Local local = LocalModel(MeanCrossEntropy);

    EXPECT_NEAR(loss.item<double>(), local.loss.item<double>(),
                tolerance * std::abs(local.loss.item<double>()));
    EXPECT_EQ(hidden.grad().scalar_type(), dtype);
    EXPECT_LE(reference::RelativeError(hidden.grad(), local.hidden_grad), tolerance);
    EXPECT_LE(reference::RelativeError(body_->weight.grad(), local.body_grad), tolerance);
    const rc::HeadGradients grads = ServerGradients(id);
    const double dw_tolerance = std::max(tolerance, kDwTolerance);
    EXPECT_LE(reference::RelativeError(grads.weight_grad, local.weight_grad), dw_tolerance);
    EXPECT_LE(reference::RelativeError(grads.bias_grad, local.bias_grad), dw_tolerance);
    EXPECT_EQ(head.last_summary().valid_tokens, (labels_ != -100).sum().item<int64_t>());
  }
}

// Two micro-batches with the whole batch's token count as normalizer = one local mean loss; each
// call gets its own micro-batch number, so the server adds both.
TEST_F(RemoteHeadTest, MicroBatchesWithAGlobalNormalizerAccumulateExactly) {
  MakeModel("lm", torch::kDouble);
  rc::RemoteHead head = Attach({.head_id = "lm", .gradient_id = rc::GradientId{.trainer = "a"}});
  torch::Tensor hidden = Hidden();
  const double tokens = (labels_ != -100).sum().item<double>();
  double total = 0;
  for (const int64_t part : {0, 1}) {
    const torch::Tensor rows = part == 0 ? torch::arange(0, 2) : torch::arange(2, 3);
    torch::Tensor loss = head.loss(hidden.index_select(0, rows), labels_.index_select(0, rows),
                                   {.normalizer = tokens});
    loss.backward({}, /*retain_graph=*/true);  // the body's graph is shared by both parts
    total += loss.item<double>();
  }
  const Local local = LocalModel(MeanCrossEntropy);
  EXPECT_LE(reference::RelativeError(total, local.loss.item<double>()), 1e-10);
  EXPECT_LE(reference::RelativeError(hidden.grad(), local.hidden_grad), 1e-10);
  const rc::HeadGradients grads = ServerGradients("lm");
  EXPECT_EQ(grads.info.accumulated_micro_batches, 2);
  EXPECT_LE(reference::RelativeError(grads.weight_grad, local.weight_grad), kDwTolerance);

  // The optimizer step moves the head to the next step: micro-batch numbers start again.
  ASSERT_TRUE(head.OptimizerStep({.optimizer = rc::Sgd{.lr = 0.1}, .zero_gradients = true}).ok());
  EXPECT_EQ(head.step(), 1);
  head.loss(Hidden(), labels_).backward();
  EXPECT_EQ(ServerGradients("lm").info.accumulated_micro_batches, 1);
}

// The server's dW is computed for upstream_scale: a loss scaled by that factor is exact, any
// other factor is refused when dW is accumulated, and free when it is not (frozen head).
TEST_F(RemoteHeadTest, UpstreamScaleIsDeclaredUpFront) {
  MakeModel("lm", torch::kDouble);
  const Local local = LocalModel(MeanCrossEntropy);

  rc::RemoteHead scaled = Attach({.head_id = "lm", .upstream_scale = 4.0});
  torch::Tensor hidden = Hidden();
  (scaled.loss(hidden, labels_) * 4.0).backward();
  EXPECT_LE(reference::RelativeError(hidden.grad(), 4.0 * local.hidden_grad), 1e-10);
  EXPECT_LE(reference::RelativeError(ServerGradients("lm").weight_grad, 4.0 * local.weight_grad),
            kDwTolerance);

  ASSERT_TRUE(client_->ZeroGradients("lm").ok());
  rc::RemoteHead unit = Attach({.head_id = "lm"});
  torch::Tensor doubled = unit.loss(Hidden(), labels_) * 2.0;
  try {
    doubled.backward();
    ADD_FAILURE() << "a backward with dL/dloss 2 on a head accumulating dW for 1 must fail";
  } catch (const rc::StatusError& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(e.status().message().find("backward got dL/dloss = 2, but the server accumulated "
                                        "dW for upstream_scale = 1"),
              std::string::npos)
        << e.status();
  }

  ASSERT_TRUE(client_->ZeroGradients("lm").ok());
  rc::RemoteHead frozen = Attach({.head_id = "lm", .accumulate_weight_grad = false});
  hidden = Hidden();
  (frozen.loss(hidden, labels_) * 3.0).backward();
  EXPECT_LE(reference::RelativeError(hidden.grad(), 3.0 * local.hidden_grad), 1e-10);
  EXPECT_EQ(reference::MaxAbs(ServerGradients("lm").weight_grad), 0.0);
}

// Two-phase: per-token log-probs come back as a tensor the trainer combines itself (here an
// advantage-weighted objective); their backward sends dL/dy and gets dX, the server adds dW.
TEST_F(RemoteHeadTest, TokenOutputsBackwardThroughTheTrainersOwnObjective) {
  MakeModel("lm", torch::kDouble);
  const torch::Tensor advantages = torch::randn({3, 7}, torch::kDouble);
  const torch::Tensor valid = (labels_ != -100).to(torch::kDouble);
  rc::RemoteHead head = Attach({.head_id = "lm"});
  torch::Tensor hidden = Hidden();
  const torch::Tensor logp = head.token_outputs(hidden, labels_);
  ASSERT_EQ(logp.sizes(), labels_.sizes());
  const torch::Tensor objective = -(logp * advantages * valid).sum() / valid.sum();
  objective.backward();

  const Local local = LocalModel([&](const torch::Tensor& logits, const torch::Tensor& labels) {
    const torch::Tensor token_logp =
        F::log_softmax(logits, 1).gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1);
    return -(token_logp * advantages.reshape({-1}) * valid.reshape({-1})).sum() / valid.sum();
  });
  EXPECT_LE(reference::RelativeError(objective.item<double>(), local.loss.item<double>()), 1e-10);
  const torch::Tensor expected_logp =
      F::log_softmax(F::linear(body_->forward(x_), weight_, bias_), 2)
          .gather(2, labels_.clamp_min(0).unsqueeze(2))
          .squeeze(2) *
      valid;
  EXPECT_LE(reference::RelativeError(logp, expected_logp), 1e-10);
  EXPECT_LE(reference::RelativeError(hidden.grad(), local.hidden_grad), 1e-10);
  const rc::HeadGradients grads = ServerGradients("lm");
  EXPECT_LE(reference::RelativeError(grads.weight_grad, local.weight_grad), kDwTolerance);
  EXPECT_EQ(grads.info.accumulated_micro_batches, 1);
}

// With retained inputs the two-phase backward sends dL/dy alone (the server then forgets the
// handle); and a backward after an optimizer step is refused rather than mixing two versions.
TEST_F(RemoteHeadTest, TokenOutputsWithRetainedInputsAndTheForwardsWeightVersion) {
  MakeModel("lm", torch::kDouble);
  rc::RemoteHead head = Attach({.head_id = "lm", .retain_inputs_seconds = 60});
  torch::Tensor hidden = Hidden();
  const torch::Tensor valid = (labels_ != -100).to(torch::kDouble);
  const torch::Tensor logp = head.token_outputs(hidden, labels_);
  const std::string handle = head.last_summary().inputs_handle;
  ASSERT_FALSE(handle.empty());
  (-(logp * valid).sum() / valid.sum()).backward();
  const Local local = LocalModel(MeanCrossEntropy);  // = −mean log p_t over valid tokens
  EXPECT_LE(reference::RelativeError(hidden.grad(), local.hidden_grad), 1e-10);
  EXPECT_LE(reference::RelativeError(ServerGradients("lm").weight_grad, local.weight_grad),
            kDwTolerance);
  // The backward used the handle: the server released it.
  const auto reused = client_->Backward({.head_id = "lm",
                                         .reduction = rc::Reduction::kNone,
                                         .accumulate_weight_grad = false,
                                         .inputs_handle = handle},
                                        {.hidden = torch::zeros({21, kHidden}, torch::kDouble)},
                                        torch::zeros({21}));
  EXPECT_EQ(reused.status().code(), absl::StatusCode::kNotFound) << reused.status();

  for (const double retain : {60.0, 0.0}) {
    SCOPED_TRACE(retain);
    rc::RemoteHead pinned = Attach({.head_id = "lm", .retain_inputs_seconds = retain});
    const torch::Tensor outputs = pinned.token_outputs(Hidden(), labels_);
    ASSERT_TRUE(client_->OptimizerStep("lm", {.optimizer = rc::Sgd{.lr = 0.1}}).ok());
    try {
      outputs.sum().backward();
      ADD_FAILURE() << "a backward against moved weights must fail";
    } catch (const rc::StatusError& e) {
      EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
    }
  }
}

TEST_F(RemoteHeadTest, WithoutGradientsLossIsAForwardThatAccumulatesNothing) {
  MakeModel("lm", torch::kDouble);
  rc::RemoteHead head = Attach({.head_id = "lm"});
  torch::Tensor loss;
  {
    torch::NoGradGuard no_grad;
    loss = head.loss(body_->forward(x_), labels_);
  }
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_LE(reference::RelativeError(loss.item<double>(),
                                     LocalModel(MeanCrossEntropy).loss.item<double>()),
            1e-10);
  const rc::HeadGradients grads = ServerGradients("lm");
  EXPECT_EQ(grads.info.accumulated_micro_batches, 0);
  EXPECT_EQ(reference::MaxAbs(grads.weight_grad), 0.0);
}

TEST_F(RemoteHeadTest, ErrorsAreThrownAsStatusErrors) {
  MakeModel("lm", torch::kDouble);
  EXPECT_EQ(rc::RemoteHead::Attach(client_, {.head_id = "nope"}).status().code(),
            absl::StatusCode::kNotFound);
  rc::RemoteHead head = Attach({.head_id = "lm"});
  try {
    head.loss(torch::randn({4, kHidden + 1}, torch::kDouble).requires_grad_(),
              torch::zeros({4}, torch::kLong));
    ADD_FAILURE() << "expected a StatusError";
  } catch (const rc::StatusError& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(e.status().message(),
              "hidden: expected shape [..., 12] (the head's hidden size); got [4, 13]");
  }
  try {
    head.loss(Hidden(), torch::full({3, 7}, kVocab, torch::kLong));
    ADD_FAILURE() << "expected a StatusError";
  } catch (const rc::StatusError& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(e.status().message(),
              "targets[0]: expected a token id in [0, 97) or ignore_index (-100); got 97");
  }
}

// A tied model (Gemma-like: the input embedding is the head, scaled by sqrt(D), with a padding
// row): RemoteHead::embed reads the rows from the server and sends their gradient back into the
// same dW as the head's loss. The loss, the body's gradient and the server's dW (both uses summed)
// equal the local model's, where one parameter serves both; the micro-batch counts once; a
// replayed embedding gradient adds nothing; bad input and a stale version change nothing.
TEST_F(RemoteHeadTest, TiedEmbeddingAndHeadAreOneServedMatrix) {
  constexpr int64_t kPadding = 5;
  const double scale = std::sqrt(static_cast<double>(kHidden));
  const torch::Tensor weight = torch::randn({kVocab, kHidden}, torch::kDouble) * 0.4;
  ASSERT_TRUE(client_->UploadHead("tied", weight).ok());
  torch::Tensor ids = torch::randint(kVocab, {3, 7}, torch::kLong);
  ids.index_put_({0, 0}, ids.index({1, 1}).item<int64_t>());  // a repeated id
  ids.index_put_({2, 3}, kPadding);
  labels_ = torch::randint(kVocab, {3, 7}, torch::kLong);
  torch::nn::Linear body(kHidden, kHidden);
  body->to(torch::kDouble);

  rc::RemoteHead head = Attach({.head_id = "tied", .gradient_id = rc::GradientId{.trainer = "t"}});
  const torch::Tensor embedded = head.embed(ids, {.padding_idx = kPadding, .scale = scale});
  EXPECT_EQ(embedded.sizes(), (std::vector<int64_t>{3, 7, kHidden}));
  const torch::Tensor loss = head.loss(body->forward(embedded), labels_);
  loss.backward();

  torch::nn::Linear local_body(kHidden, kHidden);
  local_body->to(torch::kDouble);
  {
    torch::NoGradGuard copy;
    local_body->weight.copy_(body->weight);
    local_body->bias.copy_(body->bias);
  }
  const torch::Tensor w = weight.clone().requires_grad_();
  const torch::Tensor local_embedded =
      F::embedding(ids, w, F::EmbeddingFuncOptions().padding_idx(kPadding)) * scale;
  const torch::Tensor local_loss = MeanCrossEntropy(
      F::linear(local_body->forward(local_embedded), w).reshape({-1, kVocab}),
      labels_.reshape({-1}));
  local_loss.backward();

  EXPECT_LE(reference::RelativeError(loss.item<double>(), local_loss.item<double>()), 1e-10);
  EXPECT_LE(reference::RelativeError(body->weight.grad(), local_body->weight.grad()), 1e-10);
  const rc::HeadGradients grads = ServerGradients("tied");
  EXPECT_LE(reference::RelativeError(grads.weight_grad, w.grad()), kDwTolerance);
  EXPECT_EQ(grads.info.accumulated_micro_batches, 1);  // the head's and the embedding's: one

  // The embedding's gradient again under its id (micro-batch 0 of step 0): nothing is added.
  const torch::Tensor some = torch::tensor({1, 2}, torch::kLong);
  const torch::Tensor ones = torch::ones({2, kHidden}, torch::kDouble);
  auto replay = client_->EmbeddingGradient(
      "tied", some, ones, {.trainer = "t", .step = 0, .micro_batch = 0});
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed);

  // Bad input: precise errors, nothing changed.
  auto outside = client_->EmbeddingLookup("tied", torch::tensor({int64_t{3}, kVocab}, torch::kLong));
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outside.status().message(),
            "ids: expected token ids in [0, 97) (the head's vocab_size); got 97 at position 1 (1 "
            "out of range in all)");
  auto unread = client_->EmbeddingGradient("tied", some, torch::ones({3, kHidden}),
                                           {.trainer = "t", .micro_batch = 1});
  EXPECT_EQ(unread.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unread.status().message(),
            "grad: expected a floating [2, D] tensor (one row per id); got [3, 12]");
  auto wider = client_->EmbeddingGradient("tied", some, torch::ones({2, kHidden + 1}),
                                          {.trainer = "t", .micro_batch = 1});
  EXPECT_EQ(wider.status().code(), absl::StatusCode::kInvalidArgument) << wider.status();
  EXPECT_NE(wider.status().message().find("grad_rows"), std::string::npos) << wider.status();
  ASSERT_TRUE(head.OptimizerStep({.optimizer = rc::Sgd{.lr = 0.1}}).ok());
  auto stale = client_->EmbeddingGradient("tied", some, ones, {.trainer = "t", .micro_batch = 1},
                                          {.expected_weight_version = 0});
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_NE(stale.status().message().find("header.expected_weight_version"), std::string::npos)
      << stale.status();
  // A gradient for rows another server process handed out (its dW is gone): refused by name.
  auto restarted = client_->EmbeddingGradient("tied", some, ones,
                                              {.trainer = "t", .micro_batch = 1},
                                              {.expected_incarnation = "another-process"});
  EXPECT_EQ(restarted.status().code(), absl::StatusCode::kFailedPrecondition)
      << restarted.status();
  EXPECT_NE(restarted.status().message().find("header.expected_incarnation"), std::string::npos)
      << restarted.status();
  // A gradient for no ids: refused by the server (it would add nothing yet count a micro-batch).
  auto empty = client_->EmbeddingGradient("tied", torch::empty({0}, torch::kLong),
                                          torch::empty({0, kHidden}, torch::kDouble),
                                          {.trainer = "t", .micro_batch = 1});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument) << empty.status();
  EXPECT_EQ(empty.status().message(),
            "header.ids: expected at least 1 token id (a gradient for no rows adds nothing and "
            "would count a micro-batch); got 0");
  const rc::HeadGradients after = ServerGradients("tied");
  EXPECT_TRUE(torch::equal(after.weight_grad, grads.weight_grad));
  EXPECT_EQ(after.info.accumulated_micro_batches, 1);
  // The lookup's pin, both fields current: accepted, added once.
  const std::string incarnation = client_->DescribeHead("tied")->incarnation;
  auto current = client_->EmbeddingGradient("tied", some, ones, {.trainer = "t", .micro_batch = 2},
                                            {.expected_incarnation = incarnation,
                                             .expected_weight_version = 1});
  ASSERT_TRUE(current.ok()) << current.status();
  EXPECT_FALSE(current->replayed);
  EXPECT_EQ(current->info.accumulated_micro_batches, 2);

  // A micro-batch whose ids are all padding: embed()'s backward has no row to send, so it sends
  // nothing (no error, no micro-batch counted), as the Python embedding does.
  const torch::Tensor dw_before = ServerGradients("tied").weight_grad;
  const torch::Tensor padded = head.embed(torch::full({2, 3}, kPadding, torch::kLong),
                                          {.padding_idx = kPadding, .scale = scale});
  padded.sum().backward();
  const rc::HeadGradients untouched = ServerGradients("tied");
  EXPECT_EQ(untouched.info.accumulated_micro_batches, 2);
  EXPECT_TRUE(torch::equal(untouched.weight_grad, dw_before));
}

// A RemoteHead is pinned to the server process it described: after a restart (the head's state
// restored from --state_dir, without the dW of the micro-batches sent before) every call is
// refused with SERVER_RESTARTED and adds nothing, so no step applies a partial window; a
// RemoteHead attached anew trains on.
TEST(RemoteHeadRestart, CallsAfterTheServerRestartedAreRefusedAndChangeNothing) {
  char dir[] = "/tmp/remotehead_restart_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string listen = absl::StrCat("--listen=127.0.0.1:", testing::FreePort());
  const std::vector<std::string> argv = {REMOTEHEAD_SERVER_BINARY, listen, "--device=cpu",
                                         absl::StrCat("--state_dir=", dir)};
  testing::ServerProcess first(argv);
  ASSERT_GT(first.port(), 0) << first.log();
  auto client = *rc::Client::Create({.target = first.target()});
  ASSERT_TRUE(client->CreateHead("lm", rc::InitSpec{.vocab_size = kVocab, .hidden_size = kHidden})
                  .ok());
  auto head = rc::RemoteHead::Attach(client, {.head_id = "lm"});
  ASSERT_TRUE(head.ok()) << head.status();
  torch::manual_seed(5);
  const torch::Tensor labels = torch::randint(kVocab, {4, 3}, torch::kLong);
  const auto micro_batch = [&](rc::RemoteHead& h) {
    const torch::Tensor hidden = torch::randn({4, 3, kHidden}, torch::requires_grad());
    h.loss(hidden, labels).backward();
  };
  micro_batch(*head);
  ASSERT_EQ(first.Terminate(), 0) << first.log();  // the drain saves the head's state

  testing::ServerProcess second(argv);
  ASSERT_GT(second.port(), 0) << second.log();
  const rc::HeadInfo restored = *client->DescribeHead("lm");
  EXPECT_EQ(restored.accumulated_micro_batches, 0);  // a state holds no dW
  try {
    micro_batch(*head);
    ADD_FAILURE() << "a micro-batch after the restart was accepted";
  } catch (const rc::StatusError& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
    EXPECT_NE(e.status().message().find("expected_incarnation"), std::string::npos) << e.status();
  }
  auto step = head->OptimizerStep({.optimizer = rc::Sgd{.lr = 0.1}});
  EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition) << step.status();
  const rc::HeadInfo after = *client->DescribeHead("lm");
  EXPECT_EQ(after.accumulated_micro_batches, 0);
  EXPECT_EQ(after.weight_version, restored.weight_version);

  auto again = rc::RemoteHead::Attach(client, {.head_id = "lm"});
  ASSERT_TRUE(again.ok()) << again.status();
  micro_batch(*again);
  EXPECT_EQ(client->DescribeHead("lm")->accumulated_micro_batches, 1);
  ASSERT_TRUE(again->OptimizerStep({.optimizer = rc::Sgd{.lr = 0.1}}).ok());
  EXPECT_EQ(second.Terminate(), 0) << second.log();
  std::filesystem::remove_all(dir);
}

// The example trainer against the real server: it creates its head, trains body and head, and
// the loss falls from about ln(V) (the head starts near uniform) to well below half of it.
TEST(ExampleTrainer, LearnsAgainstTheRealServerBinary) {
  testing::ServerProcess server({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu"});
  ASSERT_GT(server.port(), 0) << server.log();
  const std::string target = server.target();

  struct Run {
    std::vector<std::string> flags;
    int64_t steps;
    double max_last_over_first;
  };
  const std::vector<Run> runs = {
      {{"--head_source=seed", "--optimizer=adamw"}, 30, 0.5},
      // Plain SGD learns slowly at this learning rate: the loss only has to go down.
      {{"--head_source=upload", "--optimizer=sgd", "--lr=0.5", "--head_lr=1"}, 8, 0.999},
  };
  for (const Run& run : runs) {
    SCOPED_TRACE(run.flags[0]);
    std::vector<std::string> args = {REMOTEHEAD_EXAMPLE_TRAINER, "--server=" + target,
                                     absl::StrCat("--steps=", run.steps), "--vocab=512",
                                     "--hidden=64"};
    args.insert(args.end(), run.flags.begin(), run.flags.end());
    // Runs to its end (no line makes it "ready").
    testing::ChildProcess trainer(args, [](const std::string&) { return false; });
    ASSERT_EQ(trainer.Wait(), 0) << trainer.log();
    std::vector<double> losses;
    for (const std::string& line :
         std::vector<std::string>(absl::StrSplit(trainer.log(), '\n', absl::SkipEmpty()))) {
      long long step = 0;
      double loss = 0;
      if (sscanf(line.c_str(), "step %lld loss %lf", &step, &loss) == 2) {
        EXPECT_EQ(step, static_cast<long long>(losses.size()));
        losses.push_back(loss);
      }
    }
    ASSERT_EQ(losses.size(), static_cast<size_t>(run.steps)) << trainer.log();
    EXPECT_NEAR(losses.front(), std::log(512.0), 0.05) << trainer.log();
    EXPECT_LT(losses.back(), run.max_last_over_first * losses.front()) << trainer.log();
  }
  // Each run dropped its head at the end.
  auto client = *rc::Client::Create({.target = target});
  auto heads = client->ListHeads();
  ASSERT_TRUE(heads.ok()) << heads.status();
  EXPECT_TRUE(heads->empty());
}

}  // namespace
}  // namespace remotehead
