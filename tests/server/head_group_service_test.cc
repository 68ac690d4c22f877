// A head group of real remotehead-server processes (ranks on loopback, Gloo over TCP) against
// one remotehead-server holding the same head, through the C++ client: every result a trainer
// sees — loss, dX, per-token outputs, the gathered dW, the weights after AdamW steps, a saved
// and reloaded checkpoint — is equal (fp32 within 1e-5); a replayed gradient id adds nothing;
// a killed rank fails the call with UNAVAILABLE naming it, commits nothing and takes the group
// down (health NOT_SERVING), and the surviving processes end instead of hanging; bad group
// flags exit 2 naming the flag.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/client/client.h"
#include "remotehead/core/head.h"
#include "remotehead/core/vocab_group.h"
#include "support/child_process.h"

namespace remotehead {
namespace {

constexpr int64_t kVocab = 29;  // 29 rows: shards of 15+14 (K=2) and 10+10+9 (K=3)
constexpr int64_t kHidden = 8;
constexpr int64_t kRows = 23;
constexpr double kTol = 1e-5;

// One server (size 1) or a head group of `size` processes, with a client of its front.
class Servers {
 public:
  // `rank_args`: extra flags by rank (e.g. a smaller memory budget on one rank).
  Servers(int size, const std::string& checkpoint_dir, double timeout_seconds = 10,
          const std::vector<std::vector<std::string>>& rank_args = {}) {
    auto argv = [&](int rank) {
      std::vector<std::string> args = {REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0",
                                       "--device=cpu", "--torch_threads=1",
                                       "--checkpoint_dir=" + checkpoint_dir};
      if (size > 1) args.push_back(absl::StrCat("--group_timeout_seconds=", timeout_seconds));
      if (static_cast<size_t>(rank) < rank_args.size()) {
        for (const std::string& a : rank_args[static_cast<size_t>(rank)]) args.push_back(a);
      }
      return args;
    };
    if (size > 1) {
      ranks_ = testing::StartHeadGroup(size, argv);
    } else {
      ranks_.push_back(std::make_unique<testing::ServerProcess>(argv(0)));
    }
    const int port = testing::ServerProcess::ParsePort(ranks_[0]->ready_line());
    client::ClientOptions options{.target = absl::StrCat("127.0.0.1:", port)};
    options.retry.max_attempts = 1;  // a failure is what some tests look at
    client_ = *client::Client::Create(options);
  }

  bool started() const { return testing::ServerProcess::ParsePort(ranks_[0]->ready_line()) > 0; }
  client::Client& client() { return *client_; }
  testing::ChildProcess& rank(int r) { return *ranks_.at(static_cast<size_t>(r)); }
  std::string logs() const {
    std::string all;
    for (size_t r = 0; r < ranks_.size(); ++r)
      absl::StrAppend(&all, "--- rank ", r, "\n", ranks_[r]->log());
    return all;
  }

