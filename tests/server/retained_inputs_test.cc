// Two-phase steps by handle: a Forward keeps its rows on the server, the Backward sends only
// dL/dy and gets the same dX and dW as if it had re-sent X; the retained bytes count against
// the memory budget until the Backward succeeds or the handle expires; a handle is refused
// for another head, after an optimizer step, once released and once expired.
#include "server/service_fixture.h"

namespace remotehead {
namespace {

class RetainedInputsTest : public ServiceFixture {
 protected:
  void SetUp() override { StartService({.admission = {.memory_budget_bytes = 64 << 20}}); }

  // A Forward of the test batch with `function` and `reduction` that keeps its inputs.
  StepOutcome RetainingForward(const std::string& function, v1::Reduction reduction,
                               double seconds) {
    return Step(
        "", 0, 17,
        [&](v1::StepRequest& m) {
          if (!m.has_header()) return;
          m.mutable_header()->mutable_function()->set_name(function);
          m.mutable_header()->mutable_function()->set_reduction(reduction);
          m.mutable_header()->set_retain_inputs_seconds(seconds);
        },
        Rpc::kForward);
  }

  // A Backward by `handle`: rows carry only grad_output (reduction NONE) or are not sent.
  StepOutcome BackwardByHandle(const std::string& handle, const std::string& function,
                               v1::Reduction reduction, const torch::Tensor& grad_output,
                               int64_t micro_batch) {
    return Step(
        "run/rank-0", micro_batch, 17,
        [&](v1::StepRequest& m) {
          if (m.has_header()) {
            m.mutable_header()->mutable_function()->set_name(function);
            m.mutable_header()->mutable_function()->set_reduction(reduction);
            m.mutable_header()->set_inputs_handle(handle);
          } else if (grad_output.defined()) {
            m.mutable_rows()->clear_hidden();
            m.mutable_rows()->clear_targets();
          } else {
            m.clear_part();  // a scalar Backward by handle sends no rows
          }
        },
        Rpc::kBackward, grad_output);
  }
};

TEST_F(RetainedInputsTest, PerTokenBackwardByHandleMatchesTheEngineAndReleasesTheBytes) {
  const core::StepOptions options{.function = "token_logprobs",
                                  .reduction = core::Reduction::kNone};
  const StepOutcome forward = RetainingForward("token_logprobs", v1::REDUCTION_NONE, 60);
  ASSERT_TRUE(forward.status.ok()) << forward.status.error_message();
  const std::string handle = forward.summary.inputs_handle();
  EXPECT_EQ(handle.size(), 32u);
  // X [50, 32] fp32 and the int64 targets stay reserved in the budget.
  ExpectAdmissionSettles(kRows * kHidden * 4 + kRows * 8);

  const torch::Tensor upstream = torch::randn({kRows});
  core::GradientBuffers grads = testing::HeadOf(*entry_).NewGradientBuffers();
  auto dx = core::Backward(testing::HeadOf(*entry_), batch_, options, upstream, &grads);
  ASSERT_TRUE(dx.ok());
  const StepOutcome backward =
      BackwardByHandle(handle, "token_logprobs", v1::REDUCTION_NONE, upstream, 0);
  ASSERT_TRUE(backward.status.ok()) << backward.status.error_message();
  // fp32 rounding relative to dX's size: the server batches rows differently from one call.
  EXPECT_LE(reference::RelativeError(backward.grad_hidden, dx->grad_hidden), 1e-6);
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), grads.weight), 1e-5);
  EXPECT_EQ(backward.summary.valid_tokens(), (batch_.targets != -100).sum().item<int64_t>());
  ExpectAdmissionDrains();

  const StepOutcome again =
      BackwardByHandle(handle, "token_logprobs", v1::REDUCTION_NONE, upstream, 1);
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(again.status.error_message(),
            absl::StrCat("header.inputs_handle: expected a live handle from a Forward with "
                         "retain_inputs_seconds > 0; got \"",
                         handle,
                         "\", which is unknown, expired or already released by a successful "
                         "Backward"));
}

