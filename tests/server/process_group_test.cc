// The head group's c10d transport: K real processes (this binary re-run as ranks) joined through
// a TCPStore on loopback with ProcessGroupGloo, running the engine's step on their shards; the
// result equals one engine on the whole head. Also: the group's ordered command log (GroupLog),
// the group flags and their torchrun-style environment, a rank that never comes, a rank that
// dies mid-step or mid-log, and a one-rank NCCL group on CUDA (skipped without a GPU).
#include "remotehead/server/group/process_group.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/reference.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/server/group/group_log.h"
#include "support/child_process.h"

namespace remotehead {
namespace {

namespace fs = std::filesystem;
using server::GroupConfig;
using server::GroupFlags;

constexpr int64_t kVocab = 101;
constexpr int64_t kHidden = 16;
constexpr int64_t kRows = 37;

std::string SelfPath() { return fs::read_symlink("/proc/self/exe").string(); }

// The whole head and the batch every rank (and the single engine) uses.
std::unique_ptr<core::Head> TestHead() {
  return reference::MakeTestHead(kVocab, kHidden, torch::kFloat, /*bias=*/true);
}
core::TokenBatch TestBatch(const core::Head& head) {
  return reference::MakeTestBatch(head, kRows, "cross_entropy", core::Reduction::kMean);
}
core::StepOptions TestOptions() {
  core::StepOptions options;
  options.params = {{"label_smoothing", 0.1}, {"z_loss", 1e-3}};
  options.chunk_rows = 8;
  return options;
}

// A child process joining a group on loopback as `rank`; says "joining" first, which is what
// the parent waits for before it starts the next rank.
absl::StatusOr<std::unique_ptr<server::ProcessGroup>> JoinAsRank(int size, int rank, int port,
                                                                 double timeout_seconds) {
  GroupConfig config;
  config.size = size;
  config.rank = rank;
  config.store_port = port;
  config.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  std::printf("rank %d: joining\n", rank);
  std::fflush(stdout);
  return server::ProcessGroup::Join(config);
}

// One rank, run as a child process: joins, steps its shard, saves [loss, dX] (rank 0) and its dW
// rows to `out`. With `die`, it exits right after joining, so the others' step fails.
int RunRank(int size, int rank, int port, const std::string& out, bool die, double timeout) {
  auto group = JoinAsRank(size, rank, port, timeout);
  if (!group.ok()) {
    std::printf("rank %d: join: %s\n", rank, group.status().ToString().c_str());
    return 3;
  }
  if (die) _exit(9);
  auto head = TestHead();
  const auto ranges = core::SplitVocabulary(kVocab, size);
  const core::ShardRange mine = (*ranges)[static_cast<size_t>(rank)];
  auto shard = core::Head::FromTensors(head->weight().narrow(0, mine.offset, mine.rows),
                                       head->bias().narrow(0, mine.offset, mine.rows), {});
  core::VocabShard vocab_shard{.group = group->get(), .ranges = *ranges};
  core::StepOptions options = TestOptions();
  options.shard = &vocab_shard;
  core::GradientBuffers grads = (*shard)->NewGradientBuffers();
  auto result = core::FusedForwardBackward(**shard, TestBatch(*head), options, &grads);
  if (!result.ok()) {
    std::printf("rank %d: step: %s\n", rank, result.status().ToString().c_str());
    return 4;
  }
  std::vector<torch::Tensor> saved = {grads.weight, grads.bias};
  if (rank == 0) {
    saved.push_back(torch::full({}, result->loss, torch::kDouble));
    saved.push_back(result->grad_hidden);
  }
  torch::save(saved, out);
  const auto bytes = (*group)->Bytes();
  std::printf("rank %d: ok, all_gather calls %ld\n", rank,
              static_cast<long>(bytes.count("all_gather") ? bytes.at("all_gather").calls : 0));
  return 0;
}

// One rank of the command-log scenarios, run as a child process. Rank 0 appends five commands
// and checks every reply, then "stop"; the others execute commands in order and reply "rank r
// did <command>". Scenario "error": rank 2 refuses command 3; "dead": rank 1 exits after taking
// command 1. Exit 0: everything as expected (checked by rank 0 and reported on its stdout).
int RunLogRank(int size, int rank, int port, const std::string& scenario) {
  auto group = JoinAsRank(size, rank, port, /*timeout=*/5);
  if (!group.ok()) return 3;
  server::GroupLog log(group->get());
  if (rank != 0) {
    for (int idle = 0; idle < 40;) {  // 20 s without a command: give up (exit 7)
      auto command = log.Next(std::chrono::milliseconds(500));
      if (absl::IsDeadlineExceeded(command.status())) {
        ++idle;
        continue;
      }
      idle = 0;
      if (!command.ok()) {
        std::printf("rank %d: %s\n", rank, command.status().ToString().c_str());
        return 5;
      }
      if (scenario == "dead" && rank == 1 && *command == "cmd-1") _exit(9);
      server::GroupReply reply;
      if (scenario == "error" && rank == 2 && *command == "cmd-3") {
        reply.status = absl::InvalidArgumentError("cmd-3: refused");
      }
      reply.payload = absl::StrCat("rank ", rank, " did ", *command);
      if (!log.Reply(reply).ok()) return 6;
      if (*command == "stop") return 0;
    }
    return 7;
  }
  for (int i = 0; i < 5; ++i) {
    const std::string command = absl::StrCat("cmd-", i);
    auto seq = log.Append(command);
    if (!seq.ok() || *seq != i) return 10;
    auto replies = log.AwaitReplies(*seq);
    if (scenario == "error" && i == 3) {
      std::printf("front: %s\n", replies.status().ToString().c_str());
      if (replies.status() != absl::InvalidArgumentError("head group rank 2: cmd-3: refused")) {
        return 11;
      }
      continue;
    }
    if (scenario == "dead" && i == 1) {
      std::printf("front: %s\n", replies.status().ToString().c_str());
      const bool named =
          absl::IsUnavailable(replies.status()) && replies.status().message().find(
                                                       "rank 1 of 3 did not reply to command "
                                                       "1") != std::string::npos;
      return named ? 0 : 12;
    }
    if (!replies.ok()) {
      std::printf("front: %s\n", replies.status().ToString().c_str());
      return 13;
    }
    for (int r = 1; r < size; ++r) {
      if ((*replies)[static_cast<size_t>(r - 1)] != absl::StrCat("rank ", r, " did ", command)) {
        return 14;
      }
    }
  }
  auto stop = log.Append("stop");
  if (!stop.ok() || !log.AwaitReplies(*stop).ok()) return 15;
  return 0;
}

struct Ranks {
  std::vector<std::unique_ptr<testing::ChildProcess>> processes;
  std::vector<int> exit_codes;
};

// Runs this binary as ranks 0..size-1 of one group (all but `missing`), with the arguments
// args(rank, port) after its path, and waits for all of them.
Ranks RunRanks(int size, int missing,
               const std::function<std::vector<std::string>(int rank, int port)>& args) {
  const int port = testing::FreePort();
  Ranks ranks;
  for (int r = 0; r < size; ++r) {
    if (r == missing) continue;
    std::vector<std::string> argv = {SelfPath()};
    for (std::string& a : args(r, port)) argv.push_back(std::move(a));
    ranks.processes.push_back(std::make_unique<testing::ChildProcess>(
        argv, [](const std::string& line) { return line.find("joining") != std::string::npos; }));
  }
  for (auto& p : ranks.processes) ranks.exit_codes.push_back(p->Wait());
  return ranks;
}

// The engine-step ranks (RunRank), with `dying` exiting after the join.
Ranks RunGroup(int size, const fs::path& dir, int missing = -1, int dying = -1,
               double timeout = 30) {
  return RunRanks(size, missing, [&](int r, int port) {
    return std::vector<std::string>{"--as_rank",
                                    std::to_string(size),
                                    std::to_string(r),
                                    std::to_string(port),
                                    (dir / ("rank" + std::to_string(r))).string(),
                                    r == dying ? "die" : "live",
                                    std::to_string(timeout)};
  });
}

// The command-log ranks (RunLogRank) of one scenario.
Ranks RunLogGroup(int size, const std::string& scenario) {
  return RunRanks(size, /*missing=*/-1, [&](int r, int port) {
    return std::vector<std::string>{"--as_log_rank", std::to_string(size), std::to_string(r),
                                    std::to_string(port), scenario};
  });
}

class ProcessGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("remotehead_pg_" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(ProcessGroupTest, GlooGroupsOfTwoAndThreeEqualOneEngine) {
  auto head = TestHead();
  const core::TokenBatch batch = TestBatch(*head);
  core::GradientBuffers expected = head->NewGradientBuffers();
  auto single = core::FusedForwardBackward(*head, batch, TestOptions(), &expected);
  ASSERT_TRUE(single.ok()) << single.status();
  for (int size : {2, 3}) {
    SCOPED_TRACE("group of " + std::to_string(size));
    const Ranks ranks = RunGroup(size, dir_);
    for (size_t r = 0; r < ranks.processes.size(); ++r) {
      ASSERT_EQ(ranks.exit_codes[r], 0) << ranks.processes[r]->log();
    }
    std::vector<torch::Tensor> dw;
    std::vector<torch::Tensor> db;
    std::vector<torch::Tensor> rank0;
    for (int r = 0; r < size; ++r) {
      std::vector<torch::Tensor> saved;
      torch::load(saved, (dir_ / ("rank" + std::to_string(r))).string());
      dw.push_back(saved[0]);
      db.push_back(saved[1]);
      if (r == 0) rank0 = saved;
    }
    constexpr double kTolerance = 1e-5;
    EXPECT_LE(reference::RelativeError(rank0[2].item<double>(), single->loss), kTolerance);
    EXPECT_LE(reference::RelativeError(rank0[3], single->grad_hidden), kTolerance);
    EXPECT_LE(reference::RelativeError(torch::cat(dw), expected.weight), kTolerance);
    EXPECT_LE(reference::RelativeError(torch::cat(db), expected.bias), kTolerance);
  }
}

TEST_F(ProcessGroupTest, ARankThatNeverComesFailsTheJoinWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks = RunGroup(3, dir_, /*missing=*/2, /*dying=*/-1, /*timeout=*/3);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t r = 0; r < ranks.processes.size(); ++r) {
    EXPECT_EQ(ranks.exit_codes[r], 3) << ranks.processes[r]->log();
  }
  EXPECT_LT(seconds, 30) << "the join must give up after about its timeout";
}

TEST_F(ProcessGroupTest, ARankThatDiesMidStepFailsTheOthersWithoutHanging) {
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks = RunGroup(3, dir_, /*missing=*/-1, /*dying=*/1, /*timeout=*/5);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(ranks.exit_codes[1], 9);
  for (size_t r : {size_t{0}, size_t{2}}) {
    EXPECT_EQ(ranks.exit_codes[r], 4) << ranks.processes[r]->log();
    const std::string& log = ranks.processes[r]->log();
    EXPECT_TRUE(log.find("UNAVAILABLE") != std::string::npos ||
                log.find("DEADLINE_EXCEEDED") != std::string::npos)
        << log;
  }
  EXPECT_LT(seconds, 60);
}

TEST(GroupLogTest, EveryRankTakesTheCommandsInOrderAndReplies) {
  const Ranks ranks = RunLogGroup(3, "ok");
  for (size_t r = 0; r < ranks.processes.size(); ++r) {
    EXPECT_EQ(ranks.exit_codes[r], 0) << ranks.processes[r]->log();
  }
}

TEST(GroupLogTest, ARanksErrorReachesTheFrontNamingTheRankAndTheLogGoesOn) {
  const Ranks ranks = RunLogGroup(3, "error");
  for (size_t r = 0; r < ranks.processes.size(); ++r) {
    EXPECT_EQ(ranks.exit_codes[r], 0) << ranks.processes[r]->log();
  }
}

TEST(GroupLogTest, ADeadRankIsNamedWithinTheTimeoutAndNoRankHangs) {
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks = RunLogGroup(3, "dead");
  EXPECT_EQ(ranks.exit_codes[0], 0) << ranks.processes[0]->log();
  EXPECT_EQ(ranks.exit_codes[1], 9);
  // The front is gone with its store: the surviving rank's next read fails instead of waiting.
  EXPECT_EQ(ranks.exit_codes[2], 5) << ranks.processes[2]->log();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 60);
}

TEST(GroupLogTest, RepliesRoundTrip) {
  const server::GroupReply reply{absl::NotFoundError("head \"a:b\" not found"), "x:1:y"};
  auto decoded = server::DecodeReply(server::EncodeReply(reply));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->status, reply.status);
  EXPECT_EQ(decoded->payload, reply.payload);
  // The reason (core/error_reason.h) crosses too: the front answers with the rank's reason.
  const server::GroupReply timed_out{
      core::WithReason(absl::DeadlineExceededError("collective timed out"),
                       core::reason::kGroupTimeout, {{"rank", "2"}}),
      ""};
  auto decoded_reason = server::DecodeReply(server::EncodeReply(timed_out));
  ASSERT_TRUE(decoded_reason.ok()) << decoded_reason.status();
  EXPECT_EQ(decoded_reason->status, timed_out.status);
  EXPECT_EQ(core::ReasonOf(decoded_reason->status).metadata.at("rank"), "2");
  for (const std::string bad : {"", "3", "3:", "x:1:a", "3:9:abc", "99:0:", "3:0:", "3:0:5:ab"}) {
    EXPECT_EQ(server::DecodeReply(bad).status().code(), absl::StatusCode::kDataLoss) << bad;
  }
}

