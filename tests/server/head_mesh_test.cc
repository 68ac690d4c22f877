// A head's replicas on a mesh (head_mesh.h) in one process: R replicas of one server each
// (K = 1), and of two ranks (K = 2), their groups in-process (tests/server/in_process_mesh.h:
// threads, one store, no sockets, no c10d), each process's HeadMesh built as JoinCluster builds
// it (the fronts' log opened). What every front must see alike: every replica's verdict by
// replica with its code, reason and message; dW summed over the replicas with the same bits
// everywhere (exact in float32, the bf16-rounded sum in bfloat16), with its bytes counted;
// checksums that name the replicas that differ; NOT_THE_LEADER naming the leader's address; and
// a transport failure that times out, and inside a mesh command takes the mesh down as
// head_group.h describes. The multi-process tests (tests/python/test_mesh*.py) run the same
// over c10d.
#include "remotehead/server/group/head_mesh.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/placement.h"
#include "server/in_process_mesh.h"

// Its own namespace: the file is compiled in one unit with the target's other files
// (cmake/RemoteheadUnity.cmake), whose shapes and helpers have the same names.
namespace remotehead::server::head_mesh_test {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr char kSecret[] = "the-mesh-secret-0123456789abcdef";
// Long enough never to be reached by a test that passes; the failure cases use short ones.
constexpr milliseconds kPatient{5000};
constexpr milliseconds kShort{300};

// Every process of a mesh [R, K], its HeadMesh made as JoinCluster makes it: on a replica's
// front a HeadGroup over shard 0's group (the mesh's log, opened), elsewhere its shard peers.
class Mesh {
 public:
  Mesh(int replicas, int ranks_per_replica = 1, MeshOptions options = {},
       milliseconds timeout = kPatient)
      : groups_(replicas, ranks_per_replica, timeout),
        meshes_(static_cast<size_t>(groups_.size())),
        logs_(static_cast<size_t>(groups_.size())) {
    std::vector<absl::Status> opened(static_cast<size_t>(size()));
    groups_.RunOnAll([&](int g) {
      ProcessGroup::Mesh joined = groups_.Join(g);
      const GroupConfig config = groups_.config(g);
      std::unique_ptr<HeadGroup> fronts;
      if (config.rank_in_replica() == 0) {
        fronts = std::make_unique<HeadGroup>(std::move(joined.shard), kSecret, &log(g));
        opened[static_cast<size_t>(g)] = fronts->Open();
      }
      meshes_[static_cast<size_t>(g)] = std::make_unique<HeadMesh>(
          config.replica(), replicas, options, std::move(fronts), std::move(joined.shard));
    });
    for (int g = 0; g < size(); ++g) {
      EXPECT_TRUE(opened[static_cast<size_t>(g)].ok())
          << g << ": " << opened[static_cast<size_t>(g)];
    }
  }

  int size() const { return groups_.size(); }
  HeadMesh& operator[](int g) { return *meshes_[static_cast<size_t>(g)]; }
  std::ostringstream& log(int g) { return logs_[static_cast<size_t>(g)]; }
  testing::InProcessStore& store() { return groups_.store(); }

  // fn(g) on every process at once (each on its own thread), its results by global rank.
  template <typename Fn>
  auto OnAll(Fn fn) -> std::vector<decltype(fn(0))> {
    std::vector<decltype(fn(0))> out(static_cast<size_t>(size()));
    groups_.RunOnAll([&](int g) { out[static_cast<size_t>(g)] = fn(g); });
    return out;
  }