 private:
  std::vector<std::unique_ptr<testing::ChildProcess>> ranks_;
  std::shared_ptr<client::Client> client_;
};

void ExpectClose(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double diff = (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max().item<double>();
  EXPECT_LE(diff, kTol) << what << ": max |group − one server| = " << diff;
}

struct Batch {
  torch::Tensor hidden;
  torch::Tensor targets;
};

// Targets on both sides of every shard edge, and some ignored.
Batch MakeBatch(uint64_t seed) {
  torch::manual_seed(seed);
  Batch b{.hidden = torch::randn({kRows, kHidden}),
          .targets = torch::randint(0, kVocab, {kRows}, torch::kLong)};
  const std::vector<int64_t> edges = {0, 9, 10, 14, 15, 19, 20, 28};
  for (size_t i = 0; i < edges.size(); ++i) b.targets[static_cast<int64_t>(i)] = edges[i];
  b.targets[20] = -100;
  b.targets[21] = -100;
  return b;
}

client::StepSpec Spec(const std::string& head, client::GradientId id) {
  client::StepSpec spec{
      .head_id = head, .params = {{"label_smoothing", 0.1}, {"z_loss", 1e-3}}, .chunk_rows = 7};
  spec.gradient_id = id;
  return spec;
}

class HeadGroupServiceTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("remotehead_group_", getpid(), "_", GetParam());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

// Everything a trainer sees of a head, on a group of K and on one server, side by side.
TEST_P(HeadGroupServiceTest, EqualsOneServer) {
  const int size = GetParam();
  Servers group(size, dir_.string());
  Servers single(1, dir_.string());
  ASSERT_TRUE(group.started()) << group.logs();
  ASSERT_TRUE(single.started()) << single.logs();
  client::Client& g = group.client();
  client::Client& s = single.client();

  const client::InitSpec init{
      .vocab_size = kVocab, .hidden_size = kHidden, .bias = true, .seed = 7};
  auto info = g.CreateHead("h", init);
  ASSERT_TRUE(info.ok()) << info.status() << group.logs();
  ASSERT_TRUE(s.CreateHead("h", init).ok());
  // HeadInfo: the whole head's size and every rank's rows.
  EXPECT_EQ(info->vocab_size, kVocab);
  EXPECT_EQ(info->group_size, size);
  const auto ranges = *core::SplitVocabulary(kVocab, size);
  ASSERT_EQ(info->shards.size(), ranges.size());
  for (size_t r = 0; r < ranges.size(); ++r) {
    EXPECT_EQ(info->shards[r].first, ranges[r].offset);
    EXPECT_EQ(info->shards[r].second, ranges[r].rows);
  }
  // The seed's rows of every shard are the one-server head's rows.
  ExpectClose(g.ExportWeights("h")->weight, s.ExportWeights("h")->weight, "seeded W");

  // Fused, twice (two micro-batches), then a replay of the first: it adds nothing anywhere.
  for (int micro = 0; micro < 2; ++micro) {
    const Batch b = MakeBatch(micro);
    const client::StepSpec spec = Spec("h", {"t", 0, micro});
    auto rg = g.ForwardBackward(spec, {.hidden = b.hidden, .targets = b.targets});
    auto rs = s.ForwardBackward(spec, {.hidden = b.hidden, .targets = b.targets});
    ASSERT_TRUE(rg.ok()) << rg.status() << group.logs();
    ASSERT_TRUE(rs.ok()) << rs.status();
    EXPECT_NEAR(rg->loss, rs->loss, kTol);
    ExpectClose(rg->grad_hidden, rs->grad_hidden, "fused dX");
    EXPECT_EQ(rg->summary.valid_tokens, rs->summary.valid_tokens);
  }
  const auto before_replay = g.FetchGradients("h");
  ASSERT_TRUE(before_replay.ok()) << before_replay.status();
  {
    const Batch b = MakeBatch(0);
    auto replay =
        g.ForwardBackward(Spec("h", {"t", 0, 0}), {.hidden = b.hidden, .targets = b.targets});
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_TRUE(replay->summary.replayed);
  }
  const auto dg = g.FetchGradients("h");
  const auto ds = s.FetchGradients("h");
  ASSERT_TRUE(dg.ok() && ds.ok());
  EXPECT_TRUE(torch::equal(dg->weight_grad, before_replay->weight_grad)) << "a replay added dW";
  ExpectClose(dg->weight_grad, ds->weight_grad, "gathered dW");
  ExpectClose(dg->bias_grad, ds->bias_grad, "gathered db");
  EXPECT_EQ(dg->info.accumulated_micro_batches, 2);

  // Per-token outputs (softcap and temperature), then the two-phase backward of them.
  {
    const Batch b = MakeBatch(5);
    client::StepSpec spec{.head_id = "h",
                          .function = "token_logprobs",
                          .params = {{"softcap", 3.0}, {"temperature", 0.7}},
                          .reduction = client::Reduction::kNone,
                          .chunk_rows = 7};
    auto fg = g.Forward(spec, {.hidden = b.hidden, .targets = b.targets});
    auto fs = s.Forward(spec, {.hidden = b.hidden, .targets = b.targets});
    ASSERT_TRUE(fg.ok() && fs.ok()) << fg.status() << fs.status();
    ExpectClose(fg->outputs, fs->outputs, "per-token logprobs");
    spec.gradient_id = client::GradientId{"t", 0, 2};
    const torch::Tensor dy = torch::linspace(-1, 1, kRows);
    auto bg = g.Backward(spec, {.hidden = b.hidden, .targets = b.targets}, dy);
    auto bs = s.Backward(spec, {.hidden = b.hidden, .targets = b.targets}, dy);
    ASSERT_TRUE(bg.ok() && bs.ok()) << bg.status() << bs.status();
    ExpectClose(bg->grad_hidden, bs->grad_hidden, "two-phase dX");
  }

  // Three AdamW steps, each after a fused step: the weights stay equal.
  for (int step = 1; step <= 3; ++step) {
    const client::OptimizerStepOptions adamw{.optimizer = client::AdamW{.lr = 0.05},
                                             .zero_gradients = true};
    ASSERT_TRUE(g.OptimizerStep("h", adamw).ok());
    ASSERT_TRUE(s.OptimizerStep("h", adamw).ok());
    const Batch b = MakeBatch(10 + step);
    auto rg =
        g.ForwardBackward(Spec("h", {"t", step, 0}), {.hidden = b.hidden, .targets = b.targets});
    auto rs =
        s.ForwardBackward(Spec("h", {"t", step, 0}), {.hidden = b.hidden, .targets = b.targets});
    ASSERT_TRUE(rg.ok() && rs.ok()) << rg.status() << rs.status();
    EXPECT_NEAR(rg->loss, rs->loss, kTol) << "after AdamW step " << step;
  }
  const auto wg = g.ExportWeights("h");
  const auto ws = s.ExportWeights("h");
  ASSERT_TRUE(wg.ok() && ws.ok());
  EXPECT_EQ(g.DescribeHead("h")->weight_version, 3);
  ExpectClose(wg->weight, ws->weight, "W after 3 AdamW steps");
  ExpectClose(wg->bias, ws->bias, "b after 3 AdamW steps");

  // Saved through the front (gathered), reloaded into a group (each rank reads its rows) and
  // into the single server: bit for bit the head that was saved.
  auto saved = g.SaveWeights("h", "group.safetensors");
  ASSERT_TRUE(saved.ok()) << saved.status();
  const client::SafetensorsSource source{.path = "group.safetensors", .bias_name = "lm_head.bias"};
  ASSERT_TRUE(g.CreateHead("reloaded", source).ok());
  ASSERT_TRUE(s.CreateHead("reloaded", source).ok());
  EXPECT_TRUE(torch::equal(g.ExportWeights("reloaded")->weight, wg->weight));
  EXPECT_TRUE(torch::equal(s.ExportWeights("reloaded")->weight, wg->weight));
  EXPECT_TRUE(torch::equal(g.ExportWeights("reloaded")->bias, wg->bias));

  // An uploaded head: each rank keeps its rows of it.
  torch::manual_seed(3);
  const torch::Tensor w = torch::randn({kVocab, kHidden});
  ASSERT_TRUE(g.UploadHead("up", w).ok());
  EXPECT_TRUE(torch::equal(g.ExportWeights("up")->weight, w));

  // Dropped on every rank: the id is free again everywhere.
  ASSERT_TRUE(g.DropHead("up").ok());
  EXPECT_EQ(g.DescribeHead("up").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(g.CreateHead("up", init).ok()) << group.logs();
}

// Distillation on a group: a frozen teacher (of its own hidden size) split like its student;
// every rank computes its shard of both heads' logits. Fused, and Forward then Backward by a
// retained inputs handle: equal to one server. The teacher is frozen on every rank.
TEST_P(HeadGroupServiceTest, DistillationFromAFrozenTeacherEqualsOneServer) {
  const int size = GetParam();
  Servers group(size, dir_.string());
  Servers single(1, dir_.string());
  ASSERT_TRUE(group.started()) << group.logs();
  ASSERT_TRUE(single.started()) << single.logs();
  client::Client& g = group.client();
  client::Client& s = single.client();
  constexpr int64_t kTeacherHidden = 12;
  const client::InitSpec student{
      .vocab_size = kVocab, .hidden_size = kHidden, .bias = true, .seed = 7};
  const client::InitSpec teacher{.vocab_size = kVocab,
                                 .hidden_size = kTeacherHidden,
                                 .bias = true,
                                 .seed = 8,
                                 .init_std = 0.5,
                                 .frozen = true};
  for (client::Client* c : {&g, &s}) {
    ASSERT_TRUE(c->CreateHead("s", student).ok()) << group.logs();
    auto info = c->CreateHead("t", teacher);
    ASSERT_TRUE(info.ok()) << info.status() << group.logs();
    EXPECT_TRUE(info->frozen);
  }
  // Every rank created it frozen (its lifecycle line says so), and refuses dW and steps.
  for (int r = 0; r < size; ++r) {
    ASSERT_TRUE(group.rank(r).WaitFor([](const std::string& line) {
      return line.find("head created from seed 8: \"t\"") != std::string::npos;
    })) << group.logs();
    EXPECT_NE(group.rank(r).ready_line().find("version 0, frozen"), std::string::npos)
        << "rank " << r << ": " << group.rank(r).ready_line();
  }
  auto step = g.OptimizerStep("t", {.optimizer = client::Sgd{.lr = 0.1}});
  EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition) << step.status();

  const Batch b = MakeBatch(3);
  torch::manual_seed(4);
  const client::StepInputs inputs{.hidden = b.hidden,
                                  .targets = b.targets,
                                  .teacher_hidden = torch::randn({kRows, kTeacherHidden})};
  client::StepSpec spec{.head_id = "s",
                        .function = "distill_kl",
                        .params = {{"alpha", 0.5}, {"temperature", 2.0}},
                        .chunk_rows = 7,
                        .teacher_head_id = "t"};
  spec.gradient_id = client::GradientId{"t", 0, 0};
  auto rg = g.ForwardBackward(spec, inputs);
  auto rs = s.ForwardBackward(spec, inputs);
  ASSERT_TRUE(rg.ok()) << rg.status() << group.logs();
  ASSERT_TRUE(rs.ok()) << rs.status();
  EXPECT_GT(rs->loss, 0.1);
  EXPECT_NEAR(rg->loss, rs->loss, kTol);
  ExpectClose(rg->grad_hidden, rs->grad_hidden, "distillation dX");
  const auto dg = g.FetchGradients("s");
  const auto ds = s.FetchGradients("s");
  ASSERT_TRUE(dg.ok() && ds.ok());
  ExpectClose(dg->weight_grad, ds->weight_grad, "distillation dW");
  ExpectClose(dg->bias_grad, ds->bias_grad, "distillation db");
  const auto tg = g.FetchGradients("t");
  ASSERT_TRUE(tg.ok()) << tg.status();
  EXPECT_EQ(tg->weight_grad.abs().sum().item<double>(), 0) << "the teacher got dW";
  EXPECT_EQ(g.DescribeHead("t")->teacher_of, std::vector<std::string>{"s"});

  // Forward retaining the inputs (teacher_hidden with them), then Backward by the handle.
  client::StepSpec forward = spec;
  forward.function = "distill_jsd";
  forward.params = {{"beta", 0.3}};
  forward.retain_inputs_seconds = 60;
  auto fg = g.Forward(forward, inputs);
  auto fs = s.Forward(forward, inputs);
  ASSERT_TRUE(fg.ok() && fs.ok()) << fg.status() << fs.status() << group.logs();
  EXPECT_NEAR(fg->summary.loss, fs->summary.loss, kTol);
  client::StepSpec backward = forward;
  backward.retain_inputs_seconds = 0;
  backward.gradient_id = client::GradientId{"t", 0, 1};
  backward.inputs_handle = fg->summary.inputs_handle;
  auto bg = g.Backward(backward, inputs, torch::ones({}));
  backward.inputs_handle = fs->summary.inputs_handle;
  auto bs = s.Backward(backward, inputs, torch::ones({}));
  ASSERT_TRUE(bg.ok() && bs.ok()) << bg.status() << bs.status() << group.logs();
  ExpectClose(bg->grad_hidden, bs->grad_hidden, "two-phase distillation dX");
}

INSTANTIATE_TEST_SUITE_P(Sizes, HeadGroupServiceTest, ::testing::Values(2, 3),
                         [](const auto& info) { return absl::StrCat("K", info.param); });

// A rank killed while a step runs: the call fails with UNAVAILABLE naming the rank, nothing is
// committed, the group is down for every later call (health NOT_SERVING), and the other
// processes end once the front does, instead of hanging.
TEST(HeadGroupFailureTest, KilledRankFailsTheCallAndTakesTheGroupDown) {
  const std::string dir = std::filesystem::temp_directory_path() / "remotehead_group_kill";
  std::filesystem::create_directories(dir);
  // A killed rank fails the collectives at once; the live rank's reply (which names rank 2)
  // then has the grace of min(timeout / 5, 2 s): 2 s here, as 0.6 s (timeout 3 s) was missed
  // on a loaded 2-core machine, naming the slow live rank 1 instead.
  Servers group(3, dir, /*timeout_seconds=*/10);
  ASSERT_TRUE(group.started()) << group.logs();
  client::Client& g = group.client();
  ASSERT_TRUE(g.CreateHead("h", {.vocab_size = kVocab, .hidden_size = kHidden, .seed = 1}).ok());
  const Batch b = MakeBatch(0);
  ASSERT_TRUE(
      g.ForwardBackward(Spec("h", {"t", 0, 0}), {.hidden = b.hidden, .targets = b.targets}).ok());

  // A long step (many one-row chunks) with rank 2 killed while it runs.
  torch::manual_seed(1);
  const int64_t rows = 20000;
  const torch::Tensor hidden = torch::randn({rows, kHidden});
  const torch::Tensor targets = torch::randint(0, kVocab, {rows}, torch::kLong);
  client::StepSpec spec = Spec("h", {"t", 0, 1});
  spec.chunk_rows = 1;
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(group.rank(2).pid(), SIGKILL);
  });
  const auto start = std::chrono::steady_clock::now();
  auto failed = g.ForwardBackward(spec, {.hidden = hidden, .targets = targets});
  killer.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_NE(failed.status().message().find("rank 2"), std::string::npos) << failed.status();
  EXPECT_LT(seconds, 30) << "the failure took too long";

