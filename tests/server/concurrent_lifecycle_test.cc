// A step running while its head is dropped (and re-created under the same id), stepped by the
// optimizer, zeroed or given new weights by an upload: every pair ends in a defined way. A
// request that has computed rows on one version either completes on that version or fails with
// ABORTED naming what changed, and then commits nothing; no request mixes two versions, and no
// gradient vanishes silently (a retry of the aborted request is added exactly once).
#include "server/service_fixture.h"

namespace remotehead {
namespace {

enum class Operation { kDrop, kDropAndRecreate, kOptimizerStep, kZeroGradients, kReplaceWeights };

std::string Name(Operation op) {
  switch (op) {
    case Operation::kDrop:
      return "Drop";
    case Operation::kDropAndRecreate:
      return "DropAndRecreate";
    case Operation::kOptimizerStep:
      return "OptimizerStep";
    case Operation::kZeroGradients:
      return "ZeroGradients";
    case Operation::kReplaceWeights:
      return "ReplaceWeights";
  }
  return "?";
}

enum class Call { kForwardBackward, kForward, kBackward };

std::string Name(Call rpc) {
  return rpc == Call::kForward    ? "Forward"
         : rpc == Call::kBackward ? "Backward"
                                  : "ForwardBackward";
}

struct Pair {
  Call rpc;
  Operation op;
};

class LifecycleFixture : public ServiceFixture {
 protected:
  void SetUp() override { StartService({.admission = {.memory_budget_bytes = 64 << 20}}); }

  // The header of a step on "lm": a Forward returns per-token log-probs (so that it streams
  // results as it goes), the gradient RPCs accumulate dW as "run/rank-0" micro-batch 0.
  v1::StepRequest Header(Call rpc) const {
    v1::StepRequest m;
    v1::StepHeader* h = m.mutable_header();
    h->set_head_id("lm");
    h->set_rows(kRows);
    h->mutable_chunking()->set_chunk_rows(8);
    if (rpc == Call::kForward) {
      h->mutable_function()->set_name("token_logprobs");
      h->mutable_function()->set_reduction(v1::REDUCTION_NONE);
      return m;
    }
    h->mutable_function()->set_reduction(v1::REDUCTION_SUM);
    h->set_accumulate_weight_grad(true);
    h->mutable_gradient_id()->set_trainer("run/rank-0");
    return m;
  }

  v1::StepRequest Rows(int64_t offset, int64_t n) const {
    v1::StepRequest m;
    m.mutable_rows()->set_row_offset(offset);
    EXPECT_TRUE(
        EncodeTensor(batch_.hidden.narrow(0, offset, n), m.mutable_rows()->mutable_hidden()).ok());
    EXPECT_TRUE(
        EncodeTensor(batch_.targets.narrow(0, offset, n), m.mutable_rows()->mutable_targets())
            .ok());
    return m;
  }

  grpc::Status Unary(const std::function<grpc::Status(grpc::ClientContext*)>& call) {
    grpc::ClientContext context;
    return call(&context);
  }

