// A mesh's optimizer step (replication/mesh_steps.h) in one process: R replicas of one server
// each (K = 1), and of two ranks (K = 2), their groups in-process (tests/server/in_process_mesh.h:
// threads, one store, no sockets), each process with its own registry, admission, HeadOperations
// and ReplicatedHeadOperations as ServiceContext builds them, the fronts other than the leader
// following the mesh's log (MeshFollower::Run) and a replica's other ranks its own log
// (GroupFollower::Run), as the server runs them.
//
// A synchronous step reaches the mesh as SynchronousSteps hands it on once a replica's own
// trainers all asked: ReplicatedHeadOperations::StepOptimizer(head, first, spec) on that
// replica's front (on the leader it makes the mesh command; on another front it delivers its
// trainers' request to the follower and waits for the leader's step). What every replica must
// see alike: the step applied everywhere with dW summed over the replicas, or — a replica whose
// trainers disagree, whose head has another version or shape, whose trainers never come, whose
// weights differ after the step — the same refusal on every replica naming that replica, and
// nothing applied anywhere.
#include "replication/mesh_steps.h"

#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/error_reason.h"
#include "replication/replica_step.h"
#include "server/mesh_replicas.h"

namespace remotehead::server {
namespace {

using namespace mesh_testing;  // NOLINT: the fixture of this file

// Every replica that was asked got the same refusal: `code`, `reason`, and a message naming
// the replica `named` (`contains`).
void ExpectRefusedAlike(const std::vector<Outcome>& outcomes, absl::StatusCode code,
                        const std::string& reason, const std::string& contains) {
  ASSERT_TRUE(outcomes[0].has_value());
  const absl::Status leaders = outcomes[0]->status();
  EXPECT_EQ(leaders.code(), code) << leaders;
  EXPECT_EQ(core::ReasonOf(leaders).reason, reason) << leaders;
  EXPECT_TRUE(absl::StrContains(leaders.message(), contains)) << leaders;
  EXPECT_TRUE(absl::StrContains(leaders.message(), "nothing applied")) << leaders;
  for (size_t r = 1; r < outcomes.size(); ++r) {
    if (!outcomes[r].has_value()) continue;
    SCOPED_TRACE(absl::StrCat("replica ", r));
    const absl::Status& theirs = outcomes[r]->status();
    EXPECT_EQ(theirs.code(), leaders.code()) << theirs;
    EXPECT_EQ(theirs.message(), leaders.message());
    EXPECT_EQ(core::SerializeReason(theirs), core::SerializeReason(leaders));
  }
}

// Nothing applied on any replica: weights, version, dW as `before`; nothing summed.
void ExpectNothingApplied(Replicas& m, const std::vector<HeadState>& before) {
  for (int r = 0; r < m.replicas(); ++r) {
    SCOPED_TRACE(absl::StrCat("replica ", r));
    const HeadState now = StateOf(m, r);
    const HeadState& then = before[static_cast<size_t>(r)];
    EXPECT_EQ(now.version, then.version);
    EXPECT_TRUE(Same(now.weight, then.weight));
    EXPECT_TRUE(Same(now.bias, then.bias));
    EXPECT_TRUE(Same(now.dweight, then.dweight));
    EXPECT_TRUE(Same(now.dbias, then.dbias));
    EXPECT_EQ(m.mesh(r).reduced_bytes(), 0);
  }
}

std::vector<HeadState> StatesOf(Replicas& m) {
  std::vector<HeadState> states;
  for (int r = 0; r < m.replicas(); ++r) states.push_back(StateOf(m, r));
  return states;
}

// Every follower left on `stop` and the mesh is still up: a refusal is no failure of the mesh.
void ExpectMeshStillUp(Replicas& m) {
  for (int r = 0; r < m.replicas(); ++r) {
    EXPECT_TRUE(m.mesh(r).health().ok()) << r << ": " << m.mesh(r).health();
  }
  const std::vector<absl::Status>& followed = m.StopFollowers();
  for (size_t g = 0; g < followed.size(); ++g)
    EXPECT_TRUE(followed[g].ok()) << g << ": " << followed[g];
}

// The step every replica applied: W − lr · ΣdW · grad_scale / world (SGD, no momentum), computed
// here in double; the same bits on every replica.
void ExpectSteppedAlike(Replicas& m, const std::vector<HeadState>& before, const Gradients& g,
                        double scale, int64_t version, bool zeroed) {
  const HeadState first = StateOf(m, 0);
  const torch::Tensor w =
      (before[0].weight.to(torch::kDouble) - kLr * scale * g.dw_sum.to(torch::kDouble))
          .to(torch::kFloat);
  const torch::Tensor b =
      (before[0].bias.to(torch::kDouble) - kLr * scale * g.db_sum.to(torch::kDouble))
          .to(torch::kFloat);
  EXPECT_TRUE(torch::allclose(first.weight, w, 1e-6, 1e-7)) << first.weight - w;
  EXPECT_TRUE(torch::allclose(first.bias, b, 1e-6, 1e-7)) << first.bias - b;
  EXPECT_FALSE(Same(first.weight, before[0].weight));  // the step moved it
  for (int r = 0; r < m.replicas(); ++r) {
    SCOPED_TRACE(absl::StrCat("replica ", r));
    const HeadState now = StateOf(m, r);
    EXPECT_EQ(now.version, version);
    EXPECT_TRUE(Same(now.weight, first.weight));
    EXPECT_TRUE(Same(now.bias, first.bias));
    if (zeroed) {
      EXPECT_TRUE(Same(now.dweight, torch::zeros_like(now.dweight)));
      EXPECT_TRUE(Same(now.dbias, torch::zeros_like(now.dbias)));
    } else {
      // A step that keeps dW keeps each replica's own, not the sum.
      EXPECT_TRUE(Same(now.dweight, g.dw[static_cast<size_t>(r)]));
      EXPECT_TRUE(Same(now.dbias, g.db[static_cast<size_t>(r)]));
    }
  }
}

std::string Replicas_(int r) { return absl::StrCat(r, " replicas"); }

// After a refusal: every replica's trainers ask for the leader's step, and it goes through
// everywhere from the state before (nothing of the refused one applied), the mesh still up.
void ExpectAgreedStepGoesThrough(Replicas& m, const std::vector<HeadState>& before,
                                 const Gradients& g) {
  const int replicas = m.replicas();
  const std::vector<Outcome> agreed = RunStep(m, EveryReplicasTrainers(replicas));
  for (int r = 0; r < replicas; ++r) {
    ASSERT_TRUE(agreed[r]->ok()) << r << ": " << agreed[r]->status();
  }
  ExpectSteppedAlike(m, before, g, kGradScale / (2 * replicas), 1, /*zeroed=*/true);
  ExpectMeshStillUp(m);
}

TEST(MeshStepsTest, EveryReplicaAppliesTheSameStepWithDwSummedOverTheReplicas) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(Replicas_(replicas));
    Replicas m(MeshSetup{.replicas = replicas});
    const Gradients g = CreateWithGradients(m);
    const std::vector<HeadState> before = StatesOf(m);
    for (int r = 1; r < replicas; ++r) {
      ASSERT_TRUE(Same(before[static_cast<size_t>(r)].weight, before[0].weight));
    }