  // Nothing committed on the front; every later group call is UNAVAILABLE saying why.
  auto info = g.DescribeHead("h");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->accumulated_micro_batches, 1);
  auto later = g.FetchGradients("h");
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(later.status().message().find("down"), std::string::npos) << later.status();
  // Health turns NOT_SERVING (the server says so when it does).
  const bool reported = group.rank(0).WaitFor(
      [](const std::string& l) { return l.find("NOT_SERVING") != std::string::npos; });
  EXPECT_TRUE(reported) << group.logs();

  // The front stops cleanly; rank 1, whose front is gone, ends on its own (exit 1).
  EXPECT_EQ(group.rank(0).Wait(SIGTERM), 0) << group.logs();
  EXPECT_EQ(group.rank(1).Wait(), 1) << group.logs();
  EXPECT_NE(group.rank(1).log().find("the front (rank 0) is gone"), std::string::npos)
      << group.logs();
  std::filesystem::remove_all(dir);
}

// A deadline passing mid-step stops every rank (the engine's per-chunk stop flag) with nothing
// committed, and the group stays up: a cancelled request is not a failure of the group.
TEST(HeadGroupFailureTest, DeadlineStopsEveryRankAndTheGroupStaysUp) {
  const std::string dir = std::filesystem::temp_directory_path() / "remotehead_group_deadline";
  std::filesystem::create_directories(dir);
  Servers group(2, dir);
  ASSERT_TRUE(group.started()) << group.logs();
  ASSERT_TRUE(group.client()
                  .CreateHead("h", {.vocab_size = kVocab, .hidden_size = kHidden, .seed = 1})
                  .ok());
  client::ClientOptions options{
      .target = absl::StrCat("127.0.0.1", ":",
                             testing::ServerProcess::ParsePort(group.rank(0).ready_line()))};
  options.retry.max_attempts = 1;
  options.deadline = std::chrono::milliseconds(300);
  auto hurried = *client::Client::Create(options);
  torch::manual_seed(1);
  const int64_t rows = 20000;
  client::StepSpec spec = Spec("h", {"t", 0, 0});
  spec.chunk_rows = 1;
  auto late =
      hurried->ForwardBackward(spec, {.hidden = torch::randn({rows, kHidden}),
                                      .targets = torch::randint(0, kVocab, {rows}, torch::kLong)});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  // The group goes on: the same id is then added once, on every rank.
  const Batch b = MakeBatch(0);
  auto next = group.client().ForwardBackward(Spec("h", {"t", 0, 0}),
                                             {.hidden = b.hidden, .targets = b.targets});
  ASSERT_TRUE(next.ok()) << next.status() << group.logs();
  EXPECT_FALSE(next->summary.replayed);
  auto grads = group.client().FetchGradients("h");
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(grads->info.accumulated_micro_batches, 1);
  std::filesystem::remove_all(dir);
}