  // Runs `op` on head "lm" through the service, as another client would.
  void Run(Operation op) {
    v1::HeadRef ref;
    ref.set_head_id("lm");
    switch (op) {
      case Operation::kDrop:
      case Operation::kDropAndRecreate: {
        v1::DropHeadResponse dropped;
        ASSERT_TRUE(Unary([&](auto* c) { return stub_->DropHead(c, ref, &dropped); }).ok());
        if (op == Operation::kDrop) return;
        v1::CreateHeadRequest create;
        create.set_head_id("lm");
        create.mutable_init()->set_vocab_size(kVocab);
        create.mutable_init()->set_hidden_size(kHidden);
        create.mutable_init()->set_bias(true);
        create.mutable_init()->set_seed(6);
        v1::HeadInfo info;
        ASSERT_TRUE(Unary([&](auto* c) { return stub_->CreateHead(c, create, &info); }).ok());
        return;
      }
      case Operation::kOptimizerStep: {
        v1::OptimizerStepRequest step;
        step.set_head_id("lm");
        step.mutable_sgd()->set_lr(0.1);
        step.mutable_sgd()->set_weight_decay(0.1);  // changes W even with dW = 0
        v1::OptimizerStepResponse stepped;
        ASSERT_TRUE(Unary([&](auto* c) { return stub_->OptimizerStep(c, step, &stepped); }).ok());
        return;
      }
      case Operation::kZeroGradients: {
        v1::ZeroGradientsResponse zeroed;
        ASSERT_TRUE(Unary([&](auto* c) { return stub_->ZeroGradients(c, ref, &zeroed); }).ok());
        return;
      }
      case Operation::kReplaceWeights: {
        const core::Head& head = testing::HeadOf(*entry_);
        ASSERT_TRUE(Upload("lm", head.weight() * 2, head.bias() * 2, /*replace=*/true).ok());
        return;
      }
    }
  }

  struct Outcome {
    grpc::Status status;
    int results_before_op = 0;  // dX / output chunks that had arrived when `op` ran
  };

  // Streams a step of `rpc`: the header and the first 17 rows, waits for their first results
  // (rows have been computed on the head as it was), runs `op`, then sends the rest.
  Outcome StepAcross(Call rpc, Operation op) {
    grpc::ClientContext context;
    auto stream = rpc == Call::kForward    ? stub_->Forward(&context)
                  : rpc == Call::kBackward ? stub_->Backward(&context)
                                           : stub_->ForwardBackward(&context);
    Outcome outcome;
    EXPECT_TRUE(stream->Write(Header(rpc)));
    EXPECT_TRUE(stream->Write(Rows(0, 17)));
    v1::StepResponse response;
    while (stream->Read(&response)) {
      if (response.has_grad_hidden() || response.has_outputs()) {
        ++outcome.results_before_op;
        break;
      }
    }
    Run(op);
    stream->Write(Rows(17, kRows - 17));
    stream->WritesDone();
    while (stream->Read(&response)) {
    }
    outcome.status = stream->Finish();
    return outcome;
  }
};

class ConcurrentLifecycleTest : public LifecycleFixture,
                                public ::testing::WithParamInterface<Pair> {};

TEST_P(ConcurrentLifecycleTest, EndsWhollyOnOneVersionOrAbortsCommittingNothing) {
  const auto [rpc, op] = GetParam();
  const Outcome outcome = StepAcross(rpc, op);
  ASSERT_EQ(outcome.results_before_op, 1) << "the first rows were computed before the operation";

  // Zeroing closes a gradient window: only a request that accumulates dW is refused.
  const bool must_abort = op != Operation::kZeroGradients || rpc != Call::kForward;
  if (!must_abort) {
    EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
    return;
  }
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::ABORTED)
      << outcome.status.error_message();
  EXPECT_NE(outcome.status.error_message().find("head \"lm\""), std::string::npos)
      << outcome.status.error_message();
  EXPECT_NE(outcome.status.error_message().find("othing was committed"), std::string::npos)
      << outcome.status.error_message();
  if (op == Operation::kDrop) {
    EXPECT_FALSE(registry().Get("lm").ok());
    return;
  }
  // Nothing reached the head that is now "lm": no gradient, no ledger entry.
  std::shared_ptr<server::HeadEntry> now = *registry().Get("lm");
  EXPECT_EQ(now->Describe().accumulated_micro_batches, 0);
  EXPECT_EQ(testing::HeadOf(*now).grads().weight.abs().max().item<double>(), 0.0);

