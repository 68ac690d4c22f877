// The C++ client as the ranks of data-parallel trainers (OptimizerStepOptions::synchronous,
// RemoteHead's DataParallel): two ranks, each with its own Client, add their own micro-batches
// and step together; the step is applied once, every rank gets the same HeadInfo, and the
// weights are those of one single-caller step on the summed dW with grad_scale 1/2 (DDP's
// average). A synchronous step whose answer was lost is retried and answered without stepping
// twice; a bad rank is refused; and the example trainer runs as two ranks against the real
// server binary.
#include <torch/nn/functional.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/reference.h"
#include "remotehead/client/remote_head.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "support/child_process.h"
#include "support/in_process_server.h"

namespace remotehead {
namespace {

namespace rc = client;
namespace F = torch::nn::functional;
using namespace std::chrono_literals;

constexpr int64_t kVocab = 61;
constexpr int64_t kHidden = 10;
constexpr int64_t kRows = 24;  // tokens of one rank's micro-batch
constexpr double kLr = 0.1;

// Serves OptimizerStep only, by forwarding it to the real server; the first `lost_answers`
// answers are replaced by UNAVAILABLE once the real call returned, as a connection lost on the
// way back looks to the client. Every other RPC is UNIMPLEMENTED, so a client that asked
// DescribeHead before a synchronous step (as it does before a single caller's) would fail.
class AnswerLosingProxy final : public v1::HeadService::CallbackService {
 public:
  explicit AnswerLosingProxy(const std::string& target)
      : stub_(v1::HeadService::NewStub(
            grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  // The forwarding threads finish their calls before the proxy stops serving.
  ~AnswerLosingProxy() override {
    std::vector<std::thread> forwards;
    {
      std::lock_guard<std::mutex> lock(mu_);
      forwards.swap(forwards_);
    }
    for (std::thread& t : forwards) t.join();
    if (server_ != nullptr) server_->Shutdown();
  }

  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

  std::atomic<int> lost_answers{0};
  std::atomic<int> calls{0};

  grpc::ServerUnaryReactor* OptimizerStep(grpc::CallbackServerContext* context,
                                          const v1::OptimizerStepRequest* request,
                                          v1::OptimizerStepResponse* response) override {
    ++calls;
    const bool lose = lost_answers.fetch_sub(1) > 0;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    // A synchronous step blocks until every rank came: not on the callback thread.
    std::lock_guard<std::mutex> lock(mu_);
    forwards_.emplace_back([this, reactor, request = *request, response, lose] {
      grpc::ClientContext forward;
      forward.set_deadline(std::chrono::system_clock::now() + 60s);
      grpc::Status status = stub_->OptimizerStep(&forward, request, response);
      if (lose && status.ok()) {
        status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "injected: answer lost");
      }
      reactor->Finish(status);
    });
    return reactor;
  }

 private:
  std::unique_ptr<v1::HeadService::Stub> stub_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::mutex mu_;
  std::vector<std::thread> forwards_;
};

class SyncStepClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.started());
    torch::manual_seed(5);
    weight_ = torch::randn({kVocab, kHidden}) * 0.3;
    for (int r = 0; r < 2; ++r) {
      hidden_[r] = torch::randn({kRows, kHidden});
      labels_[r] = torch::randint(kVocab, {kRows}, torch::kLong);
    }
    client_ = NewClient(server_.target());
    ASSERT_TRUE(client_->UploadHead("lm", weight_).ok());
    ASSERT_TRUE(client_->UploadHead("ref", weight_).ok());
  }