// Each rank reserves its rows in its own budget: a head that one rank's budget refuses is
// RESOURCE_EXHAUSTED naming that rank, and is undone on the ranks that had created it.
TEST(HeadGroupFailureTest, OneRanksBudgetRefusesAHeadEverywhere) {
  const std::string dir = std::filesystem::temp_directory_path() / "remotehead_group_budget";
  std::filesystem::create_directories(dir);
  // 1 MiB on rank 1: its half of an 8192 × 64 fp32 head (1 MiB of W + 1 MiB of dW) does not fit.
  Servers group(2, dir, 10, {{}, {"--memory_budget_bytes=1048576"}});
  ASSERT_TRUE(group.started()) << group.logs();
  client::Client& g = group.client();
  auto big = g.CreateHead("big", {.vocab_size = 8192, .hidden_size = 64});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(big.status().message().find("rank 1"), std::string::npos) << big.status();
  EXPECT_EQ(g.DescribeHead("big").status().code(), absl::StatusCode::kNotFound);
  // Nothing of it stays anywhere: a head that fits is created under the same id.
  auto small = g.CreateHead("big", {.vocab_size = 64, .hidden_size = 64});
  EXPECT_TRUE(small.ok()) << small.status() << group.logs();
  std::filesystem::remove_all(dir);
}

