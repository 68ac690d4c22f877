// A mesh's epochs (mesh_epoch.h) and the eviction that enters them (Liveness::Evict / Adopt):
// the assignment of trainers to serving replicas, the record's encoding, and — with R·K
// processes' liveness in one process over one in-process store — one epoch settled for every
// process by whichever names the loss, a process of the evicted replica going down, the limits
// (replica 0 unless the store is external, --mesh_min_replicas), and a stranger's record refused.
#include "remotehead/server/group/mesh_epoch.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/server/group/liveness.h"
#include "server/in_process_mesh.h"
#include "server/in_process_store.h"

namespace remotehead::server {
namespace {

using std::chrono::milliseconds;

TEST(MeshEpochTest, TrainersStayWithTheirReplicaUntilItIsEvictedThenGoToTheServingOnes) {
  const MeshEpoch first = MeshEpoch::First(3);
  EXPECT_EQ(first.number, 0);
  EXPECT_EQ(first.live, (std::vector<int>{0, 1, 2}));
  for (int t = 0; t < 7; ++t) EXPECT_EQ(first.ReplicaOf(t, 3), t % 3) << t;

  const MeshEpoch second = first.Without(1, "global rank 1 is lost");
  EXPECT_EQ(second.number, 1);
  EXPECT_EQ(second.live, (std::vector<int>{0, 2}));
  EXPECT_EQ(second.evicted, 1);
  EXPECT_FALSE(second.serves(1));
  EXPECT_EQ(second.IndexOf(2), 1);
  EXPECT_EQ(second.IndexOf(1), -1);
  // Trainers of serving replicas stay; replica 1's (t = 1, 4, 7) go to live[t mod 2].
  EXPECT_EQ(second.ReplicaOf(0, 3), 0);
  EXPECT_EQ(second.ReplicaOf(2, 3), 2);
  EXPECT_EQ(second.ReplicaOf(1, 3), 2);
  EXPECT_EQ(second.ReplicaOf(4, 3), 0);
  EXPECT_EQ(second.ReplicaOf(7, 3), 2);
  EXPECT_EQ(second.TrainersOf(0, 8, 3), (std::vector<int>{0, 3, 4, 6}));
  EXPECT_EQ(second.TrainersOf(2, 8, 3), (std::vector<int>{1, 2, 5, 7}));
  EXPECT_TRUE(second.TrainersOf(1, 8, 3).empty());
  EXPECT_EQ(second.Describe(), "epoch 1 (replicas [0, 2] serve; replica 1 evicted)");
  EXPECT_EQ(second.Moves(3),
            "trainers t with t mod 3 = 1 now go to replica 0 (t mod 2 = 0) and replica 2 (t mod "
            "2 = 1)");
  EXPECT_EQ(MeshEpoch::First(2).Without(1, "").Moves(2),
            "trainers t with t mod 2 = 1 now go to replica 0");
  // Admitted again: every trainer back at replica t mod R.
  const MeshEpoch third = second.With(1, "replica 1 rejoined");
  // The admitted replica is the newest member: last (the leader stays first).
  EXPECT_EQ(third.Describe(), "epoch 2 (replicas [0, 2, 1] serve; replica 1 admitted)");
  EXPECT_EQ(third.leader(), 0);
  EXPECT_EQ(third.Moves(3), "trainers t with t mod 3 = 1 go back to replica 1 once it is healed");
  for (int t = 0; t < 6; ++t) EXPECT_EQ(third.ReplicaOf(t, 3), t % 3);
}

TEST(MeshEpochTest, TheFirstServingReplicaLeadsAndLeadsOnWhenTheOldLeaderComesBack) {
  // With an external store replica 0 may be evicted: replica 1 leads from then on.
  const MeshEpoch first = MeshEpoch::First(3);
  EXPECT_EQ(first.leader(), 0);
  const MeshEpoch second = first.Without(0, "global rank 0 is lost");
  EXPECT_EQ(second.leader(), 1);
  EXPECT_EQ(second.IndexOf(1), 0);  // rank 0 of the epoch's groups: the root of sums and heals
  EXPECT_EQ(second.ReplicaOf(0, 3), 1);
  EXPECT_EQ(second.ReplicaOf(3, 3), 2);
  const MeshEpoch third = second.With(0, "replica 0 asked to join");
  EXPECT_EQ(third.live, (std::vector<int>{1, 2, 0}));
  EXPECT_EQ(third.leader(), 1);
  EXPECT_EQ(third.IndexOf(0), 2);
  for (int t = 0; t < 6; ++t) EXPECT_EQ(third.ReplicaOf(t, 3), t % 3);
  const absl::StatusOr<MeshEpoch> decoded = MeshEpoch::Decode(third.Encode());
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->live, third.live);
  EXPECT_EQ(decoded->leader(), 1);
}

TEST(MeshEpochTest, TheRecordRoundTripsAndAnythingElseIsRefused) {
  const MeshEpoch second = MeshEpoch::First(3).Without(1, "global rank 1 is lost: no heartbeat");
  const absl::StatusOr<MeshEpoch> decoded = MeshEpoch::Decode(second.Encode());
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->number, 1);
  EXPECT_EQ(decoded->live, second.live);
  EXPECT_EQ(decoded->evicted, 1);
  EXPECT_EQ(decoded->cause, second.cause);
  EXPECT_EQ(decoded->admitted, -1);
  const MeshEpoch third = second.With(1, "replica 1 asked to join");
  const absl::StatusOr<MeshEpoch> healed = MeshEpoch::Decode(third.Encode());
  ASSERT_TRUE(healed.ok()) << healed.status();
  EXPECT_EQ(healed->number, 2);
  EXPECT_EQ(healed->live, (std::vector<int>{0, 2, 1}));
  EXPECT_EQ(healed->admitted, 1);
  EXPECT_EQ(healed->evicted, -1);
  for (const std::string bad : {"", "1 1", "0 1 0 -1\n", "1 1 \n", "1 1 2,2 -1\n", "x 1 0 -1\n",
                                "1 1 -1 -1\n", "1 1 0\n", "1 1 0 x\n"}) {
    const absl::StatusOr<MeshEpoch> refused = MeshEpoch::Decode(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << "\"" << bad << "\"";
  }
}

// R·K processes' liveness (as JoinCluster starts it) over one in-process store, evicting.
class Evicting {
 public:
  Evicting(int replicas, int k, int min_replicas, EvictionCap cap = {}, bool external_store = false)
      : groups_(replicas, k, milliseconds(5000)), logs_(static_cast<size_t>(replicas * k)) {
    for (int g = 0; g < replicas * k; ++g) {
      GroupConfig config = groups_.config(g);
      config.store_external = external_store;
      absl::StatusOr<std::unique_ptr<Liveness>> started = Liveness::Start(
          config, &logs_[static_cast<size_t>(g)],
          Liveness::Timing{
              .beat = milliseconds(50), .stalled = milliseconds(300), .lost = milliseconds(800)},
          std::make_unique<testing::InProcessKeyValueStore>(groups_.shared_store(),
                                                            config.prefix + "/liveness"));
      EXPECT_TRUE(started.ok()) << started.status();
      processes_.push_back(*std::move(started));
      processes_.back()->epochs().Enable(min_replicas, cap);
    }
  }
  Liveness& at(int g) { return *processes_[static_cast<size_t>(g)]; }
  void Kill(int g) { processes_[static_cast<size_t>(g)].reset(); }  // its beats stop
  std::string log(int g) { return logs_[static_cast<size_t>(g)].str(); }
  testing::InProcessStore& store() { return *groups_.shared_store(); }
  std::string prefix() const { return groups_.config(0).prefix + "/liveness/"; }
  // Waits (up to 5 s) until `g` is in epoch `number`.
  bool ReachEpoch(int g, int number) {
    for (int i = 0; i < 500 && at(g).epochs().current().number < number; ++i) {
      std::this_thread::sleep_for(milliseconds(10));
    }
    return at(g).epochs().current().number == number;
  }