// A read of a key that another connection deletes meanwhile (the front deletes each command's
// replies while their ranks may still be watching them) answers "not there" and leaves the
// reader's connection working: c10d's plain TCPStore server closes a connection whose GET names
// a missing key, which took a whole mesh down (a lost store, on every process) now and then.
TEST(StoreTest, AReadRacingADeleteAnswersNotThereAndTheConnectionLives) {
  GroupConfig config;
  config.size = 1;
  config.store_port = testing::FreePort();
  config.timeout = std::chrono::seconds(10);
  auto group = server::ProcessGroup::Join(config);
  ASSERT_TRUE(group.ok()) << group.status();
  auto other = server::OpenStore(config, "commands");  // the group's own prefix
  ASSERT_TRUE(other.ok()) << other.status();
  std::atomic<bool> done{false};
  absl::Status deleter_failed;
  std::thread deleter([&] {
    while (!done.load() && deleter_failed.ok()) {
      deleter_failed = (*other)->Set("racing", "value");
      if (deleter_failed.ok()) deleter_failed = (*other)->Delete("racing");
    }
  });
  // Reads until both outcomes were seen (a value, a key deleted between the wait and the read),
  // at most 20 s; without the fix the first deletion in between cut the connection within ms.
  int read = 0, deleted = 0;
  absl::Status unexpected;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((read == 0 || deleted == 0) && unexpected.ok() &&
         std::chrono::steady_clock::now() < give_up) {
    absl::StatusOr<std::string> got = (*group)->Get("racing", std::chrono::milliseconds(50));
    if (got.ok()) {
      EXPECT_EQ(*got, "value");
      ++read;
    } else if (absl::StrContains(got.status().message(), "deleted while it was read")) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
      ++deleted;
    } else if (got.status().code() != absl::StatusCode::kDeadlineExceeded) {
      unexpected = got.status();  // the connection is gone: every later call would fail too
    }
  }
  done = true;
  deleter.join();
  ASSERT_TRUE(unexpected.ok()) << unexpected;
  ASSERT_TRUE(deleter_failed.ok()) << deleter_failed;
  EXPECT_GT(read, 0);
  EXPECT_GT(deleted, 0) << "the race was never met: the test proved nothing";
  ASSERT_TRUE((*group)->Set("after", "still there").ok());
  absl::StatusOr<std::string> after = (*group)->Get("after", std::chrono::seconds(1));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, "still there");
}