 private:
  testing::InProcessMesh groups_;  // outlives the meshes, which own its members
  std::vector<std::unique_ptr<HeadMesh>> meshes_;
  std::vector<std::ostringstream> logs_;
};

// The bits of `t` (a float tensor) compared whole: equal values, equal signs of zero.
bool SameBits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         torch::equal(a.contiguous().view(torch::kByte), b.contiguous().view(torch::kByte));
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

TEST(HeadMeshTest, EveryReplicaOfOneServerIsAFrontAndReplicaZeroLeads) {
  Mesh mesh(3);
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(mesh[r].replica(), r);
    EXPECT_EQ(mesh[r].replicas(), 3);
    EXPECT_TRUE(mesh[r].is_front());
    EXPECT_EQ(mesh[r].is_leader(), r == 0);
    ASSERT_NE(mesh[r].fronts(), nullptr);
    EXPECT_EQ(&mesh[r].peers(), &mesh[r].fronts()->collectives());
    EXPECT_EQ(mesh[r].peers().rank(), r);
    EXPECT_EQ(mesh[r].peers().size(), 3);
    EXPECT_EQ(mesh[r].peers().config().prefix, "remotehead/shard/0");
    EXPECT_TRUE(mesh[r].health().ok());
    EXPECT_EQ(mesh[r].reduced_bytes(), 0);
    EXPECT_EQ(mesh[r].checksums(true), 0);
    EXPECT_EQ(mesh[r].checksums(false), 0);
  }
}

TEST(HeadMeshTest, RanksBehindTheFrontsSumWithTheirOwnShardsPeers) {
  Mesh mesh(2, /*ranks_per_replica=*/2);  // global rank g = replica·2 + shard
  for (int g = 0; g < 4; ++g) {
    SCOPED_TRACE(g);
    const int replica = g / 2, shard = g % 2;
    EXPECT_EQ(mesh[g].replica(), replica);
    EXPECT_EQ(mesh[g].is_front(), shard == 0);
    EXPECT_EQ(mesh[g].is_leader(), g == 0);
    EXPECT_EQ(mesh[g].fronts() == nullptr, shard != 0);
    EXPECT_TRUE(mesh[g].health().ok());  // always OK off a front
    EXPECT_EQ(mesh[g].peers().rank(), replica);
    EXPECT_EQ(mesh[g].peers().size(), 2);
    EXPECT_EQ(mesh[g].peers().config().prefix, absl::StrCat("remotehead/shard/", shard));
  }
  // Both shards sum at once, each over its own peers only: shard 0 holds 1 + 3, shard 1 2 + 4.
  const auto sums = mesh.OnAll([&](int g) -> absl::StatusOr<torch::Tensor> {
    torch::Tensor t = torch::full({3, 2}, static_cast<float>(g + 1));
    const absl::Status status = mesh[g].SumOverReplicas(t);
    if (!status.ok()) return status;
    return t;
  });
  for (int g = 0; g < 4; ++g) {
    ASSERT_TRUE(sums[g].ok()) << g << ": " << sums[g].status();
    EXPECT_TRUE(torch::equal(*sums[g], torch::full({3, 2}, g % 2 == 0 ? 4.0f : 6.0f))) << g;
  }
}

// What replica r says of a mesh command, in the test below: OK, a refusal with a reason, and an
// error far longer than the others (the exchange pads every verdict to the longest).
absl::Status VerdictOf(int replica) {
  switch (replica) {
    case 0:
      return absl::OkStatus();
    case 1:
      return core::WithReason(
          absl::InvalidArgumentError("replica 1 disagrees with replica 0: adamw.lr: 0.1 vs 0.2"),
          core::reason::kRanksDisagree, {{"field", "adamw.lr"}, {"step", "7"}});
    default:
      return absl::DataLossError(absl::StrCat("replica ", replica, ": ", std::string(3000, 'm')));
  }
}

TEST(HeadMeshTest, EveryFrontGetsEveryReplicasVerdictByReplica) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(replicas, " replicas"));
    Mesh mesh(replicas);
    const auto verdicts = mesh.OnAll([&](int r) { return mesh[r].ExchangeVerdicts(VerdictOf(r)); });
    for (int front = 0; front < replicas; ++front) {
      SCOPED_TRACE(absl::StrCat("front of replica ", front));
      ASSERT_TRUE(verdicts[front].ok()) << verdicts[front].status();
      ASSERT_EQ(verdicts[front]->size(), static_cast<size_t>(replicas));
      for (int r = 0; r < replicas; ++r) {
        const absl::Status& got = (*verdicts[front])[static_cast<size_t>(r)];
        const absl::Status said = VerdictOf(r);
        EXPECT_EQ(got.code(), said.code()) << r;
        EXPECT_EQ(got.message(), said.message()) << r;
        EXPECT_EQ(core::SerializeReason(got), core::SerializeReason(said)) << r;
        EXPECT_EQ(got, said) << r;  // and nothing else attached
      }
      EXPECT_EQ(*verdicts[front], *verdicts[0]);  // the same vector on every front
    }
    const absl::Status refused = (*verdicts[replicas - 1])[1];
    EXPECT_EQ(core::ReasonOf(refused).reason, "RANKS_DISAGREE");
    EXPECT_EQ(core::ReasonOf(refused).metadata.at("field"), "adamw.lr");
  }
}