    const auto start = Clock::now();
    const std::vector<Outcome> outcomes = RunStep(m, EveryReplicasTrainers(replicas));
    EXPECT_LT(Seconds(Clock::now() - start), 1.0);
    for (int r = 0; r < replicas; ++r) {
      SCOPED_TRACE(absl::StrCat("replica ", r));
      ASSERT_TRUE(outcomes[r].has_value());
      ASSERT_TRUE(outcomes[r]->ok()) << outcomes[r]->status();
      EXPECT_EQ((*outcomes[r])->weight_version, 1);
      EXPECT_EQ((*outcomes[r])->id, kHead);
      // dW and db summed once, in float32; the weights' checksums compared (every version).
      EXPECT_EQ(m.mesh(r).reduced_bytes(), (kVocab * kHidden + kVocab) * 4);
      EXPECT_EQ(m.mesh(r).checksums(/*matched=*/true), 1);
      EXPECT_EQ(m.mesh(r).checksums(/*matched=*/false), 0);
    }
    // grad_scale / world: 2 / (2R).
    ExpectSteppedAlike(m, before, g, kGradScale / (2 * replicas), 1, /*zeroed=*/true);
    ExpectMeshStillUp(m);
  }
}

TEST(MeshStepsTest, TrainersThatComeAfterTheLeadersStepAreWaitedForAndAStepThatKeepsDwKeepsEach) {
  Replicas m(MeshSetup{.replicas = 3});
  const Gradients g = CreateWithGradients(m);
  const std::vector<HeadState> before = StatesOf(m);
  // The leader's step is in the log first; the other fronts wait for their own trainers. Here
  // the trainers keep dW (zero_gradients false): each replica keeps its own, not the sum.
  std::vector<std::optional<SyncStepRequest>> trainers = EveryReplicasTrainers(3);
  for (auto& t : trainers) t->spec.zero_gradients = false;
  std::vector<std::future<absl::StatusOr<HeadDescription>>> late;
  auto leader = std::async(std::launch::async, [&] {
    return m.operations(0).StepOptimizer(kHead, trainers[0], Applied(*trainers[0]));
  });
  std::this_thread::sleep_for(milliseconds(150));
  EXPECT_EQ(leader.wait_for(milliseconds(0)), std::future_status::timeout);
  for (int r = 1; r < 3; ++r) {
    late.push_back(std::async(std::launch::async, [&, r] {
      return m.operations(r).StepOptimizer(kHead, trainers[r], Applied(*trainers[r]));
    }));
  }
  const absl::StatusOr<HeadDescription> led = leader.get();
  ASSERT_TRUE(led.ok()) << led.status();
  for (auto& f : late) {
    const absl::StatusOr<HeadDescription> got = f.get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->weight_version, 1);
  }
  ExpectSteppedAlike(m, before, g, kGradScale / 6, 1, /*zeroed=*/false);
  ExpectMeshStillUp(m);
}