  std::shared_ptr<rc::Client> NewClient(const std::string& target) {
    auto client = rc::Client::Create({.target = target,
                                      .retry = {.max_attempts = 5, .initial_backoff = 20ms},
                                      .on_retry = [this](const rc::RetryEvent& e) {
                                        std::lock_guard<std::mutex> lock(retries_mu_);
                                        retry_events_.push_back(e);
                                      }});
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  // Rank `rank` of 2, with its own Client, as a trainer named "run".
  rc::RemoteHead Rank(int rank) {
    auto head = rc::RemoteHead::Attach(NewClient(server_.target()),
                                       {.head_id = "lm", .gradient_id = rc::GradientId{"run"}},
                                       {.rank = rank, .world_size = 2});
    EXPECT_TRUE(head.ok()) << head.status();
    return *std::move(head);
  }

  // Rank r's micro-batch (mean cross-entropy over its tokens): backward adds dW_r on the server.
  static void AddMicroBatch(rc::RemoteHead& head, const torch::Tensor& hidden,
                            const torch::Tensor& labels) {
    const torch::Tensor x = hidden.clone().requires_grad_();
    head.loss(x, labels).backward();
  }

  // The same two micro-batches added to "ref" by one caller (two gradient identities).
  void AddBothToReference(int64_t step) {
    for (int r = 0; r < 2; ++r) {
      const auto added = client_->ForwardBackward(
          {.head_id = "ref", .gradient_id = rc::GradientId{absl::StrCat("ref/rank-", r), step, 0}},
          {.hidden = hidden_[r], .targets = labels_[r]});
      ASSERT_TRUE(added.ok()) << added.status();
    }
  }

  // dW of rank r's mean cross-entropy at weights w, on the full logits (float64).
  torch::Tensor LocalWeightGrad(const torch::Tensor& w, int r) const {
    torch::Tensor w64 = w.to(torch::kDouble).requires_grad_();
    torch::AutoGradMode enable(true);
    F::cross_entropy(F::linear(hidden_[r].to(torch::kDouble), w64), labels_[r]).backward();
    return w64.grad();
  }

  torch::Tensor Weights(const std::string& id) {
    auto exported = client_->ExportWeights(id);
    EXPECT_TRUE(exported.ok()) << exported.status();
    return exported.ok() ? exported->weight : torch::Tensor();
  }

  testing::InProcessServer server_{{.sync_step_timeout_seconds = 30}};
  std::shared_ptr<rc::Client> client_;
  torch::Tensor weight_, hidden_[2], labels_[2];
  std::mutex retries_mu_;
  std::vector<rc::RetryEvent> retry_events_;
};

TEST_F(SyncStepClientTest, TwoRanksStepOnceTogetherAsOneStepOnTheAveragedGradient) {
  rc::RemoteHead ranks[2] = {Rank(0), Rank(1)};
  EXPECT_EQ(ranks[0].trainer(), "run/rank-0");
  EXPECT_EQ(ranks[1].trainer(), "run/rank-1");
  // Two steps with momentum (the second one's update carries the first's gradient), the second
  // pinned to the version the first left.
  const rc::OptimizerStepOptions options{.optimizer = rc::Sgd{.lr = kLr, .momentum = 0.9},
                                         .zero_gradients = true};
  for (int64_t s = 0; s < 2; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s));
    const torch::Tensor before = Weights("lm");
    for (int r = 0; r < 2; ++r) AddMicroBatch(ranks[r], hidden_[r], labels_[r]);
    AddBothToReference(s);

    std::future<absl::StatusOr<rc::HeadInfo>> rank0 =
        std::async(std::launch::async, [&] { return ranks[0].OptimizerStep(options); });
    // Rank 0 is held until rank 1 asks; nothing is applied before.
    EXPECT_EQ(rank0.wait_for(200ms), std::future_status::timeout);
    EXPECT_TRUE(torch::equal(Weights("lm"), before));
    const absl::StatusOr<rc::HeadInfo> rank1 = ranks[1].OptimizerStep(options);
    const absl::StatusOr<rc::HeadInfo> first = rank0.get();
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE(rank1.ok()) << rank1.status();
    EXPECT_EQ(first->weight_version, s + 1);
    EXPECT_EQ(rank1->weight_version, s + 1);
    EXPECT_EQ(first->accumulated_micro_batches, 0);  // zero_gradients
    EXPECT_EQ(rank1->accumulated_micro_batches, 0);
    EXPECT_EQ(first->incarnation, rank1->incarnation);
    for (const rc::RemoteHead& head : ranks) {
      EXPECT_EQ(head.info().weight_version, s + 1);  // the version the next step is pinned to
      EXPECT_EQ(head.step(), s + 1);
    }