TEST_F(RetainedInputsTest, ScalarBackwardByHandleNeedsNoRows) {
  const StepOutcome forward = RetainingForward("cross_entropy", v1::REDUCTION_MEAN, 60);
  ASSERT_TRUE(forward.status.ok()) << forward.status.error_message();
  const core::StepOptions options{.upstream_scale = 1.0};
  core::GradientBuffers grads = testing::HeadOf(*entry_).NewGradientBuffers();
  auto dx = core::Backward(testing::HeadOf(*entry_), batch_, options, torch::ones({}), &grads);
  ASSERT_TRUE(dx.ok());
  const StepOutcome backward =
      BackwardByHandle(forward.summary.inputs_handle(), "cross_entropy", v1::REDUCTION_MEAN, {}, 0);
  ASSERT_TRUE(backward.status.ok()) << backward.status.error_message();
  // fp32 rounding relative to dX's size: the server batches rows differently from one call.
  EXPECT_LE(reference::RelativeError(backward.grad_hidden, dx->grad_hidden), 1e-6);
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), grads.weight), 1e-5);
}

TEST_F(RetainedInputsTest, HandleIsRefusedAfterAnOptimizerStepForAnotherHeadAndOnceExpired) {
  const torch::Tensor upstream = torch::randn({kRows});
  const StepOutcome forward = RetainingForward("token_logprobs", v1::REDUCTION_NONE, 60);
  ASSERT_TRUE(forward.status.ok());
  const std::string handle = forward.summary.inputs_handle();

  // Another head's Backward cannot use this head's inputs.
  const StepOutcome other = Step(
      "run/rank-0", 0, 17,
      [&](v1::StepRequest& m) {
        if (m.has_header()) {
          m.mutable_header()->set_head_id("other");
          m.mutable_header()->set_inputs_handle(handle);
        }
      },
      Rpc::kBackward);
  EXPECT_EQ(other.status.error_code(), grpc::StatusCode::NOT_FOUND);  // no head "other"
  grpc::ClientContext create_context;
  v1::CreateHeadRequest create;
  create.set_head_id("other");
  create.mutable_init()->set_vocab_size(kVocab);
  create.mutable_init()->set_hidden_size(kHidden);
  v1::HeadInfo info;
  ASSERT_TRUE(stub_->CreateHead(&create_context, create, &info).ok());
  const StepOutcome wrong_head = Step(
      "run/rank-0", 0, 17,
      [&](v1::StepRequest& m) {
        if (m.has_header()) {
          m.mutable_header()->set_head_id("other");
          m.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_SUM);
          m.mutable_header()->set_inputs_handle(handle);
        } else {
          m.clear_part();
        }
      },
      Rpc::kBackward);
  EXPECT_EQ(wrong_head.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(wrong_head.status.error_message(),
            "header.inputs_handle: expected a handle from a Forward on head \"other\"; got one "
            "from head \"lm\"");

  // The weights moved since the Forward: its inputs would give a different gradient.
  grpc::ClientContext step_context;
  v1::OptimizerStepRequest step;
  step.set_head_id("lm");
  step.mutable_sgd()->set_lr(0.1);
  v1::OptimizerStepResponse stepped;
  ASSERT_TRUE(stub_->OptimizerStep(&step_context, step, &stepped).ok());
  const torch::Tensor before = HeadWeightGrad();
  const StepOutcome stale =
      BackwardByHandle(handle, "token_logprobs", v1::REDUCTION_NONE, upstream, 0);
  EXPECT_EQ(stale.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(stale.status.error_message(),
            "header.inputs_handle: expected the head to be at the version its Forward ran "
            "against, 0; got version 1 (an optimizer step happened in between)");
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));

  // Lifetimes are bounded: an expired handle is gone and its bytes are free again.
  const StepOutcome brief = RetainingForward("token_logprobs", v1::REDUCTION_NONE, 0.2);
  ASSERT_TRUE(brief.status.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const StepOutcome expired = BackwardByHandle(brief.summary.inputs_handle(), "token_logprobs",
                                               v1::REDUCTION_NONE, upstream, 1);
  EXPECT_EQ(expired.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));
}

class RetainedInputsSmallBudgetTest : public RetainedInputsTest {
 protected:
  // Enough to run this Forward (core's estimate of one engine call, the rows in flight), not
  // to keep its inputs (X and the int64 targets) besides.
  void SetUp() override {
    const int64_t forward =
        EngineBytes("token_logprobs", core::Reduction::kNone, core::CallMode::kForward) +
        kPipelineBytes;
    StartService(
        {.admission = {.memory_budget_bytes = kHeadBytes + forward + kRows * kHidden * 4 / 2}});
  }
};