TEST(HeadMeshTest, VerdictsAllOkComeBackOk) {
  Mesh mesh(2);
  const auto verdicts =
      mesh.OnAll([&](int r) { return mesh[r].ExchangeVerdicts(absl::OkStatus()); });
  for (const auto& v : verdicts) {
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, std::vector<absl::Status>(2, absl::OkStatus()));
  }
}

// dW of each replica, summed by SumOverReplicas on every replica at once: the results by replica.
std::vector<torch::Tensor> SumOnEveryReplica(Mesh& mesh, const std::vector<torch::Tensor>& dw) {
  const auto sums = mesh.OnAll([&](int r) -> absl::StatusOr<torch::Tensor> {
    torch::Tensor t = dw[static_cast<size_t>(r)].clone();
    const absl::Status status = mesh[r].SumOverReplicas(t);
    if (!status.ok()) return status;
    return t;
  });
  std::vector<torch::Tensor> out;
  for (size_t r = 0; r < sums.size(); ++r) {
    EXPECT_TRUE(sums[r].ok()) << r << ": " << sums[r].status();
    out.push_back(sums[r].ok() ? *sums[r] : torch::Tensor());
  }
  return out;
}

TEST(HeadMeshTest, Float32SumsAreExactAndTheSameBitsOnEveryReplica) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(replicas, " replicas"));
    Mesh mesh(replicas);
    torch::manual_seed(11);
    // Multiples of 1/256 below 16: every partial sum is exact in float32, in any order.
    std::vector<torch::Tensor> dw;
    torch::Tensor exact = torch::zeros({37, 5}, torch::kDouble);
    for (int r = 0; r < replicas; ++r) {
      dw.push_back(torch::randint(-4096, 4096, {37, 5}, torch::kFloat) / 256);
      exact += dw.back().to(torch::kDouble);
    }
    const std::vector<torch::Tensor> sums = SumOnEveryReplica(mesh, dw);
    const int64_t bytes = 37 * 5 * 4;
    for (int r = 0; r < replicas; ++r) {
      SCOPED_TRACE(r);
      ASSERT_TRUE(sums[r].defined());
      EXPECT_EQ(sums[r].scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::equal(sums[r], exact.to(torch::kFloat)));
      EXPECT_EQ(mesh[r].reduced_bytes(), bytes);
      EXPECT_GT(mesh[r].reduce_seconds(), 0.0);
      // A reduce to replica 0, then its broadcast: what each replica's collectives moved.
      const auto moved = mesh[r].PeerBytes();
      ASSERT_EQ(moved.count("reduce"), 1u);
      ASSERT_EQ(moved.count("broadcast"), 1u);
      EXPECT_EQ(moved.at("reduce").calls, 1);
      EXPECT_EQ(moved.at("broadcast").calls, 1);
      const int64_t peers = replicas - 1;
      EXPECT_EQ(moved.at("reduce").received, r == 0 ? bytes * peers : 0);
      EXPECT_EQ(moved.at("reduce").sent, r == 0 ? 0 : bytes);
      EXPECT_EQ(moved.at("broadcast").sent, r == 0 ? bytes * peers : 0);
      EXPECT_EQ(moved.at("broadcast").received, r == 0 ? 0 : bytes);
    }
    // Values whose float32 sum rounds: still the same bits on every replica (replica 0's sum,
    // broadcast), and the sum to float32's precision. The bytes add up call by call.
    for (torch::Tensor& t : dw) t = torch::randn({37, 5});
    const std::vector<torch::Tensor> rounded = SumOnEveryReplica(mesh, dw);
    torch::Tensor reference = torch::zeros({37, 5}, torch::kDouble);
    for (const torch::Tensor& t : dw) reference += t.to(torch::kDouble);
    for (int r = 0; r < replicas; ++r) {
      SCOPED_TRACE(r);
      EXPECT_TRUE(SameBits(rounded[r], rounded[0]));
      EXPECT_TRUE(torch::allclose(rounded[r].to(torch::kDouble), reference, 0, 1e-5));
      EXPECT_EQ(mesh[r].reduced_bytes(), 2 * bytes);
    }
  }
}

