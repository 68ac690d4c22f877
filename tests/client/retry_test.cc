// The client's retries: a call that meets UNAVAILABLE (no server yet, a connection lost in the
// middle of a stream, a lost answer) is retried as a whole with the same gradient identity, and
// the server's exactly-once ledger makes the accumulated dW come out as if it had been sent once.
// Any other code is returned at the first attempt.
#include <google/protobuf/descriptor.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/reference.h"
#include "remotehead/client/client.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/optimizer.h"
#include "remotehead/server/rpc/head_service.h"
#include "support/child_process.h"
#include "support/head_access.h"

namespace remotehead {
namespace {

namespace rc = client;
using std::chrono::milliseconds;

constexpr int64_t kVocab = 200;
constexpr int64_t kHidden = 16;
constexpr int64_t kRows = 40;

// A ForwardBackward that reads the header and the first rows, sends a garbage dX chunk and
// then fails with UNAVAILABLE, as a connection lost mid-stream looks to the client. Raw, as the
// server serves the step methods (server::HeadService::Step).
class BrokenStepReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  BrokenStepReactor() { StartRead(&request_); }
  void OnReadDone(bool ok) override {
    if (ok && ++messages_ < 2) {
      StartRead(&request_);
      return;
    }
    v1::StepResponse response;
    v1::TensorChunk* chunk = response.mutable_grad_hidden();
    const std::vector<float> garbage(kHidden, 1e9f);
    chunk->mutable_values()->set_dtype(v1::DTYPE_FLOAT32);
    chunk->mutable_values()->add_shape(1);
    chunk->mutable_values()->add_shape(kHidden);
    chunk->mutable_values()->set_data(garbage.data(), garbage.size() * sizeof(float));
    bool own = false;
    EXPECT_TRUE(
        grpc::SerializationTraits<v1::StepResponse>::Serialize(response, &response_, &own).ok());
    StartWriteAndFinish(&response_, {},
                        grpc::Status(grpc::StatusCode::UNAVAILABLE, "injected: connection lost"));
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  int messages_ = 0;
};

// The real service, with faults injected into the first calls of some RPCs.
class FlakyService final : public v1::HeadService::CallbackService {
 public:
  FlakyService(server::HeadService* real, server::HeadRegistry* registry)
      : real_(real), registry_(registry) {
    // ForwardBackward raw, as the real service serves it.
    const int index = google::protobuf::DescriptorPool::generated_pool()
                          ->FindServiceByName(v1::HeadService::service_full_name())
                          ->FindMethodByName("ForwardBackward")
                          ->index();
    MarkMethodRawCallback(
        index, new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                   [this](grpc::CallbackServerContext* context) { return Step(context); }));
  }

  std::atomic<int> broken_steps{0};          // ForwardBackward calls that break mid-stream
  std::atomic<int> lost_optimizer_steps{0};  // OptimizerSteps applied whose answer is lost

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Step(
      grpc::CallbackServerContext* context) {
    if (broken_steps.fetch_sub(1) > 0) return new BrokenStepReactor();
    return real_->Step(context, core::CallMode::kFused);
  }
  grpc::ServerUnaryReactor* OptimizerStep(grpc::CallbackServerContext* context,
                                          const v1::OptimizerStepRequest* request,
                                          v1::OptimizerStepResponse* response) override {
    if (lost_optimizer_steps.fetch_sub(1) <= 0) {
      return real_->service().OptimizerStep(context, request, response);
    }
    // Applied on the server, then the connection drops before the answer reaches the client.
    auto entry = *registry_->Get(request->head_id());
    EXPECT_TRUE(entry
                    ->OptimizerStep(
                        [&](core::Head& head, core::OptimizerState& state) {
                          return core::SgdStep(head, {.lr = request->sgd().lr()}, 1.0, &state);
                        },
                        /*zero_gradients=*/false)
                    .ok());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "injected: answer lost"));
    return reactor;
  }
  grpc::ServerUnaryReactor* DescribeHead(grpc::CallbackServerContext* context,
                                         const v1::HeadRef* request,
                                         v1::HeadInfo* response) override {
    return real_->service().DescribeHead(context, request, response);
  }

 private:
  server::HeadService* real_;
  server::HeadRegistry* registry_;
};

class RetryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto head = core::Head::Initialize(
        {.vocab_size = kVocab, .hidden_size = kHidden, .bias = true, .seed = 3, .init_std = 0.25},
        {});
    ASSERT_TRUE(head.ok());
    entry_ = *registry_.Add("lm", *std::move(head));
    batch_ = reference::MakeTestBatch(testing::HeadOf(*entry_), kRows, "cross_entropy",
                                      core::Reduction::kMean);
    service_ = server::HeadService::Create(&registry_,
                                           server::ServiceOptions{.response_chunk_bytes = 512});
    flaky_ = std::make_unique<FlakyService>(service_.get(), &registry_);
    port_ = testing::FreePort();
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
    flaky_.reset();
    service_.reset();
  }

  void StartServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port_), grpc::InsecureServerCredentials());
    builder.RegisterService(flaky_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }

  // A client whose retries are counted; small backoffs keep the test fast.
  std::shared_ptr<rc::Client> MakeClient(int max_attempts,
                                         std::optional<milliseconds> deadline = {}) {
    return *rc::Client::Create(
        {.target = absl::StrCat("127.0.0.1:", port_),
         .retry = {.max_attempts = max_attempts, .initial_backoff = milliseconds(50)},
         .deadline = deadline,
         .chunk_bytes = 1024,  // several rows messages per call
         .on_retry = [this](const rc::RetryEvent& e) {
           EXPECT_EQ(e.status.code(), absl::StatusCode::kUnavailable);
           retry_events_.push_back(e);
         }});
  }

  // compact_rows off: a step is its own RPC alone (no ListFunctions first), whose attempts and
  // retries the tests count.
  rc::StepSpec Spec() const {
    return {.head_id = "lm",
            .gradient_id = rc::GradientId{.trainer = "run/rank-0", .step = 7},
            .compact_rows = false};
  }
  rc::StepInputs Inputs() const { return {.hidden = batch_.hidden, .targets = batch_.targets}; }

  torch::Tensor HeadWeightGrad() { return testing::HeadOf(*entry_).grads().weight.clone(); }

  server::HeadRegistry registry_;
  std::shared_ptr<server::HeadEntry> entry_;
  core::TokenBatch batch_;
  std::unique_ptr<server::HeadService> service_;
  std::unique_ptr<FlakyService> flaky_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::vector<rc::RetryEvent> retry_events_;
};

TEST_F(RetryTest, ServerThatStartsLateIsReachedByRetriesAndDwIsAddedOnce) {
  core::GradientBuffers once = testing::HeadOf(*entry_).NewGradientBuffers();
  auto direct = core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, &once);
  ASSERT_TRUE(direct.ok());

  auto client = MakeClient(/*max_attempts=*/10);
  std::thread starter([this] {
    std::this_thread::sleep_for(milliseconds(300));
    StartServer();
  });
  auto r = client->ForwardBackward(Spec(), Inputs());
  starter.join();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(client->stats().retries, 1);
  EXPECT_EQ(client->stats().retries, static_cast<int64_t>(retry_events_.size()));
  EXPECT_EQ(client->stats().attempts, client->stats().retries + 1);
  EXPECT_FALSE(r->summary.replayed);
  EXPECT_LE(reference::RelativeError(r->loss, direct->loss), 1e-6);
  EXPECT_LE(reference::RelativeError(r->grad_hidden, direct->grad_hidden), 1e-5);
  const torch::Tensor dw = HeadWeightGrad();
  EXPECT_LE(reference::RelativeError(dw, once.weight), 1e-5);
  EXPECT_EQ(entry_->Describe().accumulated_micro_batches, 1);

  // The same identity again (as a retry after a lost answer would send it): the answer is
  // recomputed, nothing is added.
  auto replay = client->ForwardBackward(Spec(), Inputs());
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->summary.replayed);
  EXPECT_LE(reference::RelativeError(replay->loss, r->loss), 1e-6);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), dw));
}