TEST(MeshStepsTest, AReplicaWithoutTrainersInTheWorldStepsWithoutWaiting) {
  // R = 3, a world of 2 trainers: ranks 0 and 1 dial replicas 0 and 1; replica 2 has none, so
  // its front does not wait (its dW, whatever it holds, is summed too).
  Replicas m(MeshSetup{.replicas = 3});
  const Gradients g = CreateWithGradients(m);
  const std::vector<HeadState> before = StatesOf(m);
  const auto start = Clock::now();
  const std::vector<Outcome> outcomes =
      RunStep(m, {TrainersOf(0, 2), TrainersOf(1, 2), std::nullopt});
  EXPECT_LT(Seconds(Clock::now() - start), 1.0);  // far below kWait: nobody waited for replica 2
  ASSERT_TRUE(outcomes[0]->ok()) << outcomes[0]->status();
  ASSERT_TRUE(outcomes[1]->ok()) << outcomes[1]->status();
  EXPECT_FALSE(outcomes[2].has_value());
  ExpectSteppedAlike(m, before, g, kGradScale / 2, 1, /*zeroed=*/true);
  ExpectMeshStillUp(m);
}

TEST(MeshStepsTest, AnUnsynchronizedStepOnTheLeaderStepsEveryReplicaWithoutWaitingForTrainers) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(Replicas_(replicas));
    Replicas m(MeshSetup{.replicas = replicas});
    const Gradients g = CreateWithGradients(m);
    const std::vector<HeadState> before = StatesOf(m);
    const auto start = Clock::now();
    // One caller's step: grad_scale as sent (no world to divide by).
    const std::vector<Outcome> outcomes =
        RunStep(m, std::vector<std::optional<SyncStepRequest>>(static_cast<size_t>(replicas)),
                milliseconds(0), Sgd(kLr, kGradScale));
    EXPECT_LT(Seconds(Clock::now() - start), 1.0);
    ASSERT_TRUE(outcomes[0]->ok()) << outcomes[0]->status();
    EXPECT_EQ((*outcomes[0])->weight_version, 1);
    ExpectSteppedAlike(m, before, g, kGradScale, 1, /*zeroed=*/true);
    ExpectMeshStillUp(m);
  }
}

