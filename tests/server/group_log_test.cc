// The head group's command log against a stranger who can read, write and delete the store's
// keys (as anyone who reaches a TCPStore can): a forged, garbage or replayed command is refused
// and logged, never taken; a forged or replayed reply is never taken as a rank's answer (so a
// stale reply is never the answer to the next command); an entry recorded from an earlier run of
// the group never verifies; a pending command overwritten or deleted, or a rank's reply overwritten
// or deleted after it was written, fails the front at once naming the key (never waited out);
// ranks with different secrets do not open the log; the front's "down" declaration reaches the
// others and a forged one is refused. The store is an in-memory one shared by threads
// (in_process_store.h; the collectives are not used); process_group_test and group_plane_test
// run the same log over c10d's TCPStore.
#include "remotehead/server/group/group_log.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "server/in_process_store.h"

namespace remotehead::server {
namespace {

using std::chrono::milliseconds;

constexpr char kSecret[] = "a-secret-of-the-group-0123456789";

// One rank's view of the group: the store only (the log uses nothing else).
class StoreOnlyGroup final : public ProcessGroup {
 public:
  StoreOnlyGroup(testing::InProcessStore* store, int rank, int size) : store_(store) {
    config_.rank = rank;
    config_.size = size;
    config_.timeout = milliseconds(2000);
  }
  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  const GroupConfig& config() const override { return config_; }
  absl::Status Set(const std::string& key, const std::string& value) override {
    return store_->Set(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, milliseconds timeout) override {
    return store_->Get(key, timeout);
  }
  absl::Status Delete(const std::string& key) override { return store_->Delete(key); }
  absl::StatusOr<bool> Exists(const std::string& key) override { return store_->Exists(key); }
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    return store_->CompareSet(key, expected, desired);
  }
  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor&) override { return Unused(); }
  absl::Status ReduceSum(torch::Tensor&, int) override { return Unused(); }
  absl::Status Broadcast(torch::Tensor&, int) override { return Unused(); }
  absl::StatusOr<torch::Tensor> Gather(const torch::Tensor&, int) override { return Unused(); }
  std::map<std::string, CollectiveBytes> Bytes() const override { return {}; }

 private:
  static absl::Status Unused() { return absl::UnimplementedError("no collectives here"); }
  testing::InProcessStore* store_;
  GroupConfig config_;
};

// A front (rank 0) and a follower (rank 1) on one store, their logs open.
struct Pair {
  explicit Pair(testing::InProcessStore* store, const std::string& front_secret = kSecret,
                const std::string& follower_secret = kSecret)
      : front_group(store, 0, 2),
        follower_group(store, 1, 2),
        front(&front_group, front_secret, &front_log),
        follower(&follower_group, follower_secret, &follower_log) {}

  // Both logs opened together (each waits for the other's nonce).
  std::pair<absl::Status, absl::Status> Open() {
    auto other = std::async(std::launch::async, [&] { return follower.Open(); });
    const absl::Status mine = front.Open();
    return {mine, other.get()};
  }

  StoreOnlyGroup front_group, follower_group;
  std::ostringstream front_log, follower_log;
  GroupLog front, follower;
};

TEST(GroupLogTest, CommandsAndRepliesRoundTripInOrder) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  for (int i = 0; i < 3; ++i) {
    const std::string command = absl::StrCat("command ", i);
    auto seq = p.front.Append(command);
    ASSERT_TRUE(seq.ok()) << seq.status();
    EXPECT_EQ(*seq, i);
    auto taken = p.follower.Next(milliseconds(500));
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_EQ(*taken, command);
    ASSERT_TRUE(p.follower.Reply({absl::OkStatus(), "did " + command}).ok());
    auto replies = p.front.AwaitReplies(*seq);
    ASSERT_TRUE(replies.ok()) << replies.status();
    EXPECT_EQ(*replies, std::vector<std::string>{"did " + command});
  }
  EXPECT_EQ(p.front_log.str(), "");
  EXPECT_EQ(p.follower_log.str(), "");
}