TEST(GroupFlagsTest, FlagsAndTorchrunEnvironment) {
  auto config = server::ResolveGroupConfig({}, {});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->size, 1);
  EXPECT_EQ(config->rank, 0);

  config = server::ResolveGroupConfig(
      {},
      {{"WORLD_SIZE", "4"}, {"RANK", "3"}, {"MASTER_ADDR", "10.0.0.7"}, {"MASTER_PORT", "1234"}});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->size, 4);
  EXPECT_EQ(config->rank, 3);
  EXPECT_EQ(config->store_host, "10.0.0.7");
  EXPECT_EQ(config->store_port, 1234);

  // Flags win over the environment.
  GroupFlags given;
  given.size = 2;
  given.rank = 1;
  given.store = "host:99";
  given.timeout_seconds = 2.5;
  config = server::ResolveGroupConfig(given, {{"WORLD_SIZE", "4"}, {"RANK", "3"}});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->size, 2);
  EXPECT_EQ(config->rank, 1);
  EXPECT_EQ(config->store_host, "host");
  EXPECT_EQ(config->timeout, std::chrono::milliseconds(2500));

  struct Bad {
    GroupFlags flags;
    std::map<std::string, std::string> env;
    std::string message;
  };
  auto flags = [](int size, int rank, const std::string& store, double timeout) {
    GroupFlags f;
    f.size = size;
    f.rank = rank;
    f.store = store;
    f.timeout_seconds = timeout;
    return f;
  };
  const std::string store_help =
      "--group_store: expected host:port of the group's TCPStore (rank 0 serves it); got ";
  std::vector<Bad> bad;
  bad.push_back({flags(-1, -1, "", 60), {}, "--group_size: expected at least 1 process; got -1"});
  bad.push_back({flags(2, 2, "", 60), {}, "--group_rank: expected a rank in [0, 2); got 2"});
  bad.push_back({flags(2, 0, "nohost", 60), {}, store_help + "\"nohost\""});
  bad.push_back({flags(2, 0, "h:70000", 60), {}, store_help + "\"h:70000\""});
  bad.push_back(
      {flags(2, 0, "", 0), {}, "--group_timeout_seconds: expected a value in (0, 86400]; got 0"});
  bad.push_back({flags(0, -1, "", 60),
                 {{"WORLD_SIZE", "two"}},
                 "WORLD_SIZE: expected an integer; got \"two\""});
  for (const Bad& b : bad) {
    auto r = server::ResolveGroupConfig(b.flags, b.env);
    ASSERT_FALSE(r.ok()) << b.message;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), b.message);
  }
}

