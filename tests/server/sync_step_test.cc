// Synchronous optimizer steps of data-parallel trainers (OptimizerStepRequest.synchronous),
// over a real gRPC channel: every rank's call waits for the others, the step is applied once
// with the summed dW scaled by grad_scale / world_size, every rank gets the same answer, a
// retry gets it again; a missing rank, a disagreement, a bad rank or a drain applies nothing
// and keeps dW.
#include <future>

#include "service_fixture.h"

namespace remotehead {
namespace {

using namespace std::chrono_literals;

class SyncStepTest : public ServiceFixture {
 protected:
  void Start(double timeout_seconds = 30) {
    StartService({.sync_step_timeout_seconds = timeout_seconds});
  }

  static v1::OptimizerStepRequest SyncRequest(int64_t step, int rank, int world, double lr = 0.1) {
    v1::OptimizerStepRequest request;
    request.set_head_id("lm");
    request.mutable_sgd()->set_lr(lr);
    request.set_zero_gradients(true);
    request.mutable_synchronous()->set_step(step);
    request.mutable_synchronous()->set_rank(rank);
    request.mutable_synchronous()->set_world_size(world);
    return request;
  }

  struct Answer {
    grpc::Status status;
    v1::HeadInfo info;
  };
  Answer Call(const v1::OptimizerStepRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 60s);
    v1::OptimizerStepResponse response;
    Answer a{stub_->OptimizerStep(&context, request, &response), response.info()};
    return a;
  }
  std::future<Answer> CallAsync(v1::OptimizerStepRequest request) {
    return std::async(std::launch::async, [this, request] { return Call(request); });
  }