    // One caller's step on the same summed dW, scaled by 1/2 as DDP averages two ranks.
    rc::OptimizerStepOptions single = options;
    single.grad_scale = 0.5;
    const auto reference = client_->OptimizerStep("ref", single);
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_LE(reference::RelativeError(Weights("lm"), Weights("ref")), 1e-6);
    if (s == 0) {
      // And autograd's: W − lr · (dW_0 + dW_1) / 2 (momentum's first step is plain SGD).
      const torch::Tensor grad = LocalWeightGrad(weight_, 0) + LocalWeightGrad(weight_, 1);
      EXPECT_LE(reference::RelativeError(Weights("lm").to(torch::kDouble),
                                         weight_.to(torch::kDouble) - kLr * 0.5 * grad),
                1e-6);
    }
  }
  EXPECT_TRUE(retry_events_.empty());
}

TEST_F(SyncStepClientTest, ASynchronousStepWhoseAnswerWasLostIsRetriedAndAnsweredOnce) {
  AnswerLosingProxy proxy(server_.target());
  proxy.lost_answers = 1;
  AddBothToReference(0);
  ASSERT_TRUE(
      client_->OptimizerStep("ref", {.optimizer = rc::Sgd{.lr = kLr}, .grad_scale = 0.5}).ok());
  // Each rank adds its own micro-batch to "lm"; rank 1 steps through the proxy.
  std::shared_ptr<rc::Client> direct = NewClient(server_.target());
  std::shared_ptr<rc::Client> via_proxy = NewClient(proxy.target());
  for (int r = 0; r < 2; ++r) {
    const auto added = direct->ForwardBackward(
        {.head_id = "lm", .gradient_id = rc::GradientId{absl::StrCat("run/rank-", r), 0, 0}},
        {.hidden = hidden_[r], .targets = labels_[r]});
    ASSERT_TRUE(added.ok()) << added.status();
  }
  const auto step = [](int rank) {
    return rc::OptimizerStepOptions{
        .optimizer = rc::Sgd{.lr = kLr},
        .expected_weight_version = 0,
        .synchronous = rc::SynchronousStep{.step = 0, .rank = rank, .world_size = 2}};
  };
  std::future<absl::StatusOr<rc::HeadInfo>> rank1 =
      std::async(std::launch::async, [&] { return via_proxy->OptimizerStep("lm", step(1)); });
  std::this_thread::sleep_for(100ms);  // rank 1 waits at the server first
  const absl::StatusOr<rc::HeadInfo> rank0 = direct->OptimizerStep("lm", step(0));
  const absl::StatusOr<rc::HeadInfo> answered = rank1.get();
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(rank0->weight_version, 1);
  // The retry got the applied step's answer (although the head is no longer at the
  // expected_weight_version 0 it carries), and nothing was applied twice.
  EXPECT_EQ(answered->weight_version, 1);
  EXPECT_EQ(proxy.calls.load(), 2);
  EXPECT_EQ(via_proxy->stats().retries, 1);
  ASSERT_EQ(retry_events_.size(), 1u);
  EXPECT_EQ(retry_events_[0].rpc, "OptimizerStep");
  EXPECT_EQ(retry_events_[0].status.message(), "injected: answer lost");
  EXPECT_LE(reference::RelativeError(Weights("lm"), Weights("ref")), 1e-6);
}