TEST(HeadMeshTest, Bfloat16SumsAreTheRoundedSumLandingInDwsDtype) {
  for (const int replicas : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(replicas, " replicas"));
    MeshOptions options;
    options.reduce_dtype = torch::kBFloat16;
    Mesh mesh(replicas, 1, options);
    torch::manual_seed(12);
    std::vector<torch::Tensor> dw;
    for (int r = 0; r < replicas; ++r) dw.push_back(torch::randn({64, 8}));
    // Independently: each replica's dW rounded to bfloat16, summed in bfloat16 (every addition
    // rounded, in replica order: the in-process reduce's order), back to float32.
    torch::Tensor expected = dw[0].to(torch::kBFloat16);
    for (int r = 1; r < replicas; ++r) expected = expected + dw[r].to(torch::kBFloat16);
    expected = expected.to(torch::kFloat);
    torch::Tensor float_sum = torch::zeros({64, 8});
    for (const torch::Tensor& t : dw) float_sum += t;
    ASSERT_FALSE(torch::equal(expected, float_sum));  // the rounding shows

    const std::vector<torch::Tensor> sums = SumOnEveryReplica(mesh, dw);
    for (int r = 0; r < replicas; ++r) {
      SCOPED_TRACE(r);
      ASSERT_TRUE(sums[r].defined());
      EXPECT_EQ(sums[r].scalar_type(), torch::kFloat);  // dW keeps its dtype
      EXPECT_TRUE(SameBits(sums[r], expected));
      EXPECT_EQ(mesh[r].reduced_bytes(), 64 * 8 * 2);  // half of float32's bytes on the wire
      EXPECT_EQ(mesh[r].PeerBytes()["broadcast"].calls, 1);
    }
  }
}

TEST(HeadMeshTest, Float32SumOfBfloat16DwIsRoundedOnceBackIntoIt) {
  Mesh mesh(2);  // reduce_dtype float32
  torch::manual_seed(13);
  const std::vector<torch::Tensor> dw = {torch::randn({16, 4}).to(torch::kBFloat16),
                                         torch::randn({16, 4}).to(torch::kBFloat16)};
  const torch::Tensor expected =
      (dw[0].to(torch::kFloat) + dw[1].to(torch::kFloat)).to(torch::kBFloat16);
  const std::vector<torch::Tensor> sums = SumOnEveryReplica(mesh, dw);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(sums[r].defined());
    EXPECT_TRUE(SameBits(sums[r], expected)) << r;
    EXPECT_EQ(mesh[r].reduced_bytes(), 16 * 4 * 4) << r;  // travelled as float32
  }
}

// The weights every replica checks in CompareAcrossReplicas below: W and b alike everywhere,
// except that the replicas in `odd` hold one element of W one ulp away.
std::vector<torch::Tensor> Weights(bool odd) {
  torch::Tensor w = torch::arange(40, torch::kFloat).reshape({8, 5}) / 7;
  const torch::Tensor b = torch::linspace(-1, 1, 8);
  if (odd) {
    float* x = w.data_ptr<float>() + 17;
    *x = std::nextafter(*x, 100.0f);
  }
  return {w, b};
}