  // Two trainers' micro-batches: dW summed over both.
  void AccumulateTwoRanks() {
    ASSERT_TRUE(Step("run/rank-0", 0).status.ok());
    ASSERT_TRUE(Step("run/rank-1", 0).status.ok());
  }
  torch::Tensor Weight() { return testing::HeadOf(*entry_).weight().clone(); }
  int64_t Version() { return entry_->Describe().weight_version; }
  int64_t MicroBatches() { return entry_->Describe().accumulated_micro_batches; }
};

TEST_F(SyncStepTest, EveryRankWaitsTheStepIsAppliedOnceAveragedLikeDdpAndRetriesGetTheAnswer) {
  Start();
  AccumulateTwoRanks();
  const torch::Tensor w = Weight();
  const torch::Tensor dw = HeadWeightGrad();
  std::future<Answer> rank0 = CallAsync(SyncRequest(0, 0, 2));
  // Rank 0 waits: nothing is applied before rank 1 asks.
  EXPECT_EQ(rank0.wait_for(300ms), std::future_status::timeout);
  EXPECT_EQ(Version(), 0);
  const Answer rank1 = Call(SyncRequest(0, 1, 2));
  const Answer first = rank0.get();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(rank1.status.ok()) << rank1.status.error_message();
  EXPECT_EQ(first.info.weight_version(), 1);
  EXPECT_EQ(rank1.info.SerializeAsString(), first.info.SerializeAsString());
  // SGD on the DDP average: W - lr · (dW_0 + dW_1) / 2.
  EXPECT_TRUE(torch::allclose(Weight(), w - 0.1 * dw / 2, 1e-6, 1e-7));
  EXPECT_EQ(MicroBatches(), 0);  // zero_gradients

  // Rank 1's answer was lost: its retry gets the same answer, nothing is applied again.
  const torch::Tensor after = Weight();
  const Answer retry = Call(SyncRequest(0, 1, 2));
  ASSERT_TRUE(retry.status.ok()) << retry.status.error_message();
  EXPECT_EQ(retry.info.weight_version(), 1);
  EXPECT_TRUE(torch::equal(Weight(), after));

  // The next step goes through the same way.
  AccumulateTwoRanks();
  std::future<Answer> next0 = CallAsync(SyncRequest(1, 0, 2));
  const Answer next1 = Call(SyncRequest(1, 1, 2));
  ASSERT_TRUE(next0.get().status.ok());
  EXPECT_EQ(next1.info.weight_version(), 2);
}

TEST_F(SyncStepTest, AStepNumberSeenBeforeIsANewStepOnceTheHeadMovedBack) {
  Start();
  AccumulateTwoRanks();
  std::future<Answer> r0 = CallAsync(SyncRequest(0, 0, 2));
  ASSERT_TRUE(Call(SyncRequest(0, 1, 2)).status.ok());
  ASSERT_EQ(r0.get().info.weight_version(), 1);
  // The trainers start over on a new head of the same id (as after a restore of an earlier
  // state, or a re-upload): step 0 again is a new step, not a retry of the old one.
  ASSERT_TRUE(Drop("lm").ok());
  v1::CreateHeadRequest create;
  create.set_head_id("lm");
  create.mutable_init()->set_vocab_size(kVocab);
  create.mutable_init()->set_hidden_size(kHidden);
  create.mutable_init()->set_bias(true);
  create.mutable_init()->set_seed(9);
  grpc::ClientContext context;
  v1::HeadInfo created;
  ASSERT_TRUE(stub_->CreateHead(&context, create, &created).ok());
  entry_ = *registry().Get("lm");
  AccumulateTwoRanks();
  const torch::Tensor w = Weight();
  const torch::Tensor dw = HeadWeightGrad();
  std::future<Answer> again0 = CallAsync(SyncRequest(0, 0, 2));
  EXPECT_EQ(again0.wait_for(300ms), std::future_status::timeout);  // waits for rank 1
  const Answer again1 = Call(SyncRequest(0, 1, 2));
  ASSERT_TRUE(again1.status.ok()) << again1.status.error_message();
  EXPECT_EQ(again0.get().info.weight_version(), 1);
  EXPECT_TRUE(torch::allclose(Weight(), w - 0.1 * dw / 2, 1e-6, 1e-7));
  EXPECT_EQ(MicroBatches(), 0);
}

TEST_F(SyncStepTest, AMissingRankAbortsEveryWaitingRankNamingItAndNothingIsApplied) {
  Start(/*timeout_seconds=*/0.5);
  AccumulateTwoRanks();
  const torch::Tensor w = Weight();
  const torch::Tensor dw = HeadWeightGrad();
  const auto start = std::chrono::steady_clock::now();
  std::future<Answer> first = CallAsync(SyncRequest(0, 0, 3));
  const Answer second = Call(SyncRequest(0, 2, 3));
  const Answer aborted = first.get();
  const auto waited = std::chrono::steady_clock::now() - start;
  for (const Answer& a : {aborted, second}) {
    EXPECT_EQ(a.status.error_code(), grpc::StatusCode::ABORTED);
    EXPECT_TRUE(absl::StrContains(a.status.error_message(), "missing ranks [1]"))
        << a.status.error_message();
    EXPECT_TRUE(absl::StrContains(a.status.error_message(), "got ranks [0, 2]"))
        << a.status.error_message();
  }
  EXPECT_GE(waited, 450ms);
  EXPECT_LT(waited, 5s);
  EXPECT_EQ(Version(), 0);
  EXPECT_TRUE(torch::equal(Weight(), w));
  EXPECT_EQ(MicroBatches(), 2);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), dw));

  // Once every rank runs, the same step goes through.
  std::future<Answer> r0 = CallAsync(SyncRequest(0, 0, 3));
  std::future<Answer> r1 = CallAsync(SyncRequest(0, 1, 3));
  const Answer r2 = Call(SyncRequest(0, 2, 3));
  ASSERT_TRUE(r0.get().status.ok());
  ASSERT_TRUE(r1.get().status.ok());
  ASSERT_TRUE(r2.status.ok()) << r2.status.error_message();
  EXPECT_EQ(r2.info.weight_version(), 1);
  EXPECT_TRUE(torch::allclose(Weight(), w - 0.1 * dw / 3, 1e-6, 1e-7));
}

