// The in-process ProcessGroup (in_process_process_group.h) that the mesh's and the group's tests
// run on: its store behaves as C10dGroup's TCPStore (keys under the group's prefix, overwrite,
// a read that waits and times out DEADLINE_EXCEEDED / GROUP_TIMEOUT, deleting a missing key is
// no error, a closed store UNAVAILABLE at once); its collectives combine by rank, count their
// bytes as C10dGroup does, and refuse calls that do not pair up on every rank.
#include "server/in_process_process_group.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "server/in_process_mesh.h"

namespace remotehead::testing {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

server::GroupConfig Config(int size, milliseconds timeout = milliseconds(5000)) {
  server::GroupConfig config;
  config.size = size;
  config.timeout = timeout;
  config.prefix = "test/group";
  return config;
}

// Every member of `group`, taken.
std::vector<std::unique_ptr<server::ProcessGroup>> Members(InProcessProcessGroup& group) {
  std::vector<std::unique_ptr<server::ProcessGroup>> members;
  for (int r = 0; r < group.size(); ++r) members.push_back(group.Take(r));
  return members;
}

TEST(InProcessProcessGroupTest, EachRankIsTakenOnceWithItsOwnConfig) {
  InProcessProcessGroup group(Config(3));
  auto members = Members(group);
  for (int r = 0; r < 3; ++r) {
    ASSERT_NE(members[r], nullptr);
    EXPECT_EQ(members[r]->rank(), r);
    EXPECT_EQ(members[r]->size(), 3);
    EXPECT_EQ(members[r]->config().rank, r);
    EXPECT_EQ(members[r]->config().prefix, "test/group");
  }
  EXPECT_EQ(group.Take(1), nullptr);
  EXPECT_EQ(group.Take(3), nullptr);
}

TEST(InProcessProcessGroupTest, TheStoreKeepsKeysUnderTheGroupsPrefix) {
  auto store = std::make_shared<InProcessStore>();
  InProcessProcessGroup group(Config(2), store);
  auto m = Members(group);
  ASSERT_TRUE(m[0]->Set("cmd/0", "first").ok());
  EXPECT_EQ(store->Peek("test/group/commands/cmd/0"), "first");
  EXPECT_EQ(group.StoreKey("cmd/0"), "test/group/commands/cmd/0");
  EXPECT_EQ(*m[1]->Get("cmd/0", milliseconds(10)), "first");
  ASSERT_TRUE(m[1]->Set("cmd/0", "second").ok());  // overwrites
  EXPECT_EQ(*m[0]->Get("cmd/0", milliseconds(10)), "second");
  EXPECT_TRUE(*m[0]->Exists("cmd/0"));
  ASSERT_TRUE(m[0]->Delete("cmd/0").ok());
  EXPECT_FALSE(*m[1]->Exists("cmd/0"));
  EXPECT_TRUE(m[1]->Delete("cmd/0").ok());  // a missing key: no error, as TCPStore's deleteKey
  // Another group on the same store (another prefix) does not see this one's keys.
  server::GroupConfig other_config = Config(2);
  other_config.prefix = "test/other";
  InProcessProcessGroup other(other_config, store);
  ASSERT_TRUE(m[0]->Set("k", "mine").ok());
  EXPECT_FALSE(*other.Take(0)->Exists("k"));
  EXPECT_EQ(store->Keys("test/"), std::vector<std::string>{"test/group/commands/k"});
}

TEST(InProcessProcessGroupTest, AReadWaitsForItsKey) {
  InProcessProcessGroup group(Config(2));
  auto m = Members(group);
  auto writer = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(milliseconds(50));
    return m[0]->Set("late", "here");
  });
  const absl::StatusOr<std::string> value = m[1]->Get("late", milliseconds(5000));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "here");
  EXPECT_TRUE(writer.get().ok());
}

