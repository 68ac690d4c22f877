// A mesh step's commit decision (replica_step.h, HeadMesh::Decide): after its sum every rank of
// every replica proposes "apply" under the step's name, the store settles one value by
// compare-and-set, and a rank applies only on reading "apply". In one process (R replicas of K
// ranks, their groups and liveness in-process over one store), each replica's part run as the
// reduce_step command runs it on its ranks (ReplicaStep, every rank at once).
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "replication/replica_step.h"
#include "server/mesh_replicas.h"

namespace remotehead::server {
namespace {

using namespace mesh_testing;  // NOLINT: the fixture of this file

// Every rank of every replica runs its part of the step `attempt` at once; the fronts' answers.
std::vector<absl::StatusOr<HeadDescription>> StepEveryRank(Replicas& m, const std::string& attempt,
                                                           const OptimizerStepSpec& spec) {
  std::vector<absl::StatusOr<HeadDescription>> results(static_cast<size_t>(m.size()),
                                                       absl::UnknownError("not run"));
  std::vector<std::thread> ranks;
  for (int g = 0; g < m.size(); ++g) {
    ranks.emplace_back([&, g] {
      results[static_cast<size_t>(g)] = ReplicaStep(*m.at(g).local, kHead, spec, attempt);
    });
  }
  for (std::thread& t : ranks) t.join();
  std::vector<absl::StatusOr<HeadDescription>> fronts;
  for (int r = 0; r < m.replicas(); ++r) {
    fronts.push_back(results[static_cast<size_t>(r * m.ranks_per_replica())]);
  }
  return fronts;
}

std::string DecisionKey(Replicas& m, const std::string& attempt) {
  return absl::StrCat(m.liveness_prefix(), "settled/decision/", attempt);
}

TEST(MeshDecisionTest, EveryRankAppliesTheOneSettledApplyAndTheLeaderForgetsTheStepBefore) {
  Replicas m(MeshSetup{.replicas = 2, .ranks_per_replica = 2});
  CreateWithGradients(m);
  for (const auto& stepped : StepEveryRank(m, "attempt-1", Sgd())) {
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    EXPECT_EQ(stepped->weight_version, 1);
  }
  // One value, sealed: not the bare word a process outside the group could write.
  const std::optional<std::string> settled = m.store().Peek(DecisionKey(m, "attempt-1"));
  ASSERT_TRUE(settled.has_value());
  EXPECT_NE(*settled, "apply");
  EXPECT_NE(settled->find("apply"), std::string::npos);

  for (const auto& stepped : StepEveryRank(m, "attempt-2", Sgd())) {
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    EXPECT_EQ(stepped->weight_version, 2);
  }
  EXPECT_FALSE(m.store().Peek(DecisionKey(m, "attempt-1")).has_value());
  EXPECT_TRUE(m.store().Peek(DecisionKey(m, "attempt-2")).has_value());
  for (int r = 0; r < m.replicas(); ++r) EXPECT_EQ(StateOf(m, r).version, 2) << r;
}

TEST(MeshDecisionTest, AStepSettledToAbortFirstAppliesNothingOnAnyRank) {
  Replicas m(MeshSetup{.replicas = 2, .ranks_per_replica = 2});
  CreateWithGradients(m);
  std::vector<HeadState> before;
  for (int r = 0; r < m.replicas(); ++r) before.push_back(StateOf(m, r));
  // A process that resolved a lost replica got there first.
  const absl::StatusOr<std::string> settled =
      m.front(1).liveness->Settle("decision/attempt-x", "abort");
  ASSERT_TRUE(settled.ok()) << settled.status();
  EXPECT_EQ(*settled, "abort");

  for (const auto& refused : StepEveryRank(m, "attempt-x", Sgd())) {
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
    EXPECT_NE(refused.status().message().find("nothing applied"), std::string::npos);
  }
  for (int r = 0; r < m.replicas(); ++r) {
    SCOPED_TRACE(absl::StrCat("replica ", r));
    const HeadState now = StateOf(m, r);
    EXPECT_EQ(now.version, 0);
    EXPECT_TRUE(Same(now.weight, before[static_cast<size_t>(r)].weight));
    EXPECT_TRUE(Same(now.bias, before[static_cast<size_t>(r)].bias));
    // dW held the replicas' sum when the decision came: zeroed, every trainer sends again.
    EXPECT_EQ(now.dweight.abs().sum().item<double>(), 0.0);
    EXPECT_EQ(now.dbias.abs().sum().item<double>(), 0.0);
  }
  // The settled value stays: a rank that asks later reads the same abort.
  const absl::StatusOr<std::string> again =
      m.front(0).liveness->Settle("decision/attempt-x", "apply");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, "abort");
}

TEST(MeshDecisionTest, ADecisionWrittenWithoutTheSecretIsRefusedAndNothingApplied) {
  Replicas m(MeshSetup{.replicas = 2});
  CreateWithGradients(m);
  ASSERT_TRUE(m.store().Set(DecisionKey(m, "attempt-f"), "apply").ok());
  for (const auto& refused : StepEveryRank(m, "attempt-f", Sgd())) {
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
    EXPECT_NE(refused.status().message().find("settled/decision/attempt-f"), std::string::npos)
        << refused.status();
  }
  for (int r = 0; r < m.replicas(); ++r) EXPECT_EQ(StateOf(m, r).version, 0) << r;
}

TEST(MeshDecisionTest, AReplicaStepWithoutItsNameIsRefused) {
  Replicas m(MeshSetup{.replicas = 2});
  CreateWithGradients(m);
  const absl::StatusOr<HeadDescription> refused = ReplicaStep(*m.front(0).local, kHead, Sgd(), "");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("reduce_step.attempt"), std::string::npos);
}

}  // namespace
}  // namespace remotehead::server