// -1 alone means "RANK from the environment": any other negative rank is refused naming the
// flag; a rank or size from the environment is named by its variable.
TEST(GroupFlagsTest, OnlyMinusOneTakesTheRankFromTheEnvironment) {
  GroupFlags flags;
  flags.size = 2;
  for (const int rank : {-5, -2, -100}) {
    flags.rank = rank;
    const auto refused = server::ResolveGroupConfig(flags, {{"RANK", "1"}});
    ASSERT_FALSE(refused.ok()) << rank;
    EXPECT_EQ(refused.status().message(),
              absl::StrCat("--group_rank: expected a rank in [0, 2) or -1 (RANK from the "
                           "environment); got ",
                           rank));
  }
  flags.rank = -1;
  auto from_env = server::ResolveGroupConfig(flags, {{"RANK", "1"}});
  ASSERT_TRUE(from_env.ok()) << from_env.status();
  EXPECT_EQ(from_env->rank, 1);
  EXPECT_EQ(server::ResolveGroupConfig(flags, {{"RANK", "-5"}}).status().message(),
            "RANK: expected a rank in [0, 2); got -5");
  EXPECT_EQ(server::ResolveGroupConfig({}, {{"WORLD_SIZE", "0"}}).status().message(),
            "WORLD_SIZE: expected at least 1 process; got 0");
}