TEST_F(RetainedInputsSmallBudgetTest, RetainingIsRefusedWhenItDoesNotFitTheBudget) {
  const StepOutcome plain = RetainingForward("token_logprobs", v1::REDUCTION_NONE, 0);
  EXPECT_TRUE(plain.status.ok()) << plain.status.error_message();
  ExpectAdmissionDrains();
  const StepOutcome forward = RetainingForward("token_logprobs", v1::REDUCTION_NONE, 60);
  EXPECT_EQ(forward.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(forward.status.error_message().find("+ retained inputs "), std::string::npos)
      << forward.status.error_message();
  ExpectAdmissionDrains();
}

TEST_F(RetainedInputsTest, HandleFieldsAreCheckedPerRpc) {
  const StepOutcome fused = Step("run/rank-0", 0, 17, [](v1::StepRequest& m) {
    if (m.has_header()) m.mutable_header()->set_retain_inputs_seconds(5);
  });
  EXPECT_EQ(fused.status.error_message(),
            "header.retain_inputs_seconds: expected 0, or > 0 on a Forward; got 5 on a gradient "
            "call");
  const StepOutcome forward = Step(
      "", 0, 17,
      [](v1::StepRequest& m) {
        if (m.has_header()) m.mutable_header()->set_inputs_handle("abc");
      },
      Rpc::kForward);
  EXPECT_EQ(forward.status.error_message(),
            "header.inputs_handle: expected none (only Backward takes retained inputs); got one");
}

TEST_F(RetainedInputsTest, GradHiddenDtypeConvertsTheReturnedDx) {
  auto direct = core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, nullptr);
  ASSERT_TRUE(direct.ok());
  const StepOutcome bf16 = Step("run/rank-0", 0, 17, [](v1::StepRequest& m) {
    if (m.has_header()) {
      m.mutable_header()->set_accumulate_weight_grad(false);
      m.mutable_header()->set_grad_hidden_dtype(v1::DTYPE_BFLOAT16);
    }
  });
  ASSERT_TRUE(bf16.status.ok()) << bf16.status.error_message();
  EXPECT_EQ(bf16.grad_hidden_wire_dtype, v1::DTYPE_BFLOAT16);
  EXPECT_TRUE(
      torch::equal(bf16.grad_hidden, direct->grad_hidden.to(torch::kBFloat16).to(torch::kFloat)));
}

// A budget that holds exactly the head and a retaining Forward as its header declares it: X and
// int64 targets. Per-token weights, known only as the rows arrive, need more.
class RetainedInputsExactBudgetTest : public ServiceFixture {
 protected:
  void SetUp() override {
    const int64_t forward =
        EngineBytes("cross_entropy", core::Reduction::kWeightedSum, core::CallMode::kForward) +
        kPipelineBytes + kRows * (kHidden * 4 + 8);
    StartService({.admission = {.memory_budget_bytes = kHeadBytes + forward}});
  }

  // A weighted-sum Forward whose rows carry per-token weights, retained for `seconds`.
  StepOutcome WeightedForward(double seconds) {
    return Step(
        "", 0, 17,
        [seconds](v1::StepRequest& m) {
          if (m.has_header()) {
            m.mutable_header()->mutable_function()->set_reduction(v1::REDUCTION_WEIGHTED_SUM);
            m.mutable_header()->set_retain_inputs_seconds(seconds);
          } else {
            const int64_t n = m.rows().hidden().shape(0);
            EXPECT_TRUE(EncodeTensor(torch::ones({n}), m.mutable_rows()->mutable_weights()).ok());
          }
        },
        Rpc::kForward);
  }
};

TEST_F(RetainedInputsExactBudgetTest, RetainedRowsAreBoundedByTheBudgetWhileTheyArrive) {
  const StepOutcome plain = WeightedForward(0);
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  ExpectAdmissionDrains();
  const StepOutcome retained = WeightedForward(60);
  EXPECT_EQ(retained.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(retained.status.error_message().find("inputs retained for the Backward"),
            std::string::npos)
      << retained.status.error_message();
  EXPECT_TRUE(retained.summary.inputs_handle().empty());
  ExpectAdmissionDrains();  // nothing stays reserved, no handle lives on
}

}  // namespace
}  // namespace remotehead