TEST(MeshStepsTest, AReplicaWhoseTrainersDisagreeWithTheLeadersRefusesTheStepOnEveryReplica) {
  struct Case {
    std::string field;
    std::function<void(SyncStepRequest&)> change;
    // The disagreeing replica's value, as the refusal names it.
    std::function<std::string(const SyncStepRequest&)> theirs;
  };
  const std::vector<Case> cases = {
      {"sgd.lr", [](SyncStepRequest& t) { t.spec = Sgd(0.25); },
       [](const SyncStepRequest& t) { return absl::StrCat("rank ", t.rank, " for 0.25"); }},
      {"synchronous.world_size", [](SyncStepRequest& t) { t.world_size += t.world_size / 2; },
       [](const SyncStepRequest& t) {
         return absl::StrCat("rank ", t.rank, " for ", t.world_size, " ");
       }},
      {"zero_gradients", [](SyncStepRequest& t) { t.spec.zero_gradients = false; },
       [](const SyncStepRequest& t) { return absl::StrCat("rank ", t.rank, " for false"); }},
  };
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(Replicas_(replicas));
    Replicas m(MeshSetup{.replicas = replicas});
    const Gradients g = CreateWithGradients(m);
    const std::vector<HeadState> before = StatesOf(m);
    const int odd = replicas - 1;  // the replica whose trainers disagree
    for (const Case& c : cases) {
      SCOPED_TRACE(c.field);
      std::vector<std::optional<SyncStepRequest>> trainers = EveryReplicasTrainers(replicas);
      c.change(*trainers[static_cast<size_t>(odd)]);

      const std::vector<Outcome> outcomes = RunStep(m, trainers);
      ExpectRefusedAlike(
          outcomes, absl::StatusCode::kInvalidArgument, "RANKS_DISAGREE",
          absl::StrCat("replica ", odd, " disagrees with replica 0: ", c.field, ":"));
      const absl::Status refused = outcomes[0]->status();
      EXPECT_TRUE(absl::StartsWith(refused.message(), absl::StrCat("replica ", odd, " ")))
          << refused;
      EXPECT_EQ(core::ReasonOf(refused).metadata["field"], c.field) << refused;
      EXPECT_TRUE(
          absl::StrContains(refused.message(), c.theirs(*trainers[static_cast<size_t>(odd)])))
          << refused;
      ExpectNothingApplied(m, before);
    }
    // Once its trainers ask for the leader's step, the same step goes through everywhere.
    ExpectAgreedStepGoesThrough(m, before, g);
  }
}

TEST(MeshStepsTest, AReplicaAtAnotherWeightVersionIsRefusedAsDivergedOnEveryReplica) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(Replicas_(replicas));
    Replicas m(MeshSetup{.replicas = replicas});
    CreateWithGradients(m);
    const int odd = replicas - 1;
    // That replica stepped on its own (its local HeadOperations): version 1, the others at 0.
    const absl::StatusOr<HeadDescription> own =
        m.operations(odd).local().OptimizerStep(kHead, Sgd(kLr, 1.0, /*zero=*/false));
    ASSERT_TRUE(own.ok()) << own.status();
    ASSERT_EQ(own->weight_version, 1);
    const std::vector<HeadState> before = StatesOf(m);

    const std::vector<Outcome> outcomes = RunStep(m, EveryReplicasTrainers(replicas));
    ExpectRefusedAlike(outcomes, absl::StatusCode::kFailedPrecondition, "REPLICAS_DIVERGED",
                       absl::StrCat("at replica 0's version 0; replica ", odd, " is at 1"));
    EXPECT_EQ(core::ReasonOf(outcomes[0]->status()).metadata["replicas"], absl::StrCat(odd));
    ExpectNothingApplied(m, before);
    ExpectMeshStillUp(m);
  }
}

TEST(MeshStepsTest, AReplicaWhoseHeadHasAnotherShapeIsRefusedAsDivergedOnEveryReplica) {
  Replicas m(MeshSetup{.replicas = 2});
  CreateWithGradients(m);
  // Replica 1's head of that id, made on its own, is [12, 6] (still at version 0).
  ASSERT_TRUE(m.operations(1).local().Drop(kHead).ok());
  ASSERT_TRUE(m.operations(1).local().CreateFromSeed(kHead, Init(6), {}).ok());
  const std::vector<HeadState> before = StatesOf(m);
  const std::vector<Outcome> outcomes = RunStep(m, EveryReplicasTrainers(2));
  ExpectRefusedAlike(outcomes, absl::StatusCode::kFailedPrecondition, "REPLICAS_DIVERGED",
                     "shaped as replica 0's [12, 4]; replica 1's is [12, 6]");
  EXPECT_EQ(core::ReasonOf(outcomes[0]->status()).metadata["replicas"], "1");
  ExpectNothingApplied(m, before);
  ExpectMeshStillUp(m);
}