 private:
  testing::InProcessMesh groups_;
  std::vector<std::ostringstream> logs_;
  std::vector<std::unique_ptr<Liveness>> processes_;
};

absl::Status LostVerdict(int rank) {
  return core::WithReason(absl::UnavailableError(absl::StrCat("global rank ", rank, " is lost")),
                          core::reason::kGroupUnavailable, {{"lost_rank", absl::StrCat(rank)}});
}

TEST(MeshEvictionTest, ALossNamedByOneProcessEvictsItsReplicaForEveryProcess) {
  Evicting mesh(/*replicas=*/3, /*k=*/2, /*min_replicas=*/1);
  std::vector<MeshEpoch> entered;
  std::mutex mu;
  mesh.at(2).epochs().OnEpoch([&](const MeshEpoch& e) {
    std::lock_guard<std::mutex> lock(mu);
    entered.push_back(e);
  });
  // Rank 3 (replica 1, shard 1) is named lost by rank 0: the mesh goes on, nobody is down.
  mesh.at(0).DeclareDown(LostVerdict(3));
  EXPECT_TRUE(mesh.at(0).health().ok()) << mesh.at(0).health();
  EXPECT_EQ(mesh.at(0).epochs().current().live, (std::vector<int>{0, 2}));
  EXPECT_TRUE(mesh.at(0).epochs().NamesEvicted(LostVerdict(3)));
  EXPECT_FALSE(mesh.at(0).epochs().NamesEvicted(LostVerdict(4)));
  for (int g : {1, 4, 5}) {
    ASSERT_TRUE(mesh.ReachEpoch(g, 1)) << g;
    EXPECT_TRUE(mesh.at(g).health().ok()) << g;
    EXPECT_EQ(mesh.at(g).epochs().current().evicted, 1) << g;
  }
  // Replica 1's live process is evicted: down, naming the epoch.
  ASSERT_TRUE(mesh.ReachEpoch(2, 1));
  const absl::Status evicted = mesh.at(2).health();
  EXPECT_EQ(evicted.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(evicted.message().find("this process's replica 1 was evicted"), std::string::npos)
      << evicted;
  EXPECT_EQ(core::ReasonOf(evicted).metadata["epoch"], "1");
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(entered.size(), 1u);
    EXPECT_EQ(entered[0].evicted, 1);
  }
  // The same loss named again, by another process: the same epoch, not a second one.
  mesh.at(4).DeclareDown(LostVerdict(2));
  EXPECT_EQ(mesh.at(4).epochs().current().number, 1);
  EXPECT_NE(mesh.log(0).find("replica 1 evicted; the mesh goes on in epoch 1 (replicas [0, 2] "
                             "serve; replica 1 evicted); trainers t with t mod 3 = 1 now go to "
                             "replica 0 (t mod 2 = 0) and replica 2 (t mod 2 = 1)"),
            std::string::npos)
      << mesh.log(0);
  // The record is sealed: not the bare words a process outside the group could write.
  const std::optional<std::string> record = mesh.store().Peek(mesh.prefix() + "settled/epoch/1");
  ASSERT_TRUE(record.has_value());
  EXPECT_NE(record->rfind("1 1 0,2", 0), 0u);
}

TEST(MeshEvictionTest, AProcessWhoseBeatStopsIsEvictedWithoutAnyFailure) {
  Evicting mesh(/*replicas=*/2, /*k=*/1, /*min_replicas=*/1);
  mesh.Kill(1);
  ASSERT_TRUE(mesh.ReachEpoch(0, 1));
  EXPECT_TRUE(mesh.at(0).health().ok()) << mesh.at(0).health();
  EXPECT_EQ(mesh.at(0).epochs().current().live, (std::vector<int>{0}));
  EXPECT_NE(mesh.log(0).find("global rank 1 (replica 1, shard 0"), std::string::npos)
      << mesh.log(0);
}

TEST(MeshEvictionTest, AFailureBlamedWhileItsReplicaIsEvictedNamesThatReplicaNotTheMesh) {
  Evicting mesh(/*replicas=*/2, /*k=*/1, /*min_replicas=*/1);
  // A collective failed; its blame waits for evidence (every beat goes on)…
  absl::Status blamed;
  std::thread blaming([&] {
    blamed = mesh.at(0).Blame(absl::UnavailableError("all_gather failed: connection closed"));
  });
  std::this_thread::sleep_for(milliseconds(100));
  // …while the loss is named and replica 1 evicted (no longer watched: no beat to blame).
  mesh.at(0).DeclareDown(LostVerdict(1));
  blaming.join();
  EXPECT_EQ(core::ReasonOf(blamed).metadata["lost_rank"], "1") << blamed;
  EXPECT_TRUE(mesh.at(0).epochs().NamesEvicted(blamed));
  mesh.at(0).DeclareDown(blamed);  // as the failed collective's caller does: no verdict
  EXPECT_TRUE(mesh.at(0).health().ok()) << mesh.at(0).health();
  EXPECT_EQ(mesh.at(0).epochs().current().number, 1);
}

TEST(MeshEvictionTest, ReplicaZeroAndALossBelowTheMinimumTakeTheMeshDownAsBefore) {
  {
    Evicting mesh(/*replicas=*/3, /*k=*/1, /*min_replicas=*/1);
    mesh.at(1).DeclareDown(LostVerdict(0));  // the store's process, the leader's replica
    EXPECT_EQ(mesh.at(1).epochs().current().number, 0);
    EXPECT_EQ(mesh.at(1).health().code(), absl::StatusCode::kUnavailable);
  }
  {
    Evicting mesh(/*replicas=*/3, /*k=*/1, /*min_replicas=*/2);
    mesh.at(0).DeclareDown(LostVerdict(2));  // 2 serve: allowed
    EXPECT_EQ(mesh.at(0).epochs().current().number, 1);
    EXPECT_TRUE(mesh.at(0).health().ok());
    mesh.at(0).DeclareDown(LostVerdict(1));  // 1 would serve: below the minimum
    EXPECT_EQ(mesh.at(0).epochs().current().number, 1);
    EXPECT_EQ(mesh.at(0).health().code(), absl::StatusCode::kUnavailable);
  }
  {
    Evicting mesh(/*replicas=*/2, /*k=*/1, /*min_replicas=*/0);  // no eviction: as before
    EXPECT_FALSE(mesh.at(0).epochs().evicts());
    mesh.at(0).DeclareDown(LostVerdict(1));
    EXPECT_EQ(mesh.at(0).epochs().current().number, 0);
    EXPECT_EQ(mesh.at(0).health().code(), absl::StatusCode::kUnavailable);
  }
}

TEST(MeshEvictionTest, WithAnExternalStoreReplicaZeroIsEvictedAndReplicaOneLeads) {
  Evicting mesh(/*replicas=*/2, /*k=*/2, /*min_replicas=*/1, {}, /*external_store=*/true);
  mesh.at(3).DeclareDown(LostVerdict(1));  // rank 1 of replica 0 (not its front)
  for (int g : {2, 3}) {
    ASSERT_TRUE(mesh.ReachEpoch(g, 1)) << g;
    EXPECT_TRUE(mesh.at(g).health().ok()) << g;
    EXPECT_EQ(mesh.at(g).epochs().current().live, (std::vector<int>{1})) << g;
    EXPECT_EQ(mesh.at(g).epochs().current().leader(), 1) << g;
  }
  ASSERT_TRUE(mesh.ReachEpoch(0, 1));
  EXPECT_NE(mesh.at(0).health().message().find("this process's replica 0 was evicted"),
            std::string::npos)
      << mesh.at(0).health();
}

TEST(MeshEvictionTest, PastTheCapALossTakesTheMeshDownInsteadOfEvictingAgain) {
  Evicting mesh(/*replicas=*/4, /*k=*/1, /*min_replicas=*/1,
                {.evictions = 1, .window = std::chrono::seconds(3600)});
  mesh.at(0).DeclareDown(LostVerdict(3));
  EXPECT_EQ(mesh.at(0).epochs().current().number, 1);
  EXPECT_TRUE(mesh.at(0).health().ok());
  mesh.at(0).DeclareDown(LostVerdict(2));  // a second within the window: a cascade
  EXPECT_EQ(mesh.at(0).epochs().current().number, 1);
  EXPECT_EQ(mesh.at(0).health().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(mesh.log(0).find("1 replica(s) were evicted within the last 3600 s "
                             "(--mesh_max_evictions 1): no more evictions; the mesh goes down"),
            std::string::npos)
      << mesh.log(0);
}

TEST(MeshEvictionTest, AStrangersEpochRecordIsNeverEntered) {
  Evicting mesh(/*replicas=*/2, /*k=*/1, /*min_replicas=*/1);
  ASSERT_TRUE(
      mesh.store().Set(mesh.prefix() + "settled/epoch/1", "1 1 0\nforged by a stranger").ok());
  std::this_thread::sleep_for(milliseconds(300));  // several beats read it
  EXPECT_EQ(mesh.at(0).epochs().current().number, 0);
  EXPECT_EQ(mesh.at(1).epochs().current().number, 0);
  EXPECT_TRUE(mesh.at(1).health().ok());
  // A real loss now cannot settle over it: the mesh is down, as without eviction.
  mesh.at(0).DeclareDown(LostVerdict(1));
  EXPECT_EQ(mesh.at(0).epochs().current().number, 0);
  EXPECT_EQ(mesh.at(0).health().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace remotehead::server
