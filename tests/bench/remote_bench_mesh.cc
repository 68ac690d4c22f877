// remotehead-remote-bench --replicas R: W trainers (threads of this process, each a client with
// its own rank, at fronts[rank mod R]) each add the dW of an N-token micro-batch and take the
// synchronous SGD step together, for --steps steps after one untimed step; first on one replica
// (R = 1: a server, or a group of K), then on the mesh of R replicas, each started here on
// loopback. Reported: aggregate tokens/s of both and their ratio, and, from the leader's
// /metrics, the dW bytes it summed over the replicas per step (against its shard of W, V/K·D·4
// bytes: the whole model for K = 1) and that sum's time as a share of the step. On a machine where
// trainers and servers share the cores the ratio says what the mesh costs here, not what R machines
// gain.
#include "bench/remote_bench_mesh.h"

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_metrics.h"
#include "remotehead/client/client.h"
#include "remotehead/core/torch_api.h"
#include "support/child_process.h"

ABSL_FLAG(int32_t, replicas, 0,
          "> 1: the mesh bench: --trainers trainers on R replicas of --group_size ranks (1 when "
          "unset) against the same trainers on one replica (the first --shapes N:D:V: N tokens "
          "per trainer and step)");
ABSL_FLAG(int32_t, trainers, 0, "with --replicas: data-parallel trainers (0: 2 per replica)");
ABSL_FLAG(int32_t, steps, 5, "with --replicas: timed synchronous steps (after one untimed)");