// A store reached (or listening) beyond loopback needs a secret, or the operator's word that
// the network is trusted; on loopback the log is checked but not authenticated.
TEST(GroupPlaneTest, AStoreBeyondLoopbackNeedsASecret) {
  GroupConfig config;
  config.size = 2;
  EXPECT_TRUE(server::CheckGroupPlane(config).ok());  // 127.0.0.1
  for (const auto& [host, bind] : std::vector<std::pair<std::string, std::string>>{
           {"10.0.0.7", ""}, {"127.0.0.1", "0.0.0.0"}, {"rank0.example", ""}, {"::1", "::"}}) {
    config.store_host = host;
    config.store_bind = bind;
    const absl::Status refused = server::CheckGroupPlane(config);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << host << " " << bind;
    EXPECT_TRUE(
        absl::StartsWith(refused.message(), "--group_secret_file: expected the group's secret"))
        << refused;
    config.secret = "0123456789abcdef";
    EXPECT_TRUE(server::CheckGroupPlane(config).ok());
    config.secret.clear();
    config.trusted_network = true;
    EXPECT_TRUE(server::CheckGroupPlane(config).ok());
    config.trusted_network = false;
  }
  config.size = 1;  // no group, no store
  EXPECT_TRUE(server::CheckGroupPlane(config).ok());
}