TEST(GroupLogTest, AStrangersCommandIsRefusedAndLoggedNeverTaken) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  // What a stranger can write: garbage, and an unsealed command at the key the follower reads.
  for (const std::string& forged : {std::string("x"), std::string(200, 'A'),
                                    std::string("\x0a\x05\x0a\x03"
                                                "evil",
                                                9)}) {
    ASSERT_TRUE(store.Set("cmd/0", forged).ok());
    const auto taken = p.follower.Next(milliseconds(100));
    EXPECT_EQ(taken.status().code(), absl::StatusCode::kDeadlineExceeded) << taken.status();
  }
  EXPECT_TRUE(absl::StrContains(p.follower_log.str(), "refused the entry at \"cmd/0\""))
      << p.follower_log.str();
  // The front's own command at that key is then taken, as command 0.
  auto seq = p.front.Append("real");
  ASSERT_TRUE(seq.ok());
  auto taken = p.follower.Next(milliseconds(500));
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(*taken, "real");
}

TEST(GroupLogTest, AReplayedCommandIsRefused) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(p.front.Append("zero gradients").ok());
  const std::string recorded = *store.Peek("cmd/0");
  ASSERT_EQ(*p.follower.Next(milliseconds(500)), "zero gradients");
  ASSERT_TRUE(p.follower.Reply({}).ok());
  ASSERT_TRUE(p.front.AwaitReplies(0).ok());
  // The authentic command 0, copied where command 1 goes: refused, not run twice.
  ASSERT_TRUE(store.Set("cmd/1", recorded).ok());
  EXPECT_EQ(p.follower.Next(milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(p.follower_log.str(), "a replay")) << p.follower_log.str();
}

TEST(GroupLogTest, AForgedOrStaleReplyIsNeverTheAnswer) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(p.front.Append("first").ok());
  ASSERT_TRUE(p.follower.Next(milliseconds(500)).ok());
  ASSERT_TRUE(p.follower.Reply({absl::OkStatus(), "answer to first"}).ok());
  const std::string stale = *store.Peek("reply/0/1");
  ASSERT_TRUE(p.front.AwaitReplies(0).ok());

  // Command 1: before the follower answers, a stranger puts an OK reply there (unsealed), then
  // the follower's stale reply to command 0. Neither is taken: the front waits for the real one.
  ASSERT_TRUE(p.front.Append("second").ok());
  ASSERT_TRUE(store.Set("reply/1/1", "0:0:").ok());
  auto early = p.front.AwaitReplies(1, milliseconds(150));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable) << early.status();
  EXPECT_TRUE(absl::StrContains(early.status().message(), "rank 1 of 2 did not reply"));
  ASSERT_TRUE(p.front.Append("third").ok());
  ASSERT_TRUE(store.Set("reply/2/1", stale).ok());
  EXPECT_EQ(p.front.AwaitReplies(2, milliseconds(150)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(p.front_log.str(), "refused the entry at \"reply/1/1\""));
  EXPECT_TRUE(absl::StrContains(p.front_log.str(), "refused the entry at \"reply/2/1\""));
}

TEST(GroupLogTest, TheRealReplyIsTakenAfterARefusedOne) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(p.front.Append("step").ok());
  ASSERT_TRUE(store.Set("reply/0/1", "0:0:forged").ok());
  auto replies = std::async(std::launch::async, [&] { return p.front.AwaitReplies(0); });
  std::this_thread::sleep_for(milliseconds(100));
  ASSERT_EQ(*p.follower.Next(milliseconds(500)), "step");
  ASSERT_TRUE(p.follower.Reply({absl::InvalidArgumentError("bad step"), "real"}).ok());
  const auto got = replies.get();
  EXPECT_EQ(got.status(), absl::InvalidArgumentError("head group rank 1: bad step"));
}