namespace remotehead::bench {
namespace {

namespace rh = remotehead;
using Clock = std::chrono::steady_clock;
constexpr char kMeshHead[] = "bench-mesh";

void Die(const std::string& what, const absl::Status& status) {
  std::cerr << "remotehead-remote-bench: " << what << ": " << status << std::endl;
  std::exit(1);
}

// R replicas of K ranks on loopback (one server when R·K = 1), each with its /metrics.
struct Replicas {
  std::unique_ptr<rh::testing::ServerProcess> single;
  std::vector<std::unique_ptr<rh::testing::ChildProcess>> ranks;
  std::vector<std::string> fronts;
  int leader_metrics_port = 0;
};

Replicas Start(const MeshBenchSetup& setup, int replicas) {
  Replicas out;
  const int size = replicas * setup.ranks_per_replica;
  auto argv = [&](int) {
    std::vector<std::string> args = {setup.server,
                                     "--listen=127.0.0.1:0",
                                     "--device=cpu",
                                     "--memory_budget_bytes=0",
                                     "--metrics_address=127.0.0.1:0",
                                     "--sync_step_timeout_seconds=600"};
    for (const auto& a : setup.server_args) args.push_back(a);
    if (size > 1) args.push_back(absl::StrCat("--group_replicas=", replicas));
    return args;
  };
  auto metrics_port = [](const std::string& log) {
    const std::string prefix = "metrics on port ";
    const size_t at = log.find(prefix);
    int port = 0;
    if (at != std::string::npos) absl::SimpleAtoi(log.substr(at + prefix.size(), 5), &port);
    return port;
  };
  if (size == 1) {
    out.single = std::make_unique<rh::testing::ServerProcess>(argv(0));
    if (out.single->port() == 0)
      Die("the server did not start", absl::UnknownError(out.single->log()));
    out.fronts = {out.single->target()};
    out.leader_metrics_port = metrics_port(out.single->log());
    return out;
  }
  out.ranks = rh::testing::StartHeadGroup(size, argv);
  for (int r = 0; r < replicas; ++r) {
    const auto& front = out.ranks[static_cast<size_t>(r * setup.ranks_per_replica)];
    const int port = rh::testing::ServerProcess::ParsePort(front->ready_line());
    if (port == 0) Die("a front did not start", absl::UnknownError(front->log()));
    out.fronts.push_back(absl::StrCat("127.0.0.1:", port));
  }
  out.leader_metrics_port = metrics_port(out.ranks[0]->log());
  return out;
}

struct Run {
  double tokens_per_second = 0;
  double step_seconds = 0;
  double reduced_bytes_per_step = 0;
  double reduce_seconds_per_step = 0;
};

// W trainers, one untimed step then `steps` timed ones.
Run Train(const MeshBenchSetup& setup, const Replicas& replicas, int trainers, int steps) {
  std::vector<std::shared_ptr<rh::client::Client>> clients;
  for (int t = 0; t < trainers; ++t) {
    auto client = rh::client::Client::Create({.fronts = replicas.fronts,
                                              .rank = t,
                                              .chunk_bytes = setup.chunk_bytes,
                                              .max_receive_message_bytes = 64 << 20});
    if (!client.ok()) Die("Client::Create", client.status());
    clients.push_back(*std::move(client));
  }
  auto created =
      clients[0]->CreateHead(kMeshHead, {.vocab_size = setup.v, .hidden_size = setup.d, .seed = 1});
  if (!created.ok()) Die("CreateHead", created.status());
  std::vector<rh::client::StepInputs> inputs;
  for (int t = 0; t < trainers; ++t) {
    torch::manual_seed(100 + t);
    inputs.push_back({.hidden = torch::randn({setup.n, setup.d}),
                      .targets = torch::randint(setup.v, {setup.n}, torch::kLong)});
  }
  auto step = [&](int64_t s) {
    std::vector<std::thread> threads;
    std::vector<absl::Status> failed(static_cast<size_t>(trainers));
    for (int t = 0; t < trainers; ++t) {
      threads.emplace_back([&, t] {
        rh::client::StepSpec spec;
        spec.head_id = kMeshHead;
        spec.reduction = rh::client::Reduction::kSum;
        spec.gradient_id = rh::client::GradientId{absl::StrCat("trainer-", t), s, 0};
        auto fb = clients[t]->ForwardBackward(spec, inputs[t]);
        if (!fb.ok()) {
          failed[t] = fb.status();
          return;
        }
        failed[t] =
            clients[t]
                ->OptimizerStep(kMeshHead, {.optimizer = rh::client::Sgd{.lr = 1e-3},
                                        .zero_gradients = true,
                                        .synchronous =
                                            rh::client::SynchronousStep{
                                                .step = s, .rank = t, .world_size = trainers}})
                .status();
      });
    }
    for (auto& thread : threads) thread.join();
    for (const absl::Status& status : failed) {
      if (!status.ok()) Die(absl::StrCat("step ", s), status);
    }
  };
  step(0);
  const std::string before = ScrapeMetrics(replicas.leader_metrics_port);
  const auto start = Clock::now();
  for (int s = 1; s <= steps; ++s) step(s);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string after = ScrapeMetrics(replicas.leader_metrics_port);
  auto delta = [&](const std::string& name) {
    return (MetricValue(after, name) - MetricValue(before, name)) / steps;
  };
  return {.tokens_per_second = static_cast<double>(trainers) * setup.n * steps / seconds,
          .step_seconds = seconds / steps,
          .reduced_bytes_per_step = delta("remotehead_mesh_reduced_bytes_total"),
          .reduce_seconds_per_step = delta("remotehead_mesh_reduce_seconds_total")};
}

}  // namespace

int RunMeshBench(const MeshBenchSetup& setup) {
  const int replicas = absl::GetFlag(FLAGS_replicas);
  const int trainers =
      absl::GetFlag(FLAGS_trainers) > 0 ? absl::GetFlag(FLAGS_trainers) : 2 * replicas;
  const int steps = absl::GetFlag(FLAGS_steps);
  if (trainers < replicas || steps < 1) {
    std::cerr << "--trainers, --steps: expected at least one trainer per replica and one step; "
              << "got " << trainers << " trainers for " << replicas << " replicas, " << steps
              << " steps" << std::endl;
    return 2;
  }
  const Run one = Train(setup, Start(setup, 1), trainers, steps);
  const Run mesh = Train(setup, Start(setup, replicas), trainers, steps);
  // Each rank sums its own rows over the replicas: the leader (rank 0) holds the first shard,
  // which gets the extra row of an uneven split.
  const int64_t k = setup.ranks_per_replica;
  const double shard_bytes = static_cast<double>((setup.v + k - 1) / k) * setup.d * 4;
  nlohmann::json report = {
      {"shape", absl::StrCat(setup.n, ":", setup.d, ":", setup.v)},
      {"replicas", replicas},
      {"ranks_per_replica", setup.ranks_per_replica},
      {"trainers", trainers},
      {"steps", steps},
      {"one_replica_tokens_per_second", one.tokens_per_second},
      {"mesh_tokens_per_second", mesh.tokens_per_second},
      {"mesh_over_one_replica", mesh.tokens_per_second / one.tokens_per_second},
      {"mesh_step_seconds", mesh.step_seconds},
      {"reduced_bytes_per_step", mesh.reduced_bytes_per_step},
      {"shard_bytes", shard_bytes},
      {"reduced_over_shard", mesh.reduced_bytes_per_step / shard_bytes},
      {"reduce_seconds_per_step", mesh.reduce_seconds_per_step},
      {"reduce_share_of_step", mesh.reduce_seconds_per_step / mesh.step_seconds}};
  if (setup.json) {
    std::cout << report.dump() << std::endl;
    return 0;
  }
  std::cout << absl::StrFormat(
      "mesh %d x %d, %d trainers, %s, %d steps (cores shared by trainers and servers)\n"
      "  one replica   %10.0f tokens/s\n"
      "  mesh          %10.0f tokens/s  (%.2fx one replica)\n"
      "  dW summed     %10.2f MiB/step  (%.2fx the leader's shard of W, %.2f MiB)\n"
      "  sum's time    %10.1f ms/step   (%.1f%% of the step's %.1f ms)\n",
      replicas, setup.ranks_per_replica, trainers, report["shape"].get<std::string>(), steps,
      one.tokens_per_second, mesh.tokens_per_second, mesh.tokens_per_second / one.tokens_per_second,
      mesh.reduced_bytes_per_step / (1 << 20), mesh.reduced_bytes_per_step / shard_bytes,
      shard_bytes / (1 << 20), mesh.reduce_seconds_per_step * 1e3,
      100 * mesh.reduce_seconds_per_step / mesh.step_seconds, mesh.step_seconds * 1e3);
  return 0;
}

}  // namespace remotehead::bench