TEST(InProcessProcessGroupTest, AReadTimesOutAsC10dGroupReportsIt) {
  InProcessProcessGroup group(Config(2));
  auto m = Members(group);
  const auto start = Clock::now();
  const absl::StatusOr<std::string> value = m[1]->Get("never", milliseconds(100));
  EXPECT_GE(Clock::now() - start, milliseconds(90));
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StartsWith(value.status().message(),
                               "head group: store get \"never\" failed on rank 1 of 2: "))
      << value.status();
  const core::ErrorReason reason = core::ReasonOf(value.status());
  EXPECT_EQ(reason.reason, "GROUP_TIMEOUT");
  EXPECT_EQ(reason.metadata.at("op"), "store get \"never\"");
  EXPECT_EQ(reason.metadata.at("rank"), "1");
}

TEST(InProcessProcessGroupTest, AClosedStoreIsUnavailableAtOnceToEveryCall) {
  InProcessProcessGroup group(Config(2));
  auto m = Members(group);
  auto waiting = std::async(std::launch::async, [&] { return m[1]->Get("k", milliseconds(5000)); });
  std::this_thread::sleep_for(milliseconds(20));
  const auto start = Clock::now();
  group.store().Close();
  const absl::StatusOr<std::string> gone = waiting.get();
  EXPECT_LT(Clock::now() - start, milliseconds(1000));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  EXPECT_EQ(core::ReasonOf(gone.status()).reason, "GROUP_UNAVAILABLE");
  EXPECT_EQ(m[0]->Set("k", "v").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(m[0]->Exists("k").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(m[0]->Delete("k").code(), absl::StatusCode::kUnavailable);
}

TEST(InProcessProcessGroupTest, CollectivesCombineByRankAndCountTheirBytes) {
  InProcessProcessGroup group(Config(3));
  auto m = Members(group);
  std::vector<torch::Tensor> gathered(3), reduced(3), broadcast(3), gathered_at_root(3);
  std::vector<absl::Status> failures(3);
  group.RunOnAll([&](int r) {
    const torch::Tensor mine = torch::full({2}, static_cast<float>(r + 1));
    absl::StatusOr<torch::Tensor> all = m[r]->AllGather(mine);
    if (!all.ok()) return void(failures[r] = all.status());
    gathered[r] = *all;
    gathered[r][r].fill_(-1);  // each rank's result its own
    reduced[r] = mine.clone();
    if (absl::Status s = m[r]->ReduceSum(reduced[r], /*root=*/1); !s.ok()) {
      return void(failures[r] = s);
    }
    broadcast[r] = mine.clone();
    if (absl::Status s = m[r]->Broadcast(broadcast[r], /*root=*/2); !s.ok()) {
      return void(failures[r] = s);
    }
    absl::StatusOr<torch::Tensor> at_root = m[r]->Gather(mine, /*root=*/0);
    if (!at_root.ok()) return void(failures[r] = at_root.status());
    gathered_at_root[r] = *at_root;
  });
  const torch::Tensor by_rank = torch::tensor({1.0f, 1.0f, 2.0f, 2.0f, 3.0f, 3.0f}).reshape({3, 2});
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    ASSERT_TRUE(failures[r].ok()) << failures[r];
    torch::Tensor expected = by_rank.clone();
    expected[r].fill_(-1);
    EXPECT_TRUE(torch::equal(gathered[r], expected));
    EXPECT_TRUE(torch::equal(
        reduced[r], r == 1 ? torch::full({2}, 6.0f) : torch::full({2}, static_cast<float>(r + 1))));
    EXPECT_TRUE(torch::equal(broadcast[r], torch::full({2}, 3.0f)));
    EXPECT_EQ(gathered_at_root[r].defined(), r == 0);
    if (r == 0) {
      EXPECT_TRUE(torch::equal(gathered_at_root[r], by_rank));
    }
    // As C10dGroup counts: 8 bytes a tensor, 2 peers.
    const auto bytes = m[r]->Bytes();
    for (const char* op : {"all_gather", "reduce", "broadcast", "gather"}) {
      EXPECT_EQ(bytes.at(op).calls, 1) << op;
    }
    EXPECT_EQ(bytes.at("all_gather").sent, 16);
    EXPECT_EQ(bytes.at("all_gather").received, 16);
    EXPECT_EQ(bytes.at("reduce").sent, r == 1 ? 0 : 8);
    EXPECT_EQ(bytes.at("reduce").received, r == 1 ? 16 : 0);
    EXPECT_EQ(bytes.at("broadcast").sent, r == 2 ? 16 : 0);
    EXPECT_EQ(bytes.at("broadcast").received, r == 2 ? 0 : 8);
    EXPECT_EQ(bytes.at("gather").sent, r == 0 ? 0 : 8);
    EXPECT_EQ(bytes.at("gather").received, r == 0 ? 16 : 0);
  }
}

TEST(InProcessProcessGroupTest, CollectivesThatDoNotPairUpFailOnEveryRank) {
  InProcessProcessGroup group(Config(2));
  auto m = Members(group);
  std::vector<absl::Status> results(2);
  group.RunOnAll([&](int r) {
    torch::Tensor t = torch::ones({3});
    results[r] = r == 0 ? m[r]->ReduceSum(t, 0) : m[r]->AllGather(torch::ones({2})).status();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kInternal) << results[r];
    EXPECT_TRUE(absl::StrContains(results[r].message(),
                                  "rank 0: reduce(root 0) Float[3]; rank 1: all_gather Float[2]"))
        << results[r];
  }
}

TEST(InProcessProcessGroupTest, ARankThatNeverArrivesTimesTheOthersOutAndBreaksTheGroup) {
  InProcessProcessGroup group(Config(3, milliseconds(200)));
  auto m = Members(group);
  const auto start = Clock::now();
  torch::Tensor t = torch::ones({2});
  const absl::Status failed = m[0]->Broadcast(t, 0);  // ranks 1 and 2 never come
  EXPECT_GE(Clock::now() - start, milliseconds(180));
  EXPECT_EQ(failed.code(), absl::StatusCode::kDeadlineExceeded) << failed;
  EXPECT_EQ(core::ReasonOf(failed).reason, "GROUP_TIMEOUT");
  EXPECT_EQ(core::ReasonOf(failed).metadata.at("op"), "broadcast");
  EXPECT_TRUE(absl::StrContains(failed.message(), "head group: broadcast failed on rank 0 of 3"))
      << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "rank(s) 1, 2")) << failed;
  EXPECT_EQ(m[0]->Bytes().count("broadcast"), 0u);  // a failed call is not counted
  const absl::Status late = m[1]->Broadcast(t, 0);
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << late;
  EXPECT_EQ(core::ReasonOf(late).reason, "GROUP_UNAVAILABLE");
}