TEST(GroupLogTest, EntriesOfAnEarlierRunNeverVerify) {
  testing::InProcessStore earlier_store, store;
  Pair earlier(&earlier_store);
  ASSERT_EQ(earlier.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(earlier.front.Append("create head").ok());
  const std::string recorded = *earlier_store.Peek("cmd/0");

  // The same group (same secret) started again: the recorded command 0 is refused.
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(store.Set("cmd/0", recorded).ok());
  EXPECT_EQ(p.follower.Next(milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(p.follower_log.str(), "does not verify"));
}

// The front's failure for a key tampered with: UNAVAILABLE at once (far within `wait`), naming
// the full store key, with GROUP_UNAVAILABLE and the key as metadata, and logged.
void ExpectTampered(const absl::StatusOr<std::vector<std::string>>& replies,
                    std::chrono::steady_clock::time_point start, const std::string& key,
                    const std::string& how, const std::string& front_log) {
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
  ASSERT_EQ(replies.status().code(), absl::StatusCode::kUnavailable) << replies.status();
  const std::string full = absl::StrCat("remotehead/commands/", key);
  const std::string said = absl::StrCat("store key \"", full, "\"");
  EXPECT_TRUE(absl::StrContains(replies.status().message(), said)) << replies.status();
  EXPECT_TRUE(absl::StrContains(replies.status().message(),
                                absl::StrCat(how, " by someone without the group's secret")))
      << replies.status();
  const std::optional<core::ErrorReason> reason = core::GetReason(replies.status());
  ASSERT_TRUE(reason.has_value());
  EXPECT_EQ(reason->reason, core::reason::kGroupUnavailable);
  EXPECT_EQ(reason->metadata.at("key"), full);
  EXPECT_TRUE(absl::StrContains(front_log, said)) << front_log;
}

TEST(GroupLogTest, ACommandDeletedBeforeTheFollowerTookItFailsTheFrontAtOnceNamingTheKey) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(p.front.Append("zero gradients").ok());
  ASSERT_TRUE(store.Delete("cmd/0").ok());  // the stranger's doing: the follower never sees it
  EXPECT_EQ(p.follower.Next(milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  const auto start = std::chrono::steady_clock::now();
  const auto replies = p.front.AwaitReplies(0, milliseconds(20000));
  ExpectTampered(replies, start, "cmd/0", "deleted", p.front_log.str());
}

TEST(GroupLogTest, APendingCommandOverwrittenFailsTheFrontAtOnceAndIsNeverTaken) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(p.front.Append("zero gradients").ok());
  const std::string recorded = *store.Peek("cmd/0");
  ASSERT_TRUE(p.follower.Next(milliseconds(500)).ok());
  ASSERT_TRUE(p.follower.Reply({}).ok());
  ASSERT_TRUE(p.front.AwaitReplies(0).ok());
  // Command 1 appended; the follower (stopped, say) has not taken it; a stranger overwrites it,
  // even with the authentic command 0 (a replay).
  ASSERT_TRUE(p.front.Append("step").ok());
  ASSERT_TRUE(store.Set("cmd/1", recorded).ok());
  const auto start = std::chrono::steady_clock::now();
  const auto replies = p.front.AwaitReplies(1, milliseconds(20000));
  ExpectTampered(replies, start, "cmd/1", "overwritten", p.front_log.str());
  // The follower still refuses it.
  EXPECT_EQ(p.follower.Next(milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(p.follower_log.str(), "refused the entry at \"cmd/1\""));
}

TEST(GroupLogTest, AReplyOverwrittenAfterTheRankWroteItIsReportedAndFailsTheFrontAtOnce) {
  for (const bool deleted : {false, true}) {
    testing::InProcessStore store;
    Pair p(&store);
    ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
    ASSERT_TRUE(p.front.Append("step").ok());
    ASSERT_TRUE(p.follower.Next(milliseconds(500)).ok());
    ASSERT_TRUE(p.follower.Reply({absl::OkStatus(), "real"}).ok());
    // Before the front read it, a stranger overwrites (or deletes) the rank's reply.
    ASSERT_TRUE((deleted ? store.Delete("reply/0/1") : store.Set("reply/0/1", "0:0:forged")).ok());
    const auto start = std::chrono::steady_clock::now();
    auto replies = std::async(std::launch::async,
                              [&] { return p.front.AwaitReplies(0, milliseconds(20000)); });
    // The follower, waiting for the next command, finds its reply changed and reports it.
    EXPECT_EQ(p.follower.Next(milliseconds(300)).status().code(),
              absl::StatusCode::kDeadlineExceeded);
    const std::string how = deleted ? "deleted" : "overwritten";
    const auto got = replies.get();
    ExpectTampered(got, start, "reply/0/1", how, p.front_log.str());
    EXPECT_TRUE(
        absl::StrContains(p.follower_log.str(), "store key \"remotehead/commands/reply/0/1\""))
        << p.follower_log.str();
  }
}

TEST(GroupLogTest, ATakenReplyDeletedByTheFrontIsNotReported) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(p.front.Append("step").ok());
    ASSERT_TRUE(p.follower.Next(milliseconds(500)).ok());
    ASSERT_TRUE(p.follower.Reply({}).ok());
    ASSERT_TRUE(p.front.AwaitReplies(i).ok());
    // Idle: the follower's watch sees its reply taken (the command's key went first).
    EXPECT_EQ(p.follower.Next(milliseconds(300)).status().code(),
              absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_FALSE(store.Peek("tampered/1").has_value());
  EXPECT_EQ(p.follower_log.str(), "");
}

TEST(GroupLogTest, AReportAboutAReplyTheFrontTookChangesNothing) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(p.front.Append("first").ok());
  ASSERT_TRUE(p.follower.Next(milliseconds(500)).ok());
  ASSERT_TRUE(p.follower.Reply({}).ok());
  ASSERT_TRUE(p.front.AwaitReplies(0).ok());
  // Taken and deleted; then a stranger writes both keys back: the follower reports it ...
  ASSERT_TRUE(store.Set("cmd/0", "x").ok());
  ASSERT_TRUE(store.Set("reply/0/1", "0:0:").ok());
  EXPECT_EQ(p.follower.Next(milliseconds(300)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(store.Peek("tampered/1").has_value()) << p.follower_log.str();
  // ... and the front, which had taken that reply, goes on: the next command is answered.
  ASSERT_TRUE(p.front.Append("second").ok());
  auto replies = std::async(std::launch::async, [&] { return p.front.AwaitReplies(1); });
  std::this_thread::sleep_for(milliseconds(250));  // the front's watch reads the report
  ASSERT_TRUE(p.follower.Next(milliseconds(500)).ok());
  ASSERT_TRUE(p.follower.Reply({absl::OkStatus(), "two"}).ok());
  const auto got = replies.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, std::vector<std::string>{"two"});
}

TEST(GroupLogTest, AStrangersEntryAtTheReportsKeyFailsTheFront) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  ASSERT_TRUE(p.front.Append("step").ok());
  ASSERT_TRUE(store.Set("tampered/1", "nothing sealed").ok());
  const auto start = std::chrono::steady_clock::now();
  const auto replies = p.front.AwaitReplies(0, milliseconds(20000));
  ExpectTampered(replies, start, "tampered/1", "written", p.front_log.str());
}

TEST(GroupLogTest, RanksWithDifferentSecretsDoNotOpenTheLog) {
  testing::InProcessStore store;
  Pair p(&store, kSecret, "another-secret-0123456789abcdef");
  const auto [front, follower] = p.Open();
  EXPECT_EQ(front.code(), absl::StatusCode::kPermissionDenied) << front;
  EXPECT_TRUE(absl::StrContains(front.message(), "rank 1's nonce does not verify")) << front;
  EXPECT_TRUE(absl::StrContains(front.message(), "--group_secret_file")) << front;
  EXPECT_EQ(follower.code(), absl::StatusCode::kPermissionDenied) << follower;
}

TEST(GroupLogTest, TheFrontsDeclarationReachesTheOthersAndAForgedOneIsRefused) {
  testing::InProcessStore store;
  Pair p(&store);
  ASSERT_EQ(p.Open(), std::make_pair(absl::OkStatus(), absl::OkStatus()));
  auto none = p.follower.DownDeclared();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  ASSERT_TRUE(store.Set("down", "the stranger says so").ok());
  none = p.follower.DownDeclared();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  EXPECT_TRUE(absl::StrContains(p.follower_log.str(), "refused the entry at \"down\""));
  ASSERT_TRUE(p.front.DeclareDown("rank 1 of 2 did not reply to command 4").ok());
  auto declared = p.follower.DownDeclared();
  ASSERT_TRUE(declared.ok());
  ASSERT_TRUE(declared->has_value());
  EXPECT_EQ(**declared, "rank 1 of 2 did not reply to command 4");
}

}  // namespace
}  // namespace remotehead::server