TEST_F(SyncStepTest, RanksThatDisagreeAreAllRefusedNamingTheFieldAndBothValues) {
  Start();
  AccumulateTwoRanks();
  const torch::Tensor w = Weight();
  struct Case {
    std::string field;
    std::function<void(v1::OptimizerStepRequest&)> change;
    std::string rank0_value, rank1_value;
  };
  const std::vector<Case> cases = {
      {"sgd.lr", [](auto& r) { r.mutable_sgd()->set_lr(0.2); }, "0.1", "0.2"},
      {"grad_scale", [](auto& r) { r.set_grad_scale(0.5); }, "1", "0.5"},
      {"sgd.momentum", [](auto& r) { r.mutable_sgd()->set_momentum(0.9); }, "0", "0.9"},
      {"zero_gradients", [](auto& r) { r.set_zero_gradients(false); }, "true", "false"},
      {"expected_weight_version", [](auto& r) { r.set_expected_weight_version(3); }, "unset",
       "3"},
      {"optimizer", [](auto& r) { r.mutable_adamw()->set_lr(0.1); }, "sgd", "adamw"},
      {"synchronous.step", [](auto& r) { r.mutable_synchronous()->set_step(1); }, "step 0",
       "step 1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    std::future<Answer> rank0 = CallAsync(SyncRequest(0, 0, 2));
    std::this_thread::sleep_for(100ms);  // rank 0 waits first
    v1::OptimizerStepRequest request = SyncRequest(0, 1, 2);
    c.change(request);
    const Answer rank1 = Call(request);
    const Answer waited = rank0.get();
    for (const Answer& a : {waited, rank1}) {
      EXPECT_EQ(a.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      const std::string& m = a.status.error_message();
      EXPECT_TRUE(absl::StartsWith(m, c.field + ":")) << m;
      EXPECT_TRUE(absl::StrContains(m, "rank 0 asked for " + c.rank0_value) ||
                  absl::StrContains(m, "rank 0 waits at " + c.rank0_value))
          << m;
      EXPECT_TRUE(absl::StrContains(m, c.rank1_value)) << m;
      EXPECT_TRUE(absl::StrContains(m, "nothing applied")) << m;
    }
    EXPECT_EQ(Version(), 0);
    EXPECT_TRUE(torch::equal(Weight(), w));
    EXPECT_EQ(MicroBatches(), 2);
  }
}

TEST_F(SyncStepTest, BadRanksStepsAndVersionsAreRefusedAtOnce) {
  Start();
  AccumulateTwoRanks();
  struct Case {
    v1::OptimizerStepRequest request;
    grpc::StatusCode code;
    std::string message;
  };
  v1::OptimizerStepRequest stale = SyncRequest(0, 0, 1);
  stale.set_expected_weight_version(4);
  v1::OptimizerStepRequest restarted = SyncRequest(0, 0, 2);
  restarted.set_expected_incarnation("an-earlier-process");
  const std::vector<Case> cases = {
      {SyncRequest(0, 2, 2), grpc::StatusCode::INVALID_ARGUMENT,
       "synchronous.rank: expected in [0, 2); got 2"},
      {SyncRequest(0, -1, 2), grpc::StatusCode::INVALID_ARGUMENT,
       "synchronous.rank: expected in [0, 2); got -1"},
      {SyncRequest(0, 0, 0), grpc::StatusCode::INVALID_ARGUMENT,
       "synchronous.world_size: expected >= 1; got 0"},
      {SyncRequest(-3, 0, 2), grpc::StatusCode::INVALID_ARGUMENT,
       "synchronous.step: expected >= 0; got -3"},
      {stale, grpc::StatusCode::FAILED_PRECONDITION,
       "expected_weight_version: expected the head's current version 0; got 4"},
      {restarted, grpc::StatusCode::FAILED_PRECONDITION, "expected_incarnation: expected the "
                                                         "server process \"an-earlier-process\""},
  };
  for (const Case& c : cases) {
    const auto start = std::chrono::steady_clock::now();
    const Answer a = Call(c.request);
    EXPECT_EQ(a.status.error_code(), c.code) << a.status.error_message();
    EXPECT_TRUE(absl::StartsWith(a.status.error_message(), c.message)) << a.status.error_message();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);  // no wait for other ranks
  }
  EXPECT_EQ(Version(), 0);
  EXPECT_EQ(MicroBatches(), 2);
  // A world of one is a step of its own (what a trainer run by torchrun with one process does).
  const Answer alone = Call(SyncRequest(0, 0, 1));
  ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
  EXPECT_EQ(alone.info.weight_version(), 1);
}

TEST_F(SyncStepTest, ASingleCallerStepPinnedToAnotherVersionIsRefused) {
  Start();
  AccumulateTwoRanks();
  const torch::Tensor w = Weight();
  v1::OptimizerStepRequest request = SyncRequest(0, 0, 1);
  request.clear_synchronous();
  request.set_expected_weight_version(1);
  const Answer a = Call(request);
  EXPECT_EQ(a.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StartsWith(a.status.error_message(),
                               "expected_weight_version: expected the head's current version 0; "
                               "got 1"))
      << a.status.error_message();
  EXPECT_TRUE(torch::equal(Weight(), w));
  EXPECT_EQ(MicroBatches(), 2);
  request.set_expected_weight_version(0);
  ASSERT_TRUE(Call(request).status.ok());
  EXPECT_EQ(Version(), 1);
}

TEST_F(SyncStepTest, ADrainAnswersTheWaitingRanksAtOnceWithNothingApplied) {
  Start();
  AccumulateTwoRanks();
  std::future<Answer> waiting = CallAsync(SyncRequest(0, 0, 2));
  std::this_thread::sleep_for(200ms);
  server_->service().Drain();
  ASSERT_EQ(waiting.wait_for(5s), std::future_status::ready);
  const Answer a = waiting.get();
  EXPECT_EQ(a.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(a.status.error_message(), "draining")) << a.status.error_message();
  EXPECT_EQ(Version(), 0);
  EXPECT_EQ(MicroBatches(), 2);
}

}  // namespace
}  // namespace remotehead