// --head preloads on a group: every rank creates its rows of the head (reserving only those),
// equal to the same rows of a one-server head with that seed.
TEST(HeadGroupStartTest, PreloadedHeadIsSplitByRank) {
  const std::string dir = std::filesystem::temp_directory_path() / "remotehead_group_preload";
  std::filesystem::create_directories(dir);
  const std::string head = "--head=pre:29:8:float32:5";
  Servers group(2, dir, 10, {{head}, {head}});
  ASSERT_TRUE(group.started()) << group.logs();
  auto info = group.client().DescribeHead("pre");
  ASSERT_TRUE(info.ok()) << info.status() << group.logs();
  EXPECT_EQ(info->vocab_size, 29);
  EXPECT_EQ(info->group_size, 2);
  const auto whole = core::Head::Initialize({.vocab_size = 29, .hidden_size = 8, .seed = 5}, {});
  ASSERT_TRUE(whole.ok());
  auto exported = group.client().ExportWeights("pre");
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_TRUE(torch::equal(exported->weight, (*whole)->weight()));
  std::filesystem::remove_all(dir);
}

// A group whose other rank never comes: the front gives up after the timeout (exit 1).
TEST(HeadGroupFailureTest, MissingRankEndsTheStartWithinTheTimeout) {
  testing::ChildProcess front(
      {REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--device=cpu", "--group_size=2",
       "--group_rank=0", absl::StrCat("--group_store=127.0.0.1:", testing::FreePort()),
       "--group_timeout_seconds=2"},
      [](const std::string&) { return false; });
  EXPECT_EQ(front.Wait(), 1) << front.log();
  EXPECT_NE(front.log().find("rank 0 of 2"), std::string::npos) << front.log();
}

// Bad group flags: exit 2 naming the flag, before anything starts.
TEST(HeadGroupFlagsTest, BadFlagsExitTwoNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--group_size=-1"}, "--group_size"},
      {{"--group_size=2", "--group_rank=2"}, "--group_rank"},
      {{"--group_size=2", "--group_rank=-5"}, "--group_rank"},
      {{"--group_size=2", "--group_rank=0", "--group_store_bind=0.0.0.0"}, "--group_secret_file"},
      {{"--group_size=2", "--group_rank=0", "--group_store=nohost"}, "--group_store"},
      {{"--group_size=2", "--group_rank=0", "--group_timeout_seconds=0"},
       "--group_timeout_seconds"},
  };
  for (const auto& [flags, named] : cases) {
    std::vector<std::string> argv = {REMOTEHEAD_SERVER_BINARY, "--listen=127.0.0.1:0",
                                     "--device=cpu"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    testing::ServerProcess server(argv);
    EXPECT_EQ(server.ExitCode(), 2) << named << ": " << server.log();
    EXPECT_NE(server.log().find(named), std::string::npos) << server.log();
  }
}

}  // namespace
}  // namespace remotehead