TEST(HeadMeshTest, ChecksumsAgreeOrNameTheReplicasThatDiffer) {
  struct Case {
    int replicas;
    std::vector<int> odd;  // the replicas whose weights differ
    std::string named;     // as the message names those that differ from replica 0
    std::string metadata;
  };
  for (const Case& c : std::vector<Case>{{2, {1}, "replica(s) 1 differ", "1"},
                                         {3, {2}, "replica(s) 2 differ", "2"},
                                         {3, {1, 2}, "replica(s) 1, 2 differ", "1,2"},
                                         // replica 0 the odd one: the others are named
                                         {3, {0}, "replica(s) 1, 2 differ", "1,2"}}) {
    SCOPED_TRACE(absl::StrCat(c.replicas, " replicas, ", c.metadata));
    Mesh mesh(c.replicas);
    const std::string what = "weights of head \"h\" at version 4";
    // First every replica alike: OK, counted as matched.
    const auto alike =
        mesh.OnAll([&](int r) { return mesh[r].CompareAcrossReplicas(Weights(false), what); });
    for (int r = 0; r < c.replicas; ++r) {
      EXPECT_TRUE(alike[r].ok()) << r << ": " << alike[r];
      EXPECT_EQ(mesh[r].checksums(true), 1);
      EXPECT_EQ(mesh[r].checksums(false), 0);
    }
    const auto differ = mesh.OnAll([&](int r) {
      const bool odd = std::find(c.odd.begin(), c.odd.end(), r) != c.odd.end();
      return mesh[r].CompareAcrossReplicas(Weights(odd), what);
    });
    for (int r = 0; r < c.replicas; ++r) {
      SCOPED_TRACE(r);
      EXPECT_EQ(differ[r].code(), absl::StatusCode::kDataLoss) << differ[r];
      EXPECT_TRUE(absl::StrContains(
          differ[r].message(),
          absl::StrCat("head mesh: ", what, " of ", c.named,
                       " from replica 0's (checksums of shard remotehead/shard/0)")))
          << differ[r];
      EXPECT_EQ(core::ReasonOf(differ[r]).reason, "REPLICAS_DIVERGED");
      EXPECT_EQ(core::ReasonOf(differ[r]).metadata.at("replicas"), c.metadata);
      EXPECT_EQ(differ[r], differ[0]);  // every replica says the same
      EXPECT_EQ(mesh[r].checksums(true), 1);
      EXPECT_EQ(mesh[r].checksums(false), 1);
      EXPECT_EQ(mesh[r].PeerBytes()["all_gather"].calls, 2);
    }
  }
}

// A mesh replica's Placement (placement.h), as a head's optimizer step uses it: the replicas'
// weights compared at every --mesh_checksum_every_steps-th version only, dW summed like the
// mesh's own.
TEST(HeadMeshTest, APlacementComparesTheReplicasAtEveryNthVersionOnly) {
  Mesh mesh(2, 1, MeshOptions{.checksum_every_steps = 3});
  const auto at = [&](int64_t version, bool odd_one) {
    return mesh.OnAll([&](int r) {
      Placement placement(nullptr, &mesh[r]);
      return placement.CompareReplicasAt(version, Weights(odd_one && r == 1), "weights");
    });
  };
  for (const int64_t version : {1, 2, 4, 5}) {
    for (const absl::Status& s : at(version, true)) EXPECT_TRUE(s.ok()) << version << ": " << s;
  }
  EXPECT_EQ(mesh[0].checksums(true) + mesh[0].checksums(false), 0);  // none compared
  for (const absl::Status& s : at(6, true)) EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(mesh[0].checksums(false), 1);
  const auto sums = mesh.OnAll([&](int r) {
    Placement placement(nullptr, &mesh[r]);
    EXPECT_TRUE(placement.replicated());
    torch::Tensor t = torch::full({3}, static_cast<float>(r + 1));
    EXPECT_TRUE(placement.SumOverReplicas(t).ok());
    return t;
  });
  for (const torch::Tensor& t : sums) EXPECT_TRUE(torch::equal(t, torch::full({3}, 3.0f)));
}

