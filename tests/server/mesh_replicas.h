// A mesh's processes in one process, for tests of its steps (mesh_steps_test.cc): R replicas of
// K ranks, their groups in-process (in_process_mesh.h: threads, one store, no sockets), each
// process with its own registry, admission, HeadOperations and ReplicatedHeadOperations as
// ServiceContext builds them, the fronts other than the leader following the mesh's log
// (MeshFollower::Run) and a replica's other ranks its own log (GroupFollower::Run); and a step
// run as the server runs it (RunStep), with what the tests read back.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/service/admission.h"
#include "remotehead/server/service/head_registry.h"
#include "replication/group_follower.h"
#include "replication/mesh_steps.h"
#include "replication/replicated_head_operations.h"
#include "rpc/front_address.h"
#include "server/in_process_mesh.h"
#include "service/head_operations.h"
#include "service/sync_steps.h"

namespace remotehead::server::mesh_testing {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr char kSecret[] = "the-mesh-secret-0123456789abcdef";
constexpr char kHead[] = "lm";
constexpr int64_t kVocab = 12;  // two shards of 6 rows with K = 2
constexpr int64_t kHidden = 4;
// The mesh's logs and collectives: never reached by a test that passes.
constexpr milliseconds kLogTimeout{5000};
// How long a front waits for its own trainers: long enough never to be reached where they all
// come; the cases where some never do use kShortWait.
constexpr milliseconds kWait{1500};
constexpr milliseconds kShortWait{200};
constexpr double kLr = 0.5;
constexpr double kGradScale = 2.0;

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// One process of the mesh, as ServiceContext builds it over what JoinCluster gives it.
struct Process {
  HeadRegistry registry;
  AdmissionController admission{AdmissionOptions{}};
  std::ostringstream log;
  std::unique_ptr<Liveness> liveness;        // as JoinCluster's: outlives what holds it
  std::unique_ptr<HeadGroup> replica_group;  // K > 1 only
  std::unique_ptr<HeadMesh> mesh;
  std::unique_ptr<HeadOperations> local;
  std::unique_ptr<ReplicatedHeadOperations> operations;
  std::unique_ptr<GroupFollower> follower;
  std::unique_ptr<MeshFollower> mesh_follower;
};

struct MeshSetup {
  int replicas = 2;
  int ranks_per_replica = 1;
  milliseconds wait = kWait;  // ReplicatedHeadOperations' mesh_wait
  MeshOptions options;
};

// Every process of a mesh [R, K], its followers running until the mesh is destroyed (stopped and
// joined on every path, before anything they use goes away).
class Replicas {
 public:
  explicit Replicas(const MeshSetup& setup)
      : groups_(setup.replicas, setup.ranks_per_replica, kLogTimeout),
        followed_(static_cast<size_t>(groups_.size())) {
    for (int g = 0; g < size(); ++g) processes_.push_back(std::make_unique<Process>());
    // As JoinCluster: the replica's group, then on a replica's front the fronts' group (the
    // mesh's log), each opened by all of its ranks at once.
    std::vector<absl::Status> opened(static_cast<size_t>(size()));
    groups_.RunOnAll([&](int g) {
      Process& p = at(g);
      ProcessGroup::Mesh joined = groups_.Join(g);
      const GroupConfig config = groups_.config(g);
      absl::Status& status = opened[static_cast<size_t>(g)];
      if (joined.replica != nullptr) {
        p.replica_group = std::make_unique<HeadGroup>(std::move(joined.replica), kSecret, &p.log);
        status.Update(p.replica_group->Open());
      }
      std::unique_ptr<HeadGroup> fronts;
      if (config.rank_in_replica() == 0) {
        fronts = std::make_unique<HeadGroup>(std::move(joined.shard), kSecret, &p.log);
        status.Update(fronts->Open());
      }
      p.mesh = std::make_unique<HeadMesh>(config.replica(), setup.replicas, setup.options,
                                          std::move(fronts), std::move(joined.shard));
    });
    for (int g = 0; g < size(); ++g) {
      EXPECT_TRUE(opened[static_cast<size_t>(g)].ok()) << g << ": " << opened[g];
    }
    // Every process beats (global rank 0 first: it opens the session the others read).
    for (int g = 0; g < size(); ++g) {
      Process& p = at(g);
      const GroupConfig config = groups_.config(g);
      absl::StatusOr<std::unique_ptr<Liveness>> liveness =
          Liveness::Start(config, &p.log, Liveness::Timing{.lost = config.timeout},
                          std::make_unique<testing::InProcessKeyValueStore>(
                              groups_.shared_store(), config.prefix + "/liveness"));
      EXPECT_TRUE(liveness.ok()) << g << ": " << liveness.status();
      if (!liveness.ok()) continue;
      p.liveness = *std::move(liveness);
      if (p.replica_group != nullptr) p.replica_group->set_liveness(p.liveness.get());
      if (p.mesh->fronts() != nullptr) p.mesh->fronts()->set_liveness(p.liveness.get());
      p.mesh->set_liveness(p.liveness.get());
    }
    for (int g = 0; g < size(); ++g) {
      Process& p = at(g);
      p.local =
          std::make_unique<HeadOperations>(&p.registry, &p.admission, torch::kCPU, &p.log, nullptr,
                                           nullptr, p.replica_group.get(), p.mesh.get());
      p.operations = std::make_unique<ReplicatedHeadOperations>(
          p.local.get(), p.replica_group.get(), p.mesh.get(), /*checkpoint_every_steps=*/0,
          setup.wait);
      p.follower = std::make_unique<GroupFollower>(p.local.get(), &p.registry,
                                                   p.replica_group.get(), torch::kCPU);
      p.mesh_follower =
          std::make_unique<MeshFollower>(p.mesh.get(), p.replica_group.get(), p.follower.get(),
                                         &p.operations->mesh_steps(), p.operations.get());
    }
    // The followers, as the server runs them: a front other than the leader follows the mesh's
    // log (FollowMesh), a replica's other ranks their replica's (FollowGroup).
    for (int g = 0; g < size(); ++g) {
      Process& p = at(g);
      absl::Status* followed = &followed_[static_cast<size_t>(g)];
      if (p.mesh->is_front() && !p.mesh->is_leader()) {
        threads_.emplace_back([this, &p, followed] { *followed = p.mesh_follower->Run(stop_); });
      } else if (p.replica_group != nullptr && !p.replica_group->is_front()) {
        threads_.emplace_back([this, &p, followed] { *followed = p.follower->Run(stop_); });
      }
    }
  }
  ~Replicas() { StopFollowers(); }
  Replicas(const Replicas&) = delete;
  Replicas& operator=(const Replicas&) = delete;

