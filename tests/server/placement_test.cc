// A process alone as a Placement (group/placement.h): one rank of one, its one shard every row,
// and every collective an identity — so a head operation runs the same code alone as on a head
// group or a mesh (whose placements the group and mesh suites and the cluster tests exercise:
// head_mesh_test, head_group_service_test, tests/python/test_head_group.py, test_mesh*.py).
#include "remotehead/server/group/placement.h"

#include <gtest/gtest.h>

#include <vector>

// Its own namespace: the file is compiled in one unit with the target's other files.
namespace remotehead::server::placement_test {
namespace {

TEST(PlacementAlone, IsOneRankHoldingEveryRow) {
  Placement alone;
  EXPECT_EQ(alone.rank(), 0);
  EXPECT_EQ(alone.size(), 1);
  EXPECT_FALSE(alone.sharded());
  EXPECT_FALSE(alone.replicated());
  const auto ranges = alone.Ranges(17, "vocab_size");
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  EXPECT_EQ(*ranges, (std::vector<core::ShardRange>{{.offset = 0, .rows = 17}}));
  // A vocabulary of one row is still one rank's.
  EXPECT_TRUE(alone.Ranges(1, "vocab_size").ok());
}

TEST(PlacementAlone, AnswersEveryCallLeadsNoClusterAndHasNoDrainToAskFor) {
  Placement alone;
  EXPECT_TRUE(alone.is_front());
  EXPECT_FALSE(alone.leads_cluster());
  EXPECT_STREQ(alone.cluster_name(), "server");
  EXPECT_TRUE(alone.health().ok());
  EXPECT_FALSE(alone.DrainRequested().has_value());
  EXPECT_FALSE(alone.ReplicaDrainRequested().has_value());
  EXPECT_EQ(alone.RequestDrainUp("SIGTERM").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(alone.mesh_reply_timeout().count(), 0);
  EXPECT_FALSE(alone.in_cluster());
  EXPECT_EQ(alone.replica(), 0);
  EXPECT_EQ(alone.replicas(), 1);
  EXPECT_FALSE(alone.is_replica_front());
  EXPECT_FALSE(alone.follows_group());
  EXPECT_FALSE(alone.follows_mesh());
}

TEST(PlacementAlone, ItsCollectivesGiveBackTheirInput) {
  Placement alone;
  const torch::Tensor w = torch::randn({5, 3});
  std::vector<torch::Tensor> shared = {w, torch::arange(4)};
  ASSERT_TRUE(alone.Share(shared).ok());
  EXPECT_TRUE(shared[0].is_same(w));
  ASSERT_TRUE(alone.ShareFromLeader(shared).ok());
  EXPECT_TRUE(shared[0].is_same(w));
  const auto gathered = alone.GatherRows(w, {{.offset = 0, .rows = 5}});
  ASSERT_TRUE(gathered.ok());
  EXPECT_TRUE(gathered->is_same(w));
  const auto summed = alone.SumToFront(w);
  ASSERT_TRUE(summed.ok());
  EXPECT_TRUE(summed->is_same(w));
  torch::Tensor dw = w.clone();
  ASSERT_TRUE(alone.SumOverReplicas(dw).ok());
  EXPECT_TRUE(torch::equal(dw, w));
  // Nothing to compare against, at any version.
  for (const int64_t version : {1, 2, 100}) {
    EXPECT_TRUE(alone.CompareReplicasAt(version, {w}, "weights").ok());
  }
}

}  // namespace
}  // namespace remotehead::server::placement_test