TEST_F(SyncStepClientTest, BadRanksAndStaleVersionsAreRefused) {
  const auto refused = client_->OptimizerStep(
      "lm", {.optimizer = rc::Sgd{.lr = kLr},
             .synchronous = rc::SynchronousStep{.step = 0, .rank = 2, .world_size = 2}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "synchronous.rank")) << refused.status();
  EXPECT_EQ(client_->stats().retries, 0);

  const auto stale =
      client_->OptimizerStep("lm", {.optimizer = rc::Sgd{.lr = kLr}, .expected_weight_version = 3});
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_TRUE(absl::StartsWith(stale.status().message(), "expected_weight_version"))
      << stale.status();
  const auto info = client_->DescribeHead("lm");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->weight_version, 0);

  const auto bad_rank = rc::RemoteHead::Attach(client_, {.head_id = "lm"}, {2, 2});
  EXPECT_EQ(bad_rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad_rank.status().message(), "data_parallel.rank: expected in [0, 2); got 2");
  const auto bad_world = rc::RemoteHead::Attach(client_, {.head_id = "lm"}, {0, 0});
  EXPECT_EQ(bad_world.status().message(), "data_parallel.world_size: expected >= 1; got 0");
  // A single trainer keeps its identity; a rank's already named for its rank is kept as it is.
  const auto single =
      rc::RemoteHead::Attach(client_, {.head_id = "lm", .gradient_id = rc::GradientId{"run"}});
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->trainer(), "run");
  const auto named = rc::RemoteHead::Attach(
      client_, {.head_id = "lm", .gradient_id = rc::GradientId{"run/rank-1"}}, {1, 2});
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->trainer(), "run/rank-1");
}

// The example trainer as two ranks against the real server: both run every step, each step is
// one head version for both, each rank trains on its half of the batch, and rank 0 drops the
// head at the end. Bad --rank / --world are refused naming the flag.
TEST(ExampleTrainer, TwoRanksStepTheHeadTogether) {
  testing::ServerProcess server({REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                                 "--sync_step_timeout_seconds=60"});
  ASSERT_GT(server.port(), 0) << server.log();
  constexpr int kSteps = 8;
  const auto trainer = [&](int rank) {
    // Runs to its end (no line makes it "ready"): each rank on its own thread.
    return std::make_unique<testing::ChildProcess>(
        std::vector<std::string>{REMOTEHEAD_EXAMPLE_TRAINER, "--server=" + server.target(),
                                 absl::StrCat("--steps=", kSteps), "--world=2",
                                 absl::StrCat("--rank=", rank)},
        [](const std::string&) { return false; });
  };
  auto rank0 = std::async(std::launch::async, trainer, 0);
  auto rank1 = std::async(std::launch::async, trainer, 1);
  const std::unique_ptr<testing::ChildProcess> ranks[2] = {rank0.get(), rank1.get()};
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_EQ(ranks[r]->Wait(), 0) << ranks[r]->log();
    std::vector<double> losses;
    for (const std::string& line :
         std::vector<std::string>(absl::StrSplit(ranks[r]->log(), '\n', absl::SkipEmpty()))) {
      long long step = 0, tokens = 0, version = 0;
      double loss = 0;
      if (sscanf(line.c_str(), "step %lld loss %lf tokens %lld head_version %lld", &step, &loss,
                 &tokens, &version) == 4) {
        EXPECT_EQ(step, static_cast<long long>(losses.size()));
        EXPECT_EQ(version, step + 1);   // one head step per global step, whatever the ranks
        EXPECT_EQ(tokens, 2 * 8 * 32);  // its 8 sequences of 32 tokens in each of 2 micro-batches
        losses.push_back(loss);
      }
    }
    ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps)) << ranks[r]->log();
    EXPECT_NEAR(losses.front(), std::log(512.0), 0.05) << ranks[r]->log();
    EXPECT_LT(losses.back(), 0.9 * losses.front()) << ranks[r]->log();  // about 0.74
  }
  auto client = *rc::Client::Create({.target = server.target()});
  auto heads = client->ListHeads();
  ASSERT_TRUE(heads.ok()) << heads.status();
  EXPECT_TRUE(heads->empty());

  for (const auto& [flags, error] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--world=2", "--rank=2"},
            "--rank: INVALID_ARGUMENT: expected in [0, 2) (--world); got 2"},
           {{"--world=0"}, "--world: INVALID_ARGUMENT: expected >= 1; got 0"}}) {
    std::vector<std::string> args = {REMOTEHEAD_EXAMPLE_TRAINER, "--server=" + server.target()};
    args.insert(args.end(), flags.begin(), flags.end());
    testing::ChildProcess bad(args, [](const std::string&) { return false; });
    EXPECT_EQ(bad.Wait(), 1) << bad.log();
    EXPECT_EQ(bad.log(), absl::StrCat("remotehead-example-trainer: ", error, "\n"));
  }
}

}  // namespace
}  // namespace remotehead