TEST(InProcessMeshTest, GroupsAndPrefixesAreJoinMeshs) {
  InProcessMesh mesh(3, 2, milliseconds(5000));
  for (int g = 0; g < 6; ++g) {
    SCOPED_TRACE(g);
    const server::GroupConfig config = mesh.config(g);
    EXPECT_EQ(config.replica(), g / 2);
    EXPECT_EQ(config.rank_in_replica(), g % 2);
    server::ProcessGroup::Mesh joined = mesh.Join(g);
    ASSERT_NE(joined.replica, nullptr);
    ASSERT_NE(joined.shard, nullptr);
    EXPECT_EQ(joined.replica->rank(), g % 2);
    EXPECT_EQ(joined.replica->size(), 2);
    EXPECT_EQ(joined.replica->config().prefix, absl::StrCat("remotehead/replica/", g / 2));
    EXPECT_EQ(joined.shard->rank(), g / 2);
    EXPECT_EQ(joined.shard->size(), 3);
    EXPECT_EQ(joined.shard->config().prefix, absl::StrCat("remotehead/shard/", g % 2));
  }
  InProcessMesh single(2, 1, milliseconds(5000));
  EXPECT_EQ(single.Join(1).replica, nullptr);
}

}  // namespace
}  // namespace remotehead::testing