TEST(HeadMeshTest, NotTheLeaderNamesTheLeadersAddressOnceKnown) {
  Mesh mesh(3);
  const absl::Status unknown = mesh[2].NotTheLeader("CreateHead");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(unknown.message(), "front of replica 2 of a mesh of 3")) << unknown;
  EXPECT_TRUE(absl::StrContains(unknown.message(), "CreateHead changes every replica")) << unknown;
  EXPECT_TRUE(absl::StrContains(unknown.message(), "its address is not known here yet")) << unknown;
  core::ErrorReason reason = core::ReasonOf(unknown);
  EXPECT_EQ(reason.reason, "NOT_THE_LEADER");
  EXPECT_EQ(reason.metadata.at("leader"), "");
  EXPECT_EQ(reason.metadata.at("replica"), "2");
  EXPECT_EQ(reason.metadata.at("method"), "CreateHead");

  // The leader's address, as the mesh's log announces it to every front (MeshFollower).
  mesh[2].fronts()->set_front_address("leader.mesh.svc:50051");
  const absl::Status known = mesh[2].NotTheLeader("an unsynchronized OptimizerStep");
  EXPECT_EQ(known.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(known.message(), "dial leader.mesh.svc:50051")) << known;
  reason = core::ReasonOf(known);
  EXPECT_EQ(reason.reason, "NOT_THE_LEADER");
  EXPECT_EQ(reason.metadata.at("leader"), "leader.mesh.svc:50051");
  EXPECT_EQ(reason.metadata.at("method"), "an unsynchronized OptimizerStep");
}

TEST(HeadMeshTest, AReplicaThatNeverArrivesTimesTheOthersOut) {
  Mesh mesh(2, 1, {}, kShort);
  torch::Tensor dw = torch::ones({4, 3});
  const auto start = Clock::now();
  const absl::Status failed = mesh[0].SumOverReplicas(dw);  // replica 1 never comes
  const double waited = Seconds(Clock::now() - start);
  EXPECT_EQ(failed.code(), absl::StatusCode::kDeadlineExceeded) << failed;
  EXPECT_TRUE(IsGroupFailure(failed));
  EXPECT_GE(waited, 0.9 * 0.3);
  EXPECT_LT(waited, 1.5);
  const core::ErrorReason reason = core::ReasonOf(failed);
  EXPECT_EQ(reason.reason, "GROUP_TIMEOUT");
  EXPECT_EQ(reason.metadata.at("op"), "reduce");
  EXPECT_EQ(reason.metadata.at("rank"), "0");
  EXPECT_TRUE(absl::StrContains(failed.message(), "head group: reduce failed on rank 0 of 2"))
      << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "rank(s) 1")) << failed;
  EXPECT_TRUE(torch::equal(dw, torch::ones({4, 3})));  // nothing summed into it
  EXPECT_EQ(mesh[0].reduced_bytes(), 0);

  // The group stays broken, as a c10d group after a lost rank: later collectives fail at once,
  // on the replica that timed out and on the one that comes late.
  for (int r : {0, 1}) {
    const auto again = Clock::now();
    const auto verdicts = mesh[r].ExchangeVerdicts(absl::OkStatus());
    EXPECT_EQ(verdicts.status().code(), absl::StatusCode::kUnavailable) << r;
    EXPECT_EQ(core::ReasonOf(verdicts.status()).reason, "GROUP_UNAVAILABLE") << r;
    EXPECT_LT(Seconds(Clock::now() - again), 0.25) << r;  // not another timeout
  }
}

// A mesh command as the leader and the other fronts run it: appended to the mesh's log, each
// front's part summing dW over the replicas. The transport carries a command as bytes with a
// name; what the bytes mean is the layers' above it.
HeadGroup::Command Ping() { return {.name = "ping", .bytes = "ping"}; }

