// The C++ client's distillation calls against an in-process server: frozen heads created and
// uploaded (HeadInfo::frozen, teacher_of), a two-head step whose teacher hidden states travel in
// the same row messages as X (StepSpec::teacher_head_id, StepInputs::teacher_hidden), and a
// sparse teacher's [N, k] aux (integer ids and their log-probs) sliced by rows, per-token extras
// back row by row (StepSpec::token_extras) — every request split into many messages (4 KiB each
// at most), the results equal to the engine's.
#include <gtest/gtest.h>

#include "remotehead/client/client.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/rpc/head_service.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

namespace remotehead {
namespace {

namespace rc = client;

constexpr int64_t kVocab = 97;
constexpr int64_t kHidden = 16;
constexpr int64_t kTeacherHidden = 24;
constexpr int64_t kRows = 41;
constexpr double kTol = 1e-6;

void ExpectClose(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double diff = (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max().item<double>();
  EXPECT_LE(diff, kTol) << what << ": max |client − engine| = " << diff;
}

class TeacherClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.started());
    client_ = *rc::Client::Create({.target = server_.target(), .chunk_bytes = 4096});
    ASSERT_TRUE(client_
                    ->CreateHead("lm", rc::InitSpec{.vocab_size = kVocab,
                                                    .hidden_size = kHidden,
                                                    .bias = true,
                                                    .seed = 3,
                                                    .init_std = 0.3})
                    .ok());
    torch::manual_seed(11);
    hidden_ = torch::randn({kRows, kHidden});
    targets_ = torch::randint(0, kVocab, {kRows}, torch::kLong);
    targets_.index_put_({torch::arange(0, kRows, 5)}, -100);
  }

  core::Head& HeadNamed(const std::string& id) {
    return testing::HeadOf(**server_.registry().Get(id));
  }

  // The engine on "lm" with `teacher`, as the client's spec asks (MEAN over the valid tokens).
  core::FusedResult Fused(const std::string& function, core::TokenBatch batch,
                          const core::Head* teacher, core::GradientBuffers* grads) {
    core::StepOptions options{.function = function, .chunk_rows = 8};
    options.normalizer = std::max<int64_t>((targets_ != -100).sum().item<int64_t>(), 1);
    options.teacher = teacher;
    batch.hidden = hidden_;
    batch.targets = targets_;
    auto r = core::FusedForwardBackward(HeadNamed("lm"), batch, options, grads);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : core::FusedResult{};
  }

  testing::InProcessServer server_{server::ServiceOptions{}, /*max_receive_message_bytes=*/4096};
  std::shared_ptr<rc::Client> client_;
  torch::Tensor hidden_, targets_;
};

TEST_F(TeacherClientTest, FrozenHeadsAndATwoHeadStep) {
  auto created = client_->CreateHead("teacher", rc::InitSpec{.vocab_size = kVocab,
                                                             .hidden_size = kTeacherHidden,
                                                             .bias = true,
                                                             .seed = 4,
                                                             .init_std = 0.3,
                                                             .frozen = true});
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->frozen);
  torch::manual_seed(2);
  const torch::Tensor w = torch::randn({kVocab, kTeacherHidden}) * 0.3;
  auto uploaded = client_->UploadHead("teacher2", w, {}, {.frozen = true});
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_TRUE(uploaded->frozen);
  // A replace keeps the flag; asking to unfreeze it is refused naming the field.
  auto unfreeze = client_->UploadHead("teacher2", w, {}, {.frozen = false, .replace = true});
  EXPECT_EQ(unfreeze.status().code(), absl::StatusCode::kInvalidArgument) << unfreeze.status();
  EXPECT_NE(unfreeze.status().message().find("header.frozen"), std::string::npos);
  // A frozen head takes no optimizer step.
  auto step = client_->OptimizerStep("teacher", {.optimizer = rc::Sgd{.lr = 0.1}});
  EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition) << step.status();

  torch::manual_seed(5);
  const torch::Tensor teacher_hidden = torch::randn({kRows, kTeacherHidden});
  rc::StepSpec spec{.head_id = "lm", .function = "distill_jsd", .chunk_rows = 8};
  spec.gradient_id = rc::GradientId{"t", 0, 0};
  // The client refuses a teacher without its hidden states, and hidden states without one.
  auto missing = client_->ForwardBackward(
      {.head_id = "lm", .function = "distill_jsd", .teacher_head_id = "teacher"},
      {.hidden = hidden_, .targets = targets_});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("inputs.teacher_hidden"), std::string::npos);
  auto stray = client_->ForwardBackward(
      spec, {.hidden = hidden_, .targets = targets_, .teacher_hidden = teacher_hidden});
  EXPECT_EQ(stray.status().code(), absl::StatusCode::kInvalidArgument);

  spec.teacher_head_id = "teacher";
  auto r = client_->ForwardBackward(
      spec, {.hidden = hidden_, .targets = targets_, .teacher_hidden = teacher_hidden});
  ASSERT_TRUE(r.ok()) << r.status();
  core::GradientBuffers grads = HeadNamed("lm").NewGradientBuffers();
  const core::FusedResult want =
      Fused("distill_jsd", {.teacher_hidden = teacher_hidden}, &HeadNamed("teacher"), &grads);
  EXPECT_NEAR(r->loss, want.loss, kTol);
  ExpectClose(r->grad_hidden, want.grad_hidden, "dX");
  ExpectClose(HeadNamed("lm").grads().weight, grads.weight, "dW");
  auto info = client_->DescribeHead("teacher");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->teacher_of, std::vector<std::string>{"lm"});
  auto listed = client_->ListFunctions();
  ASSERT_TRUE(listed.ok());
  for (const rc::FunctionInfo& f : *listed) {
    if (f.name == "distill_jsd") {
      EXPECT_TRUE(f.needs_teacher);
    }
    if (f.name == "cross_entropy") {
      EXPECT_FALSE(f.needs_teacher);
    }
    if (f.name == "distill_topk_kl") {
      EXPECT_EQ(f.integral_aux, std::vector<std::string>{"teacher_topk_ids"});
      EXPECT_EQ(f.topk_aux.size(), 2u);
    }
  }
}