// ProcessGroupNCCL on one GPU: the group of one that a CUDA server builds.
TEST(CudaProcessGroup, OneRankNcclGroupRunsTheCollectives) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: the NCCL group needs one";
  }
  GroupConfig config;
  config.store_port = testing::FreePort();
  config.device = torch::Device(torch::kCUDA, 0);
  auto group = server::ProcessGroup::Join(config);
  ASSERT_TRUE(group.ok()) << group.status();
  torch::Tensor t =
      torch::arange(6, torch::TensorOptions().device(config.device)).to(torch::kFloat);
  auto all = (*group)->AllGather(t);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(torch::equal(all->cpu(), t.cpu().unsqueeze(0)));
  ASSERT_TRUE((*group)->ReduceSum(t, 0).ok());
  ASSERT_TRUE((*group)->Broadcast(t, 0).ok());
  EXPECT_TRUE(torch::equal(t.cpu(), torch::arange(6).to(torch::kFloat)));
}

}  // namespace
}  // namespace remotehead

int main(int argc, char** argv) {
  if (argc == 8 && std::string(argv[1]) == "--as_rank") {
    int size = 0, rank = 0, port = 0;
    double timeout = 0;
    if (!absl::SimpleAtoi(argv[2], &size) || !absl::SimpleAtoi(argv[3], &rank) ||
        !absl::SimpleAtoi(argv[4], &port) || !absl::SimpleAtod(argv[7], &timeout)) {
      return 2;
    }
    return remotehead::RunRank(size, rank, port, argv[5], std::string(argv[6]) == "die", timeout);
  }
  if (argc == 6 && std::string(argv[1]) == "--as_log_rank") {
    int size = 0, rank = 0, port = 0;
    if (!absl::SimpleAtoi(argv[2], &size) || !absl::SimpleAtoi(argv[3], &rank) ||
        !absl::SimpleAtoi(argv[4], &port)) {
      return 2;
    }
    return remotehead::RunLogRank(size, rank, port, argv[5]);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