TEST(MeshStepsTest, AReplicaWhoseTrainersNeverComeAbortsTheStepOnEveryReplica) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(Replicas_(replicas));
    Replicas m(MeshSetup{.replicas = replicas, .wait = kShortWait});
    const Gradients g = CreateWithGradients(m);
    const std::vector<HeadState> before = StatesOf(m);
    const int odd = replicas - 1;  // its trainers never ask
    std::vector<std::optional<SyncStepRequest>> trainers = EveryReplicasTrainers(replicas);
    trainers[static_cast<size_t>(odd)].reset();

    const auto start = Clock::now();
    // The leader 50 ms later: the other replicas' trainers' requests get a head start, so that
    // on a loaded machine too only the replica whose trainers never come runs out of its wait.
    const std::vector<Outcome> outcomes = RunStep(m, trainers, milliseconds(50));
    const double took = Seconds(Clock::now() - start);
    EXPECT_GE(took, 0.19);  // that replica's front waited for its trainers…
    EXPECT_LT(took, 1.5);   // …for the wait given, not for the log's timeout
    // Every replica names the same trainers: those of the replica that never asked.
    const int world = trainers[0]->world_size;
    const std::vector<int> missing = MeshEpoch::First(replicas).TrainersOf(odd, world, replicas);
    std::vector<int> came;
    for (int t = 0; t < world; ++t) {
      if (t % replicas != odd) came.push_back(t);
    }
    ExpectRefusedAlike(outcomes, absl::StatusCode::kAborted, "RANKS_MISSING",
                       absl::StrCat("within 200ms; got ranks [", absl::StrJoin(came, ", "),
                                    "], missing ranks [", absl::StrJoin(missing, ", "), "]"));
    core::ErrorReason reason = core::ReasonOf(outcomes[0]->status());
    EXPECT_EQ(reason.metadata["head"], kHead);
    EXPECT_EQ(reason.metadata["step"], "0");
    EXPECT_EQ(reason.metadata["missing_ranks"], absl::StrJoin(missing, ","));
    ExpectNothingApplied(m, before);

    // Its trainers come for the same step now: it goes through everywhere.
    ExpectAgreedStepGoesThrough(m, before, g);
  }
}

TEST(MeshStepsTest, AReplicasTrainersWhoseLeaderNeverStartsTheStepAreAbortedAndNothingApplied) {
  Replicas m(MeshSetup{.replicas = 2, .wait = kShortWait});
  CreateWithGradients(m);
  const std::vector<HeadState> before = StatesOf(m);
  // Replica 1's trainers all asked; the leader's never do (no mesh command is made).
  const SyncStepRequest first = TrainersOf(1, 4);
  const auto start = Clock::now();
  const absl::StatusOr<HeadDescription> got =
      m.operations(1).StepOptimizer(kHead, first, Applied(first));
  const double took = Seconds(Clock::now() - start);
  EXPECT_GE(took, 0.19);  // one wait, as every replica's
  EXPECT_LT(took, 1.5);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
  EXPECT_EQ(core::ReasonOf(got.status()).reason, "RANKS_MISSING");
  // The leader's trainers are named, not the leader.
  EXPECT_TRUE(absl::StrContains(got.status().message(),
                                "within 200ms; got ranks [1, 3], missing ranks [0, 2]"))
      << got.status();
  EXPECT_EQ(core::ReasonOf(got.status()).metadata["missing_ranks"], "0,2");
  ExpectNothingApplied(m, before);
  ExpectMeshStillUp(m);
}