// The per-token extras a step asks for (StepSpec::token_extras) come back row by row in every
// mode, in many messages, equal to the engine's; the listing says which a function reports.
TEST_F(TeacherClientTest, TokenExtrasComeBackRowByRowInEveryMode) {
  torch::manual_seed(2);
  ASSERT_TRUE(client_
                  ->UploadHead("teacher", torch::randn({kVocab, kTeacherHidden}) * 0.3, {},
                               {.frozen = true})
                  .ok());
  const torch::Tensor teacher_hidden = torch::randn({kRows, kTeacherHidden});
  const std::vector<std::string> names = {"entropy", "nll", "divergence"};
  rc::StepSpec spec{.head_id = "lm",
                    .function = "distill_kl",
                    .params = {{"alpha", 0.2}, {"temperature", 1.5}},
                    .accumulate_weight_grad = false,
                    .teacher_head_id = "teacher",
                    .token_extras = names};
  const rc::StepInputs inputs{
      .hidden = hidden_, .targets = targets_, .teacher_hidden = teacher_hidden};
  auto fused = client_->ForwardBackward(spec, inputs);
  ASSERT_TRUE(fused.ok()) << fused.status();
  spec.reduction = rc::Reduction::kNone;
  auto forward = client_->Forward(spec, inputs);
  ASSERT_TRUE(forward.ok()) << forward.status();
  auto backward = client_->Backward(spec, inputs, torch::ones({kRows}));
  ASSERT_TRUE(backward.ok()) << backward.status();

  core::StepOptions options{.function = "distill_kl",
                            .params = {{"alpha", 0.2}, {"temperature", 1.5}},
                            .reduction = core::Reduction::kNone};
  options.teacher = &HeadNamed("teacher");
  options.token_extras = names;
  auto want = core::Forward(
      HeadNamed("lm"), {.hidden = hidden_, .targets = targets_, .teacher_hidden = teacher_hidden},
      options);
  ASSERT_TRUE(want.ok()) << want.status();
  for (const std::string& name : names) {
    ExpectClose(fused->token_extras.at(name), want->token_extras.at(name), "fused " + name);
    ExpectClose(forward->token_extras.at(name), want->token_extras.at(name), "forward " + name);
    ExpectClose(backward->token_extras.at(name), want->token_extras.at(name), "backward " + name);
  }
  EXPECT_NEAR(fused->summary.extras.at("entropy"),
              want->token_extras.at("entropy").sum().item<double>(), 1e-4);

  auto listed = client_->ListFunctions();
  ASSERT_TRUE(listed.ok());
  for (const rc::FunctionInfo& f : *listed) {
    if (f.name != "distill_kl") continue;
    std::vector<std::string> conditions;
    for (const rc::FunctionExtra& e : f.extras) conditions.push_back(e.name + ":" + e.when_param);
    EXPECT_EQ(conditions, (std::vector<std::string>{"divergence:", "entropy:", "nll:alpha"}));
  }
  // A name the call does not report: refused by the server, naming it.
  spec.params.erase("alpha");
  auto refused = client_->Forward(spec, inputs);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("token_extras[1]"), std::string::npos)
      << refused.status();
}

TEST_F(TeacherClientTest, SparseTeacherAuxTravelAsRowsOfK) {
  constexpr int64_t k = 6;
  torch::manual_seed(8);
  const torch::Tensor logprobs = torch::log_softmax(torch::randn({kRows, kVocab}) * 2, 1);
  const auto [values, ids] = logprobs.topk(k, 1);
  core::TokenBatch aux;
  aux.aux["teacher_topk_ids"] = ids.to(torch::kInt);  // int32 ids travel as they are
  aux.aux["teacher_topk_logprobs"] = values;
  rc::StepSpec spec{.head_id = "lm", .function = "distill_topk_reverse_kl", .chunk_rows = 8};
  spec.gradient_id = rc::GradientId{"t", 0, 0};
  auto r = client_->ForwardBackward(spec, {.hidden = hidden_, .targets = targets_, .aux = aux.aux});
  ASSERT_TRUE(r.ok()) << r.status();
  core::GradientBuffers grads = HeadNamed("lm").NewGradientBuffers();
  const core::FusedResult want = Fused("distill_topk_reverse_kl", aux, nullptr, &grads);
  EXPECT_NEAR(r->loss, want.loss, kTol);
  ExpectClose(r->grad_hidden, want.grad_hidden, "top-k dX");
  ExpectClose(HeadNamed("lm").grads().weight, grads.weight, "top-k dW");
  // An aux of three dimensions is the client's to refuse.
  auto bad = client_->ForwardBackward(
      spec, {.hidden = hidden_,
             .targets = targets_,
             .aux = {{"teacher_topk_ids", ids.unsqueeze(2)}, {"teacher_topk_logprobs", values}}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("inputs.aux[\"teacher_topk_ids\"]"), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace remotehead