TEST(HeadMeshTest, MeshCommandsRunOnEveryFrontInOrder) {
  Mesh mesh(3);
  constexpr int kCommands = 2;
  std::vector<std::atomic<bool>> stop(3);
  std::vector<std::vector<float>> seen(3);
  // Every front's part of command i: its dW (replica + 1, then × 10 for the next) summed.
  auto part = [&](int r) {
    const float mine = static_cast<float>(r + 1) * (seen[r].empty() ? 1.0f : 10.0f);
    torch::Tensor dw = torch::full({2, 2}, mine);
    const absl::Status status = mesh[r].SumOverReplicas(dw);
    seen[r].push_back(dw[0][0].item<float>());
    return status;
  };
  const auto results = mesh.OnAll([&](int r) -> absl::Status {
    if (r != 0) {
      return mesh[r].fronts()->Follow(
          [&](const std::string& command) {
            EXPECT_EQ(command, "ping");
            const absl::Status status = part(r);
            if (seen[r].size() == static_cast<size_t>(kCommands)) stop[r] = true;
            return status;
          },
          stop[r]);
    }
    for (int i = 0; i < kCommands; ++i) {
      absl::StatusOr<HeadGroup::Lane> lane = mesh[0].fronts()->Enter();
      const absl::Status run =
          lane.ok() ? lane->Run(Ping(), [&] { return part(0); }) : lane.status();
      if (!run.ok()) {
        for (std::atomic<bool>& s : stop) s = true;  // the followers wait for no more
        return run;
      }
    }
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_TRUE(results[r].ok()) << results[r];
    EXPECT_EQ(seen[r], (std::vector<float>{6, 60}));
    EXPECT_TRUE(mesh[r].health().ok());
    EXPECT_EQ(mesh.log(r).str(), "");  // nothing refused
  }
  // Every command answered: the log's keys are gone (the nonces stay).
  EXPECT_EQ(mesh.store().Keys("remotehead/shard/0/commands/cmd/"), std::vector<std::string>{});
  EXPECT_EQ(mesh.store().Keys("remotehead/shard/0/commands/reply/"), std::vector<std::string>{});
}

TEST(HeadMeshTest, ATransportFailureInAMeshCommandTakesTheMeshDown) {
  Mesh mesh(3, 1, {}, kShort);
  // Replica 1 follows the mesh's log; replica 2 hangs (never takes the command).
  std::atomic<bool> stop{false};
  std::atomic<int> executed{0};
  auto execute = [&](int r) {
    return [&, r](const std::string&) {
      ++executed;
      torch::Tensor dw = torch::ones({4});
      return mesh[r].SumOverReplicas(dw);
    };
  };
  auto follower =
      std::async(std::launch::async, [&] { return mesh[1].fronts()->Follow(execute(1), stop); });
  // Whatever fails below, the follower stops before its future is waited for.
  const absl::Cleanup stop_following = [&] { stop = true; };

  const auto start = Clock::now();
  absl::StatusOr<HeadGroup::Lane> lane = mesh[0].fronts()->Enter();
  ASSERT_TRUE(lane.ok()) << lane.status();
  torch::Tensor dw = torch::ones({4});
  const absl::Status run = lane->Run(Ping(), [&] { return mesh[0].SumOverReplicas(dw); });
  lane = absl::UnknownError("lane released");
  EXPECT_LT(Seconds(Clock::now() - start), 1.5);
  // The replies name the replica that never answered.
  EXPECT_EQ(run.code(), absl::StatusCode::kUnavailable) << run;
  EXPECT_TRUE(absl::StrContains(run.message(), "rank 2")) << run;

  // The leader is down for good: health says why, and no later command enters.
  EXPECT_FALSE(mesh[0].health().ok());
  EXPECT_TRUE(IsGroupFailure(mesh[0].health())) << mesh[0].health();
  const absl::StatusOr<HeadGroup::Lane> later = mesh[0].fronts()->Enter();
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(core::ReasonOf(later.status()).reason, "GROUP_UNAVAILABLE");
  EXPECT_TRUE(absl::StrContains(later.status().message(), "is down since")) << later.status();
  // …and it declared so in the log, for the other fronts.
  EXPECT_TRUE(mesh.store().Peek("remotehead/shard/0/commands/down").has_value());

  // The follower whose part failed leaves the log, down too.
  if (follower.wait_for(std::chrono::seconds(3)) != std::future_status::ready) stop = true;
  const absl::Status left = follower.get();
  EXPECT_EQ(left.code(), absl::StatusCode::kUnavailable) << left;
  EXPECT_FALSE(mesh[1].health().ok());
  EXPECT_EQ(executed.load(), 1);

  // The replica that hung, continued: it takes the command the leader gave up on, sees the
  // declaration and leaves without running it.
  const absl::Status late = mesh[2].fronts()->Follow(execute(2), stop);
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << late;
  EXPECT_TRUE(absl::StrContains(late.message(), "declared the group down")) << late;
  EXPECT_EQ(executed.load(), 1);
  EXPECT_FALSE(mesh[2].health().ok());
  EXPECT_LT(Seconds(Clock::now() - start), 2.0);
}

}  // namespace
}  // namespace remotehead::server::head_mesh_test
