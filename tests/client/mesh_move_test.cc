// A trainer that follows a mesh whose replica it dialled was evicted, through the C++ client:
// in-process servers stand for the replicas' fronts (a plain server serves every trainer rank its
// DescribeHead names), scripted fronts for the mesh's answers (MESH_RECONFIGURING, WRONG_REPLICA,
// a replica down). The same rules as the Python client's (_mesh_fronts.py, Client._call,
// RemoteHead's journal); tests/python/test_mesh_eviction.py runs them against a real mesh.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>

#include "remotehead/client/client.h"
#include "remotehead/client/remote_head.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/server/rpc/status_mapping.h"
#include "support/head_access.h"
#include "support/in_process_server.h"

namespace remotehead {
namespace {

namespace rc = client;
using std::chrono::milliseconds;

constexpr int64_t kVocab = 64;
constexpr int64_t kHidden = 16;
constexpr int64_t kRows = 12;

// A replica's front whose DescribeHead answers `script` first, one status a call, and then as
// `real` does.
class ScriptedFront final : public v1::HeadService::CallbackService {
 public:
  explicit ScriptedFront(server::HeadService* real) : real_(real) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~ScriptedFront() override { server_->Shutdown(); }

  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  void Answer(int times, const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < times; ++i) script_.push_back(status);
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

  grpc::ServerUnaryReactor* DescribeHead(grpc::CallbackServerContext* context,
                                         const v1::HeadRef* request,
                                         v1::HeadInfo* response) override {
    std::optional<absl::Status> scripted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
      if (!script_.empty()) {
        scripted = script_.front();
        script_.pop_front();
      }
    }
    if (!scripted.has_value()) return real_->service().DescribeHead(context, request, response);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(server::ToGrpcStatus(*scripted));
    return reactor;
  }

 private:
  server::HeadService* real_;
  std::mutex mu_;
  std::deque<absl::Status> script_;
  int calls_ = 0;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

absl::Status WrongReplica(int replica) {
  return core::WithReason(absl::InvalidArgumentError("this trainer belongs to another replica"),
                          core::reason::kWrongReplica, {{"replica", std::to_string(replica)}});
}

class MeshMoveTest : public ::testing::Test {
 protected:
  // Replica 0's front (a, the leader), replica 1's (b, which the tests take down) and a server
  // that is no replica (reference): each with head "lm", the same initial weights.
  void SetUp() override {
    for (testing::InProcessServer* s : {a_.get(), b_.get(), reference_.get()}) {
      ASSERT_TRUE(s->started());
      auto client = *rc::Client::Create({.target = s->target()});
      ASSERT_TRUE(
          client
              ->CreateHead(
                  "lm", {.vocab_size = kVocab, .hidden_size = kHidden, .seed = 4, .init_std = 0.3})
              .ok());
    }
  }

  // Trainer 1 of fronts {a, b}: it dials b. Few, short retries: a front that is gone is given up
  // on quickly.
  std::shared_ptr<rc::Client> Trainer(std::vector<std::string> fronts, int rank = 1) {
    return *rc::Client::Create({.fronts = std::move(fronts),
                                .rank = rank,
                                .retry = {.max_attempts = 2,
                                          .initial_backoff = milliseconds(10),
                                          .max_backoff = milliseconds(40)},
                                .reconfigure_timeout = milliseconds(2000)});
  }
  rc::RemoteHead Attach(std::shared_ptr<rc::Client> client, rc::MoveOptions moves = {}) {
    rc::StepSpec spec{.head_id = "lm", .reduction = rc::Reduction::kSum};
    spec.gradient_id = rc::GradientId{.trainer = "t"};
    return *rc::RemoteHead::Attach(std::move(client), spec, {}, moves);
  }
  // Micro-batch `mb`: hidden [kRows, kHidden] requiring grad, and its labels.
  static std::pair<torch::Tensor, torch::Tensor> MicroBatch(int mb) {
    torch::manual_seed(100 + mb);
    return {torch::randn({kRows, kHidden}).requires_grad_(true),
            torch::randint(0, kVocab, {kRows}, torch::kLong)};
  }
  static torch::Tensor WeightGrad(testing::InProcessServer& s) {
    return testing::HeadOf(**s.registry().Get("lm")).grads().weight.clone();
  }
  static int64_t MicroBatches(testing::InProcessServer& s) {
    return (*s.registry().Get("lm"))->Describe().accumulated_micro_batches;
  }