  // Stops and joins every follower; what each returned, by global rank (OK: it left on `stop`).
  const std::vector<absl::Status>& StopFollowers() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    return followed_;
  }

  int size() const { return groups_.size(); }
  int replicas() const { return groups_.replicas(); }
  int ranks_per_replica() const { return groups_.ranks_per_replica(); }
  Process& at(int g) { return *processes_[static_cast<size_t>(g)]; }
  // Replica r's front (global rank r·K): where its trainers' calls land.
  Process& front(int r) { return at(r * ranks_per_replica()); }
  ReplicatedHeadOperations& operations(int r) { return *front(r).operations; }
  HeadMesh& mesh(int r) { return *front(r).mesh; }
  // The store every process of the mesh shares, and where the processes' liveness keeps its keys
  // in it (settled decisions among them: "<prefix>settled/decision/<attempt>").
  testing::InProcessStore& store() { return *groups_.shared_store(); }
  std::string liveness_prefix() const { return groups_.config(0).prefix + "/liveness/"; }

 private:
  testing::InProcessMesh groups_;  // outlives the processes, whose groups are its members
  std::vector<std::unique_ptr<Process>> processes_;
  std::atomic<bool> stop_{false};
  std::vector<absl::Status> followed_;  // by global rank
  std::vector<std::thread> threads_;
};

inline core::HeadInit Init(int64_t hidden = kHidden) {
  return {
      .vocab_size = kVocab, .hidden_size = hidden, .dtype = torch::kFloat, .bias = true, .seed = 7};
}

inline OptimizerStepSpec Sgd(double lr = kLr, double grad_scale = kGradScale, bool zero = true,
                             double momentum = 0) {
  return {.optimizer = core::SgdOptions{.lr = lr, .momentum = momentum},
          .grad_scale = grad_scale,
          .zero_gradients = zero};
}

// What replica r's trainers asked for, as SynchronousSteps hands it to the step: the first of
// them (rank r of a world of `world` trainers; rank t dials replica t mod R).
inline SyncStepRequest TrainersOf(int replica, int world, int64_t step = 0, double lr = kLr) {
  return {.head_id = kHead,
          .step = step,
          .rank = replica,
          .world_size = world,
          .spec = Sgd(lr),
          .expected_incarnation = ""};
}

// The step as SynchronousSteps applies it: grad_scale divided by the world size.
inline OptimizerStepSpec Applied(const SyncStepRequest& first) {
  OptimizerStepSpec spec = first.spec;
  spec.grad_scale /= first.world_size;
  return spec;
}

// A replica's whole head, its rows gathered from its ranks' registries.
struct HeadState {
  torch::Tensor weight, bias, dweight, dbias;
  int64_t version = -1;
};