TEST(MeshStepsTest, AnUnsynchronizedStepOnAnotherFrontIsNotTheLeadersAndNamesTheLeader) {
  Replicas m(MeshSetup{.replicas = 3});
  CreateWithGradients(m);
  // Before the leader announced its address: the refusal says it is not known yet.
  const absl::StatusOr<HeadDescription> early =
      m.operations(1).StepOptimizer(kHead, std::nullopt, Sgd());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  EXPECT_EQ(core::ReasonOf(early.status()).reason, "NOT_THE_LEADER");
  EXPECT_TRUE(absl::StrContains(early.status().message(), "not known here yet")) << early.status();
  // The leader announces itself through the mesh's log, as the server does once it listens.
  ASSERT_TRUE(AnnounceFront(*m.mesh(0).fronts(), "leader.test:7001").ok());
  const std::vector<HeadState> before = StatesOf(m);
  for (int r = 1; r < 3; ++r) {
    SCOPED_TRACE(absl::StrCat("replica ", r));
    const auto start = Clock::now();
    const absl::StatusOr<HeadDescription> got =
        m.operations(r).StepOptimizer(kHead, std::nullopt, Sgd());
    EXPECT_LT(Seconds(Clock::now() - start), 0.1);  // at once: no mesh command is made
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
    core::ErrorReason reason = core::ReasonOf(got.status());
    EXPECT_EQ(reason.reason, "NOT_THE_LEADER");
    EXPECT_EQ(reason.metadata["leader"], "leader.test:7001");
    EXPECT_EQ(reason.metadata["replica"], absl::StrCat(r));
    EXPECT_EQ(reason.metadata["method"], "an unsynchronized OptimizerStep");
    EXPECT_TRUE(absl::StrContains(got.status().message(),
                                  absl::StrCat("front of replica ", r, " of a mesh of 3")))
        << got.status();
    EXPECT_TRUE(absl::StrContains(got.status().message(), "dial leader.test:7001")) << got.status();
  }
  ExpectNothingApplied(m, before);
  ExpectMeshStillUp(m);
}

TEST(MeshStepsTest, WeightsThatDifferAfterTheStepFailItWithDataLossNamingTheReplica) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(Replicas_(replicas));
    Replicas m(MeshSetup{.replicas = replicas, .options = {.checksum_every_steps = 1}});
    CreateWithGradients(m);
    const int odd = replicas - 1;
    // One weight of that replica differs, at the same version: the verdicts all agree.
    absl::StatusOr<std::shared_ptr<HeadEntry>> entry = m.front(odd).registry.Get(kHead);
    ASSERT_TRUE(entry.ok());
    (*entry)->Write([](core::Head& h) { h.mutable_weight()[3][1].add_(0.5); });

    const std::vector<Outcome> outcomes = RunStep(m, EveryReplicasTrainers(replicas));
    ASSERT_TRUE(outcomes[0].has_value());
    const absl::Status leaders = outcomes[0]->status();
    EXPECT_EQ(leaders.code(), absl::StatusCode::kDataLoss) << leaders;
    EXPECT_EQ(core::ReasonOf(leaders).reason, "REPLICAS_DIVERGED");
    EXPECT_EQ(core::ReasonOf(leaders).metadata["replicas"], absl::StrCat(odd));
    EXPECT_TRUE(absl::StrContains(
        leaders.message(), absl::StrCat("the weights of head \"lm\" at version 1 of replica(s) ",
                                        odd, " differ from replica 0's")))
        << leaders;
    for (int r = 0; r < replicas; ++r) {
      SCOPED_TRACE(absl::StrCat("replica ", r));
      ASSERT_TRUE(outcomes[r].has_value());
      EXPECT_EQ(outcomes[r]->status(), leaders);  // the same status on every replica
      EXPECT_EQ(m.mesh(r).checksums(/*matched=*/false), 1);
      // The checksum compares the weights the step made: the step itself happened everywhere.
      EXPECT_EQ(StateOf(m, r).version, 1);
    }
    ExpectMeshStillUp(m);
  }
}