TEST_F(RetryTest, StreamBrokenMidwayIsRetriedWholeAndItsPartialDxDiscarded) {
  StartServer();
  flaky_->broken_steps = 1;
  core::GradientBuffers once = testing::HeadOf(*entry_).NewGradientBuffers();
  auto direct = core::FusedForwardBackward(testing::HeadOf(*entry_), batch_, {}, &once);
  ASSERT_TRUE(direct.ok());

  auto client = MakeClient(5);
  auto r = client->ForwardBackward(Spec(), Inputs());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(retry_events_.size(), 1u);
  EXPECT_EQ(retry_events_[0].rpc, "ForwardBackward");
  EXPECT_EQ(retry_events_[0].failed_attempt, 1);
  EXPECT_EQ(retry_events_[0].status.message(), "injected: connection lost");
  EXPECT_LE(reference::RelativeError(r->grad_hidden, direct->grad_hidden), 1e-5)
      << "the broken attempt's garbage row 0 must not survive";
  EXPECT_LE(reference::RelativeError(HeadWeightGrad(), once.weight), 1e-5);
}

TEST_F(RetryTest, OptimizerStepWhoseAnswerWasLostIsNotAppliedTwice) {
  StartServer();
  flaky_->lost_optimizer_steps = 1;
  torch::Tensor w0, dw;
  {
    testing::HeadOf(*entry_).grads().weight.normal_();
    w0 = testing::HeadOf(*entry_).weight().clone();
    dw = testing::HeadOf(*entry_).grads().weight.clone();
  }
  auto client = MakeClient(5);
  auto info = client->OptimizerStep("lm", {.optimizer = rc::Sgd{.lr = 0.1}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(retry_events_.size(), 1u);
  EXPECT_EQ(info->weight_version, 1);
  EXPECT_EQ(testing::HeadOf(*entry_).version(), 1);
  // Once: w0 − lr·dw up to fp32 rounding (an ulp of |w| ~ 1e-7); twice would be off by
  // lr·|dw| ~ 0.1.
  EXPECT_LE(reference::RelativeError(testing::HeadOf(*entry_).weight(), w0 - 0.1 * dw), 1e-6);
}

TEST_F(RetryTest, OtherCodesAreReturnedAtTheFirstAttempt) {
  StartServer();
  auto client = MakeClient(5);
  rc::StepSpec unknown = Spec();
  unknown.head_id = "nope";
  const auto not_found = client->ForwardBackward(unknown, Inputs());
  EXPECT_EQ(not_found.status().code(), absl::StatusCode::kNotFound);
  rc::StepInputs bad = Inputs();
  bad.targets = batch_.targets.clone();
  bad.targets[0] = kVocab;
  const auto invalid = client->ForwardBackward(Spec(), bad);
  EXPECT_EQ(invalid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->stats().calls, 2);
  EXPECT_EQ(client->stats().attempts, 2);
  EXPECT_EQ(client->stats().retries, 0);
  EXPECT_TRUE(retry_events_.empty());
}

TEST_F(RetryTest, GivesUpAfterMaxAttemptsWithBackoffGrowing) {
  auto client = MakeClient(4);
  const auto start = std::chrono::steady_clock::now();
  const auto r = client->DescribeHead("lm");
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("(DescribeHead: gave up after 4 attempts)"),
            std::string::npos)
      << r.status();
  EXPECT_EQ(client->stats().attempts, 4);
  ASSERT_EQ(retry_events_.size(), 3u);
  // 50, 100, 200 ms, each within ±10% jitter.
  const double expected_ms[] = {50, 100, 200};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(retry_events_[i].failed_attempt, i + 1);
    EXPECT_NEAR(static_cast<double>(retry_events_[i].backoff.count()), expected_ms[i],
                0.1 * expected_ms[i] + 1);
  }
  EXPECT_GE(elapsed, milliseconds(300));
}

TEST_F(RetryTest, DeadlineBoundsAllAttempts) {
  auto client = MakeClient(100, milliseconds(400));
  const auto start = std::chrono::steady_clock::now();
  const auto r = client->ForwardBackward(Spec(), Inputs());
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  // The client stops before a wait would cross the deadline (slack for a loaded machine).
  EXPECT_LT(elapsed, milliseconds(500));
  EXPECT_LT(client->stats().attempts, 10);
}

}  // namespace
}  // namespace remotehead