inline HeadState StateOf(Replicas& m, int replica) {
  std::vector<torch::Tensor> w, b, dw, db;
  HeadState state;
  for (int k = 0; k < m.ranks_per_replica(); ++k) {
    absl::StatusOr<std::shared_ptr<HeadEntry>> entry =
        m.at(replica * m.ranks_per_replica() + k).registry.Get(kHead);
    EXPECT_TRUE(entry.ok()) << entry.status();
    if (!entry.ok()) return state;
    (*entry)->Read([&](const core::Head& h) {
      w.push_back(h.weight().clone());
      b.push_back(h.bias().clone());
      dw.push_back(h.grads().weight.clone());
      db.push_back(h.grads().bias.clone());
      state.version = h.version();
    });
  }
  state.weight = torch::cat(w);
  state.bias = torch::cat(b);
  state.dweight = torch::cat(dw);
  state.dbias = torch::cat(db);
  return state;
}

// Every rank of replica r: its rows of `dw` / `db` (the whole head's) as its accumulated dW.
inline void SetGradients(Replicas& m, int replica, const torch::Tensor& dw,
                         const torch::Tensor& db) {
  for (int k = 0; k < m.ranks_per_replica(); ++k) {
    absl::StatusOr<std::shared_ptr<HeadEntry>> entry =
        m.at(replica * m.ranks_per_replica() + k).registry.Get(kHead);
    ASSERT_TRUE(entry.ok()) << entry.status();
    const std::vector<core::ShardRange>& shards = (*entry)->shards();
    const core::ShardRange mine =
        shards.empty() ? core::ShardRange{0, kVocab} : shards[static_cast<size_t>(k)];
    (*entry)->Write([&](core::Head& h) {
      h.grads().weight.copy_(dw.narrow(0, mine.offset, mine.rows));
      h.grads().bias.copy_(db.narrow(0, mine.offset, mine.rows));
    });
  }
}

inline bool Same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::equal(a, b);
}

// The head created on every replica through the leader (its followers create it on theirs) and
// each replica's dW / db set to known values (multiples of 1/16: their float sums are exact).
struct Gradients {
  std::vector<torch::Tensor> dw, db;  // by replica
  torch::Tensor dw_sum, db_sum;
};

inline Gradients CreateWithGradients(Replicas& m) {
  const absl::StatusOr<HeadDescription> created = m.operations(0).CreateFromSeed(kHead, Init());
  EXPECT_TRUE(created.ok()) << created.status();
  Gradients g;
  g.dw_sum = torch::zeros({kVocab, kHidden});
  g.db_sum = torch::zeros({kVocab});
  for (int r = 0; r < m.replicas(); ++r) {
    g.dw.push_back(
        (torch::arange(kVocab * kHidden, torch::kFloat).reshape({kVocab, kHidden}) * (r + 1) -
         7 * r) /
        16);
    g.db.push_back((torch::arange(kVocab, torch::kFloat) - 3 * r) / 16);
    SetGradients(m, r, g.dw.back(), g.db.back());
    g.dw_sum += g.dw.back();
    g.db_sum += g.db.back();
  }
  return g;
}

// Each replica's outcome of a step: unset where nobody asked that replica's front for it.
using Outcome = std::optional<absl::StatusOr<HeadDescription>>;

// One step of the mesh as the server runs it: every replica whose trainers asked
// (trainers[r] set; r ≥ 1) calls StepOptimizer on its front on a thread of its own, as
// SynchronousSteps does once its trainers all came; the leader's call (trainers[0], or an
// unsynchronized step of `leader_spec` where unset) starts `leader_after` later.
inline std::vector<Outcome> RunStep(Replicas& m,
                                    const std::vector<std::optional<SyncStepRequest>>& trainers,
                                    milliseconds leader_after = milliseconds(0),
                                    const OptimizerStepSpec& leader_spec = Sgd()) {
  std::vector<std::future<absl::StatusOr<HeadDescription>>> calls;
  for (int r = 1; r < m.replicas(); ++r) {
    const std::optional<SyncStepRequest> first = trainers[static_cast<size_t>(r)];
    if (!first.has_value()) {
      calls.emplace_back();
      continue;
    }
    calls.push_back(std::async(std::launch::async, [&m, r, first] {
      return m.operations(r).StepOptimizer(kHead, first, Applied(*first));
    }));
  }
  std::this_thread::sleep_for(leader_after);
  const std::optional<SyncStepRequest>& mine = trainers[0];
  std::vector<Outcome> out;
  out.emplace_back(
      m.operations(0).StepOptimizer(kHead, mine, mine.has_value() ? Applied(*mine) : leader_spec));
  for (auto& call : calls) {
    if (call.valid()) {
      out.emplace_back(call.get());
    } else {
      out.emplace_back(std::nullopt);
    }
  }
  return out;
}

// Every replica's trainers, R·2 of them (ranks r and r + R on replica r's front).
inline std::vector<std::optional<SyncStepRequest>> EveryReplicasTrainers(int replicas,
                                                                         int64_t step = 0) {
  std::vector<std::optional<SyncStepRequest>> trainers;
  for (int r = 0; r < replicas; ++r) trainers.push_back(TrainersOf(r, 2 * replicas, step));
  return trainers;
}

}  // namespace remotehead::server::mesh_testing