  std::unique_ptr<testing::InProcessServer> a_ =
      std::make_unique<testing::InProcessServer>(server::ServiceOptions{});
  std::unique_ptr<testing::InProcessServer> b_ =
      std::make_unique<testing::InProcessServer>(server::ServiceOptions{});
  std::unique_ptr<testing::InProcessServer> reference_ =
      std::make_unique<testing::InProcessServer>(server::ServiceOptions{});
};

TEST_F(MeshMoveTest, ATrainerWhoseReplicaIsGoneMovesAndReplaysWhatItAddedSinceItsStep) {
  auto client = Trainer({a_->target(), b_->target()});
  EXPECT_EQ(client->replica(), 1);
  rc::RemoteHead head = Attach(client);
  auto [h0, y0] = MicroBatch(0);
  head.loss(h0, y0).backward();
  EXPECT_EQ(MicroBatches(*b_), 1);
  EXPECT_EQ(head.journal_calls(), 1);
  // The host copies of hidden [12, 16] float32 and labels [12] int64.
  EXPECT_EQ(head.journal_bytes(), kRows * kHidden * 4 + kRows * 8);
  b_.reset();  // replica 1 is gone, and micro-batch 0's dW with it

  auto [h1, y1] = MicroBatch(1);
  head.loss(h1, y1).backward();
  EXPECT_EQ(client->replica(), 0);
  EXPECT_EQ(client->target(), a_->target());
  EXPECT_EQ(client->stats().moves, 1);
  EXPECT_EQ(client->stats().replays, 1);
  EXPECT_EQ(MicroBatches(*a_), 2);
  // Replica 0 holds what one server given both micro-batches under the same ids holds.
  rc::RemoteHead alone = Attach(*rc::Client::Create({.target = reference_->target()}));
  for (int mb : {0, 1}) {
    auto [h, y] = MicroBatch(mb);
    alone.loss(h, y).backward();
  }
  EXPECT_TRUE(torch::allclose(WeightGrad(*a_), WeightGrad(*reference_), 1e-6, 1e-7));
  EXPECT_TRUE(h1.grad().defined());

  // The step applies both (at the leader) and empties the journal.
  const auto info = head.OptimizerStep({.optimizer = rc::Sgd{.lr = 0.1}, .zero_gradients = true});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->weight_version, 1);
  EXPECT_EQ(head.journal_calls(), 0);
  EXPECT_EQ(head.journal_bytes(), 0);
}

// The listings every replica answers alike (ListHeads, ListFunctions) are asked of another
// front while the trainer's own is gone; the trainer does not move for them.
TEST_F(MeshMoveTest, ListingsAreAnsweredByAnotherFrontWhileTheTrainersIsGone) {
  auto client = Trainer({a_->target(), b_->target()});
  b_.reset();
  const auto heads = client->ListHeads();
  ASSERT_TRUE(heads.ok()) << heads.status();
  ASSERT_EQ(heads->size(), 1u);
  EXPECT_EQ(heads->front().head_id, "lm");
  const auto functions = client->ListFunctions();
  ASSERT_TRUE(functions.ok()) << functions.status();
  EXPECT_TRUE(std::any_of(functions->begin(), functions->end(),
                          [](const rc::FunctionInfo& f) { return f.name == "cross_entropy"; }));
  EXPECT_EQ(client->replica(), 1);
  EXPECT_EQ(client->stats().moves, 0);
}

TEST_F(MeshMoveTest, WithoutTheJournalTheMoveIsThrownNamingBothReplicasAndTheNewFront) {
  auto client = Trainer({a_->target(), b_->target()});
  rc::RemoteHead head = Attach(client, {.journal = false});
  auto [h0, y0] = MicroBatch(0);
  head.loss(h0, y0).backward();
  EXPECT_EQ(head.journal_calls(), 0);
  b_.reset();
  auto [h1, y1] = MicroBatch(1);
  try {
    head.loss(h1, y1);
    FAIL() << "expected REPLICA_MOVED";
  } catch (const rc::StatusError& e) {
    EXPECT_EQ(e.status().code(), absl::StatusCode::kUnavailable);
    const core::ErrorReason why = core::ReasonOf(e.status());
    EXPECT_EQ(why.reason, rc::reason::kReplicaMoved);
    EXPECT_EQ(why.metadata.at("from_replica"), "1");
    EXPECT_EQ(why.metadata.at("to_replica"), "0");
    const auto at_a = (*rc::Client::Create({.target = a_->target()}))->DescribeHead("lm");
    EXPECT_EQ(why.metadata.at("incarnation"), at_a->incarnation);
    EXPECT_EQ(why.metadata.at("weight_version"), "0");
  }
  EXPECT_EQ(client->replica(), 0);
  EXPECT_EQ(client->stats().moves, 1);
  EXPECT_EQ(client->stats().replays, 0);
  EXPECT_EQ(MicroBatches(*a_), 0);
  // The next call goes to the new front, pinned to its process.
  head.loss(h1, y1).backward();
  EXPECT_EQ(MicroBatches(*a_), 1);
}

TEST_F(MeshMoveTest, ANewFrontPastTheTrainersVersionMeansItsStepWasApplied) {
  auto client = Trainer({a_->target(), b_->target()});
  rc::RemoteHead head = Attach(client);
  auto [h0, y0] = MicroBatch(0);
  head.loss(h0, y0).backward();
  // Replica 0 applied the step (with this trainer's dW, as a mesh would have) before 1 was lost.
  auto leader = *rc::Client::Create({.target = a_->target()});
  ASSERT_TRUE(leader->OptimizerStep("lm", {.optimizer = rc::Sgd{.lr = 0.1}}).ok());
  b_.reset();
  auto [h1, y1] = MicroBatch(1);
  head.loss(h1, y1).backward();
  EXPECT_EQ(client->stats().moves, 1);
  EXPECT_EQ(client->stats().replays, 0);  // nothing resent
  EXPECT_EQ(MicroBatches(*a_), 1);        // the call asked again only
  EXPECT_EQ(head.journal_calls(), 1);
}

TEST_F(MeshMoveTest, AMeshChangingEpochsIsWaitedOutWithoutCountingAttempts) {
  ScriptedFront front(&a_->service());
  const absl::Status reconfiguring =
      core::WithReason(absl::UnavailableError("the mesh changes epochs"),
                       core::reason::kMeshReconfiguring, {{"epoch", "1"}, {"evicted", "1"}});
  front.Answer(4, reconfiguring);
  rc::ClientOptions options{.target = front.target(),
                            .retry = {.max_attempts = 2, .initial_backoff = milliseconds(10)}};
  auto patient = *rc::Client::Create(options);
  ASSERT_TRUE(patient->DescribeHead("lm").ok());
  EXPECT_EQ(patient->stats().attempts, 5);

  // Past reconfigure_timeout the attempts count again; the reason survives the giving up.
  front.Answer(4, reconfiguring);
  options.reconfigure_timeout = milliseconds(0);
  auto impatient = *rc::Client::Create(options);
  const auto described = impatient->DescribeHead("lm");
  EXPECT_EQ(described.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(core::ReasonOf(described.status()).reason, core::reason::kMeshReconfiguring);
  EXPECT_EQ(impatient->stats().attempts, 2);
}

TEST_F(MeshMoveTest, AFrontNamingTheReplicaThatServesTheTrainerIsFollowedThere) {
  // Fronts: 0 = a; 1 = gone (this trainer's); 2 names replica 0; 3 is never asked.
  ScriptedFront names_zero(&a_->service()), skipped(&a_->service());
  names_zero.Answer(10, WrongReplica(0));
  skipped.Answer(10, WrongReplica(0));
  const std::string gone = b_->target();
  b_.reset();
  auto client = Trainer({a_->target(), gone, names_zero.target(), skipped.target()});
  const auto moved = client->DescribeHead("lm");
  EXPECT_EQ(core::ReasonOf(moved.status()).reason, rc::reason::kReplicaMoved) << moved.status();
  EXPECT_EQ(names_zero.calls(), 1);
  EXPECT_EQ(skipped.calls(), 0);
  EXPECT_EQ(client->replica(), 0);
  EXPECT_TRUE(client->DescribeHead("lm").ok());
}

TEST_F(MeshMoveTest, AFrontThatStillServesTheTrainerIsAskedAgainWithoutAMove) {
  ScriptedFront leader(&a_->service()), own(&a_->service());
  leader.Answer(10, WrongReplica(1));  // replica 0 says: replica 1 serves trainer 1
  own.Answer(1, core::WithReason(absl::UnavailableError("a rank of the group is down"),
                                 core::reason::kGroupUnavailable));
  auto client = *rc::Client::Create(
      {.fronts = {leader.target(), own.target()}, .rank = 1, .retry = {.max_attempts = 1}});
  ASSERT_TRUE(client->DescribeHead("lm").ok());
  EXPECT_EQ(client->replica(), 1);
  EXPECT_EQ(client->stats().moves, 0);
  EXPECT_EQ(leader.calls(), 1);
  EXPECT_EQ(own.calls(), 3);  // the call, the probe, the call again
  EXPECT_EQ(client->stats().calls, 1);
  EXPECT_EQ(client->stats().attempts, 2);
}

TEST_F(MeshMoveTest, AMeshThatIsDownIsNotFollowedButAnEvictedReplicaIs) {
  // Replica 1's front says the mesh is down (not evicted): the call's own failure, at once.
  ScriptedFront leader(&a_->service()), own(&a_->service());
  const absl::Status down = core::WithReason(absl::UnavailableError("head group of 2 is down"),
                                             core::reason::kGroupUnavailable, {{"rank", "1"}});
  own.Answer(10, down);
  leader.Answer(10, down);
  auto client = *rc::Client::Create(
      {.fronts = {leader.target(), own.target()}, .rank = 1, .retry = {.max_attempts = 1}});
  const auto described = client->DescribeHead("lm");
  EXPECT_EQ(core::ReasonOf(described.status()).reason, core::reason::kGroupUnavailable);
  EXPECT_EQ(leader.calls(), 1);  // one probe, no second sweep
  EXPECT_EQ(own.calls(), 1);     // the call only
  EXPECT_EQ(client->replica(), 1);

  // An evicted replica's front says so (metadata "evicted"): the leader that serves is found.
  ScriptedFront evicted(&a_->service());
  evicted.Answer(
      10, core::WithReason(absl::UnavailableError("replica 1 was evicted"),
                           core::reason::kGroupUnavailable, {{"evicted", "1"}, {"epoch", "1"}}));
  auto moving = *rc::Client::Create(
      {.fronts = {a_->target(), evicted.target()}, .rank = 1, .retry = {.max_attempts = 1}});
  EXPECT_EQ(core::ReasonOf(moving->DescribeHead("lm").status()).reason, rc::reason::kReplicaMoved);
  EXPECT_EQ(moving->replica(), 0);
}

TEST_F(MeshMoveTest, ADrainingFrontIsNotFollowed) {
  ScriptedFront own(&a_->service());
  own.Answer(1,
             core::WithReason(absl::UnavailableError("draining"), core::reason::kServerDraining));
  auto client = *rc::Client::Create(
      {.fronts = {a_->target(), own.target()}, .rank = 1, .retry = {.max_attempts = 1}});
  const auto described = client->DescribeHead("lm");
  EXPECT_EQ(core::ReasonOf(described.status()).reason, core::reason::kServerDraining);
  EXPECT_EQ(client->replica(), 1);
}

}  // namespace
}  // namespace remotehead