  // The aborted contribution is not lost: sent again, it runs on the head as it is now and is
  // added exactly once (not reported as a replay).
  if (rpc == Call::kForward) return;
  const core::Head& head = testing::HeadOf(*now);
  core::GradientBuffers expected = head.NewGradientBuffers();
  ASSERT_TRUE(
      core::FusedForwardBackward(head, batch_, {.reduction = core::Reduction::kSum}, &expected)
          .ok());
  grpc::ClientContext context;
  auto stream =
      rpc == Call::kBackward ? stub_->Backward(&context) : stub_->ForwardBackward(&context);
  stream->Write(Header(rpc));
  stream->Write(Rows(0, kRows));
  stream->WritesDone();
  v1::StepResponse response;
  v1::StepSummary summary;
  while (stream->Read(&response)) {
    if (response.has_summary()) summary = response.summary();
  }
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_FALSE(summary.replayed());
  EXPECT_EQ(now->Describe().accumulated_micro_batches, 1);
  EXPECT_LE(reference::RelativeError(testing::HeadOf(*now).grads().weight, expected.weight), 1e-5);
}

std::vector<Pair> AllPairs() {
  std::vector<Pair> pairs;
  for (Call rpc : {Call::kForwardBackward, Call::kForward, Call::kBackward}) {
    for (Operation op : {Operation::kDrop, Operation::kDropAndRecreate, Operation::kOptimizerStep,
                         Operation::kZeroGradients, Operation::kReplaceWeights}) {
      pairs.push_back({rpc, op});
    }
  }
  return pairs;
}

INSTANTIATE_TEST_SUITE_P(EveryPair, ConcurrentLifecycleTest, ::testing::ValuesIn(AllPairs()),
                         [](const ::testing::TestParamInfo<Pair>& info) {
                           return Name(info.param.rpc) + "_" + Name(info.param.op);
                         });

// An operation that lands before the request computed anything is not a conflict: the request
// runs wholly on the head as it is after the operation.
class LifecycleBeforeComputeTest : public LifecycleFixture {};

TEST_F(LifecycleBeforeComputeTest, OptimizerStepBeforeTheFirstRowsIsSimplyTheNewVersion) {
  grpc::ClientContext context;
  auto stream = stub_->ForwardBackward(&context);
  ASSERT_TRUE(stream->Write(Header(Call::kForwardBackward)));
  Run(Operation::kOptimizerStep);
  const core::Head& head = testing::HeadOf(*entry_);
  EXPECT_EQ(head.version(), 1);
  core::GradientBuffers expected = head.NewGradientBuffers();
  auto direct =
      core::FusedForwardBackward(head, batch_, {.reduction = core::Reduction::kSum}, &expected);
  ASSERT_TRUE(direct.ok());
  stream->Write(Rows(0, kRows));
  stream->WritesDone();
  v1::StepResponse response;
  v1::StepSummary summary;
  while (stream->Read(&response)) {
    if (response.has_summary()) summary = response.summary();
  }
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_EQ(summary.weight_version(), 1);
  EXPECT_LE(reference::RelativeError(summary.loss(), direct->loss), 1e-5);
  EXPECT_LE(reference::RelativeError(head.grads().weight, expected.weight), 1e-5);
}

// A request that names its version (expected_weight_version) is bound to it from its header:
// an optimizer step before its first rows aborts it.
TEST_F(LifecycleBeforeComputeTest, APinnedVersionHoldsFromTheHeader) {
  grpc::ClientContext context;
  auto stream = stub_->ForwardBackward(&context);
  v1::StepRequest header = Header(Call::kForwardBackward);
  header.mutable_header()->set_expected_weight_version(0);
  ASSERT_TRUE(stream->Write(header));
  // The header is checked (and the version pinned) before admission reads any rows; a
  // DescribeHead round trip on the same server orders nothing, so wait for the pin to exist:
  // the request holds admission bytes once its header is through.
  for (int i = 0; i < 500 && service().admission().Stats().active == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(service().admission().Stats().active, 1);
  Run(Operation::kOptimizerStep);
  stream->Write(Rows(0, kRows));
  stream->WritesDone();
  v1::StepResponse response;
  while (stream->Read(&response)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_NE(status.error_message().find("expected weight version 0"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(entry_->Describe().accumulated_micro_batches, 0);
}

}  // namespace
}  // namespace remotehead