TEST(MeshStepsTest, ReplicasOfTwoRanksEachStepEveryShardAlike) {
  Replicas m(MeshSetup{.replicas = 2, .ranks_per_replica = 2});
  const Gradients g = CreateWithGradients(m);
  for (int g_rank = 0; g_rank < 4; ++g_rank) {
    absl::StatusOr<std::shared_ptr<HeadEntry>> entry = m.at(g_rank).registry.Get(kHead);
    ASSERT_TRUE(entry.ok()) << g_rank;
    EXPECT_EQ((*entry)->shards().size(), 2u);  // each rank holds its replica's shard
  }
  const std::vector<HeadState> before = StatesOf(m);
  ASSERT_TRUE(Same(before[1].weight, before[0].weight));
  ASSERT_EQ(before[0].weight.size(0), kVocab);

  // A disagreement first: refused on both replicas, on no shard applied.
  std::vector<std::optional<SyncStepRequest>> trainers = EveryReplicasTrainers(2);
  trainers[1]->spec = Sgd(0.25);
  const std::vector<Outcome> refused = RunStep(m, trainers);
  ExpectRefusedAlike(refused, absl::StatusCode::kInvalidArgument, "RANKS_DISAGREE",
                     "replica 1 disagrees with replica 0: sgd.lr:");
  ExpectNothingApplied(m, before);
  for (int g_rank = 0; g_rank < 4; ++g_rank) EXPECT_EQ(m.at(g_rank).mesh->reduced_bytes(), 0);

  const std::vector<Outcome> outcomes = RunStep(m, EveryReplicasTrainers(2));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(outcomes[r]->ok()) << r << ": " << outcomes[r]->status();
    EXPECT_EQ((*outcomes[r])->weight_version, 1);
  }
  ExpectSteppedAlike(m, before, g, kGradScale / 4, 1, /*zeroed=*/true);
  // Each rank summed its own shard's rows with its shard peers (6 rows of W and b).
  for (int g_rank = 0; g_rank < 4; ++g_rank) {
    SCOPED_TRACE(g_rank);
    EXPECT_EQ(m.at(g_rank).mesh->reduced_bytes(), (kVocab / 2) * (kHidden + 1) * 4);
    EXPECT_EQ(m.at(g_rank).mesh->checksums(/*matched=*/true), 1);
  }
  ExpectMeshStillUp(m);
}

// The seat of a commit decision (replica_step.h): between the sum over the replicas and the
// apply, on every replica's rank at once, as the reduce_step command runs there. A decision that
// refuses once the sum is done (the bytes were reduced) applies nothing on any replica and puts
// each replica's own dW back; one that allows applies the summed dW, as a plain mesh step does.
TEST(MeshStepsTest, ADecisionBetweenTheSumAndTheApplyRefusesWithNothingAppliedOrAllowsTheStep) {
  Replicas m(MeshSetup{.replicas = 2});
  const Gradients g = CreateWithGradients(m);
  const std::vector<HeadState> before = StatesOf(m);
  const OptimizerStepSpec spec = Sgd(kLr, kGradScale, /*zero=*/true);
  const auto step_every_replica = [&](bool apply) {
    std::vector<absl::StatusOr<HeadDescription>> results(2, absl::UnknownError("not run"));
    std::vector<int64_t> summed_at_decision(2, -1);
    std::vector<std::thread> replicas;
    for (int r = 0; r < 2; ++r) {
      replicas.emplace_back([&, r] {
        HeadOperations& ops = *m.front(r).local;
        const StepDecision decision{
            .decide = [&, r](const absl::Status& summed) -> absl::Status {
              EXPECT_TRUE(summed.ok()) << summed;
              summed_at_decision[static_cast<size_t>(r)] = m.mesh(r).reduced_bytes();
              if (apply) return absl::OkStatus();
              return absl::AbortedError("the step was decided against after its sum");
            },
            .keeps_own = true};
        results[static_cast<size_t>(r)] = ops.OptimizerStep(
            kHead, spec, ReplicaStepAround(ops.placement(), kHead, !spec.zero_gradients, decision));
      });
    }
    for (std::thread& t : replicas) t.join();
    for (int r = 0; r < 2; ++r) EXPECT_GT(summed_at_decision[static_cast<size_t>(r)], 0) << r;
    return results;
  };

  for (const auto& refused : step_every_replica(/*apply=*/false)) {
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  }
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("replica ", r));
    const HeadState now = StateOf(m, r);
    EXPECT_EQ(now.version, 0);
    EXPECT_TRUE(Same(now.weight, before[static_cast<size_t>(r)].weight));
    EXPECT_TRUE(Same(now.bias, before[static_cast<size_t>(r)].bias));
    // Its own dW, not the sum it was for a moment.
    EXPECT_TRUE(Same(now.dweight, g.dw[static_cast<size_t>(r)]));
    EXPECT_TRUE(Same(now.dbias, g.db[static_cast<size_t>(r)]));
  }

  for (const auto& applied : step_every_replica(/*apply=*/true)) {
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_EQ(applied->weight_version, 1);
  }
  ExpectSteppedAlike(m, before, g, kGradScale, 1, /*zeroed=*/true);
  ExpectMeshStillUp(m);
}

}  // namespace
}  // namespace remotehead::server
