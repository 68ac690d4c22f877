// remotehead-remote-bench: one fused LM-head step (cross-entropy mean: loss, dX, dW accumulated)
// through the real remotehead-server on loopback, against the same step in-process, measured
// in one run. For each shape N:D:V (fp32):
//
//   in_process   core::FusedForwardBackward in this process, with the head's health as the server
//                computes it (the compute floor of the remote step)
//   remote       client::Client::ForwardBackward to the server binary, which this program starts
//                (rows streamed up while dX streams down; the server pipelines compute)
//   up / down    the same bytes as X and dX moved alone, through the same client and server:
//                X up by a Forward on a one-token head (the step's streaming path, next to no
//                compute, only a summary back); X-sized down by ExportWeights of an [N, D] head
//   serial       up + in_process + down: the step with transfer and compute not overlapped
//
// Reported: remote / in_process (acceptance: ≤ 1.10 at 2048:1024:32000), overlap = remote /
// serial (< 1 means transfer and compute overlapped; aim ≤ 0.85 at 16384:2048:256), wire
// goodput = (X bytes + dX bytes) / (up + down) (aim ≥ 1 GB/s), and the server's own phase
// breakdown of the remote step (StepSummary.timings: compute, waiting for rows, waiting for the
// client to take results). Times are medians over --repeats after --warmup untimed runs; the
// remote result is checked against the in-process one (loss, dX).
//
// Per shape also a step with half of its rows masked (masked_rows.h): unmasked, every row sent,
// compacted — bytes on the wire (the server's own metrics) and the server's compute.
//
// With --group_size K (≥ 2) the same remote step also runs on a head group of K server
// processes on loopback (Gloo), started next to the single server: reported are its step time
// against the single server's (on this machine the ranks share its cores, so the ratio says
// what the group costs here, not what K GPUs gain), its results against the single server's
// (loss, dX, the gathered dW), and the bytes each rank's collectives sent and received per
// token, measured from the ranks' own counters (remotehead_group_collective_bytes_total,
// scraped from each rank's /metrics before and after one step), next to the cost model's bytes
// for cross-entropy (GroupBytesModel) and the statistics' share of them.
//
// With --replicas R (≥ 2) it runs the mesh bench instead (remote_bench_mesh.h): W trainers on R
// replicas against the same trainers on one replica, and the dW sum's bytes and time per step.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_flags.h"
#include "bench/bench_measure.h"
#include "bench/bench_metrics.h"
#include "bench/bench_plot.h"
#include "bench/loopback_limit.h"
#include "bench/masked_rows.h"
#include "bench/remote_bench_mesh.h"
#include "bench/remote_bench_table.h"
#include "bench/striped_wire.h"
#include "remotehead/client/client.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"
#include "support/child_process.h"

ABSL_FLAG(std::vector<std::string>, shapes,
          std::vector<std::string>({"2048:1024:32000", "16384:2048:256"}),
          "N:D:V shapes (comma list)");
ABSL_FLAG(int32_t, repeats, 3, "timed repetitions (the median is reported)");
ABSL_FLAG(int32_t, warmup, 1, "untimed repetitions before the timed ones");
ABSL_FLAG(std::string, server, REMOTEHEAD_SERVER_BINARY, "the remotehead-server binary to start");
ABSL_FLAG(std::vector<std::string>, server_args, {},
          "extra flags for the server, e.g. --compute_threads=1");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{1} << 20, "client request message size");
ABSL_FLAG(int32_t, threads, 0, "torch::set_num_threads in this process when > 0");
ABSL_FLAG(bool, json, false, "print one JSON object on stdout instead of the table");
ABSL_FLAG(int64_t, loopback_bytes, int64_t{256} << 20,
          "bytes sent through one loopback TCP connection to measure its limit (0: not measured)");
ABSL_FLAG(std::vector<std::string>, streams, std::vector<std::string>({"1", "4"}),
          "stream counts of the striped wire probe (X up, dX down on a two-token head); empty: "
          "not measured");
ABSL_FLAG(int32_t, group_size, 0,
          "also run the step on a head group of this many server processes (0: none)");
ABSL_FLAG(std::string, plot, "",
          "also measure naive (full logits, in-process) and the remote two-phase step, and draw "
          "time and the trainer's peak memory against N (naive, PyTorch's linear_cross_entropy "
          "— measured too —, fused in-process and remote, two-phase remote) into this PNG");
ABSL_FLAG(std::string, python, REMOTEHEAD_PYTHON,
          "the Python (torch, matplotlib) that runs plot_bench.py for --plot");
ABSL_FLAG(bool, check, false,
          "exit 1 unless the remote results equal the in-process ones (loss and dX within 1e-5 "
          "of their magnitude) and the echoed bytes are exact (no timing checks)");

namespace {

namespace rh = remotehead;
namespace bench = remotehead::bench;
using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t n = 0, d = 0, v = 0;
};

using bench::OrDie;

// bench::Measure on the CPU with the flags' warmup and repeats: the median wall time and the
// transient bytes this process allocated during the last run (the trainer's side of a remote
// step).
bench::Measurement MeasureStep(const std::function<void()>& fn) {
  return OrDie(bench::Measure(
                   torch::kCPU, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_repeats), [] {},
                   [&] {
                     fn();
                     return absl::OkStatus();
                   }),
               "measure");
}

double TimeIt(const std::function<void()>& fn) { return MeasureStep(fn).seconds; }

// A head group of server processes on loopback, each serving /metrics on a port of its own.
struct Group {
  std::vector<std::unique_ptr<rh::testing::ChildProcess>> ranks;
  std::vector<int> metrics_ports;
  std::shared_ptr<rh::client::Client> client;  // of the front
};

int PortAfter(const std::string& log, const std::string& prefix) {
  const size_t at = log.find(prefix);
  int port = 0;
  if (at != std::string::npos) absl::SimpleAtoi(log.substr(at + prefix.size(), 5), &port);
  return port;
}

std::unique_ptr<Group> StartGroup(int size) {
  auto group = std::make_unique<Group>();
  group->ranks = rh::testing::StartHeadGroup(size, [](int) {
    std::vector<std::string> argv = {absl::GetFlag(FLAGS_server), "--listen=127.0.0.1:0",
                                     "--device=cpu", "--memory_budget_bytes=0",
                                     "--metrics_address=127.0.0.1:0"};
    for (const auto& a : absl::GetFlag(FLAGS_server_args)) argv.push_back(a);
    return argv;
  });
  for (auto& rank : group->ranks) {
    if (rh::testing::ServerProcess::ParsePort(rank->ready_line()) == 0) {
      std::cerr << "remotehead-remote-bench: a rank of the head group did not start:\n"
                << rank->log();
      std::exit(1);
    }
    group->metrics_ports.push_back(PortAfter(rank->log(), "metrics on port "));
  }
  const int port = rh::testing::ServerProcess::ParsePort(group->ranks[0]->ready_line());
  group->client = OrDie(rh::client::Client::Create({.target = absl::StrCat("127.0.0.1:", port),
                                                    .chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes),
                                                    .max_receive_message_bytes = 64 << 20}),
                        "Client::Create (head group)");
  return group;
}

// A rank's collective bytes so far, by "op/direction", from its /metrics.
std::map<std::string, double> CollectiveBytes(int port) {
  std::map<std::string, double> bytes;
  std::istringstream lines(bench::ScrapeMetrics(port));
  const std::string family = "remotehead_group_collective_bytes_total{";
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(family, 0) != 0) continue;
    auto label = [&](const std::string& name) {
      const size_t at = line.find(name + "=\"");
      return at == std::string::npos
                 ? std::string()
                 : line.substr(at + name.size() + 2,
                               line.find('"', at + name.size() + 2) - at - name.size() - 2);
    };
    double value = 0;
    absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value);
    bytes[label("op") + "/" + label("direction")] = value;
  }
  return bytes;
}

// The cost model of a head group's cross-entropy step (fp32 head, int64 targets), in bytes per
// token each rank hands to (sent) and takes from (received) its collectives:
//   X and targets broadcast by the front: (D·4 + 8) per token, sent K−1 times by the front;
//   the statistics: one all-gather per block of (lse, target logit), 2 fp32 per token, sent to
//   and received from each of the K−1 others by every rank;
//   dX partials reduced to the front in fp32: D·4 sent by each other rank, K−1 of them received
//   by the front;
// plus a 4-byte stop flag all-gathered per chunk (per_chunk, divided by the chunk's rows).
struct RankBytes {
  double sent = 0, received = 0, statistics = 0;
};
RankBytes GroupBytesModel(int rank, int size, int64_t d, double chunks_per_token) {
  const double peers = size - 1;
  const double stats = 2 * 4 * peers;  // each direction
  const double stop = 4 * peers * chunks_per_token;
  RankBytes b;
  b.statistics = 2 * stats;
  if (rank == 0) {
    b.sent = peers * (d * 4 + 8) + stats + stop;
    b.received = stats + peers * d * 4 + stop;
  } else {
    b.sent = stats + d * 4 + stop;
    b.received = d * 4 + 8 + stats + stop;
  }
  return b;
}

// The step on the group: time against the single server's, results against its, bytes per rank
// per token measured against the model.
nlohmann::json RunGroup(const Shape& s, Group& group, rh::client::Client& single,
                        const rh::client::StepInputs& inputs,
                        const rh::client::ForwardBackwardResult& single_result,
                        double single_seconds, int64_t single_steps) {
  rh::client::Client& client = *group.client;
  OrDie(client.CreateHead("bench",
                          rh::client::InitSpec{.vocab_size = s.v, .hidden_size = s.d, .seed = 1}),
        "CreateHead (head group)");
  int64_t step = 0;
  rh::client::ForwardBackwardResult result;
  const double seconds = TimeIt([&] {
    rh::client::StepSpec spec{.head_id = "bench",
                              .gradient_id = rh::client::GradientId{"bench", step++, 0}};
    result = OrDie(client.ForwardBackward(spec, inputs), "ForwardBackward (head group)");
  });
  // Both accumulated the same steps: the gathered dW equals the single server's.
  double dw_diff = -1, dw_max = 0;
  if (step == single_steps) {
    const torch::Tensor g = OrDie(client.FetchGradients("bench"), "FetchGradients").weight_grad;
    const torch::Tensor w = OrDie(single.FetchGradients("bench"), "FetchGradients").weight_grad;
    dw_diff = (g - w).abs().max().item<double>();
    dw_max = w.abs().max().item<double>();
  }
  // One more step between two scrapes of every rank's counters.
  std::vector<std::map<std::string, double>> before;
  for (const int port : group.metrics_ports) before.push_back(CollectiveBytes(port));
  rh::client::StepSpec spec{.head_id = "bench",
                            .gradient_id = rh::client::GradientId{"bench", step++, 0}};
  const auto measured_step = OrDie(client.ForwardBackward(spec, inputs), "ForwardBackward");
  const double chunks_per_token = double(measured_step.summary.num_chunks) / double(s.n);
  nlohmann::json ranks = nlohmann::json::array();
  double worst = 0;
  for (size_t r = 0; r < group.metrics_ports.size(); ++r) {
    const std::map<std::string, double> after = CollectiveBytes(group.metrics_ports[r]);
    double sent = 0, received = 0, statistics = 0;
    for (const auto& [key, value] : after) {
      const double delta = (value - before[r][key]) / double(s.n);
      if (key.ends_with("/sent")) sent += delta;
      if (key.ends_with("/received")) received += delta;
      if (key.starts_with("all_gather/")) statistics += delta;
    }
    const RankBytes model = GroupBytesModel(
        static_cast<int>(r), static_cast<int>(group.ranks.size()), s.d, chunks_per_token);
    const double ratio = (sent + received) / (model.sent + model.received);
    worst = std::max(worst, std::abs(ratio - 1));
    ranks.push_back({{"rank", r},
                     {"sent_bytes_per_token", sent},
                     {"received_bytes_per_token", received},
                     {"statistics_bytes_per_token", statistics},
                     {"model_sent_bytes_per_token", model.sent},
                     {"model_received_bytes_per_token", model.received},
                     {"model_statistics_bytes_per_token", model.statistics},
                     {"measured_vs_model", ratio}});
  }
  (void)client.DropHead("bench");
  return {{"size", group.ranks.size()},
          {"seconds", seconds},
          {"vs_single_server", seconds / single_seconds},
          {"loss_abs_diff", std::abs(result.loss - single_result.loss)},
          {"dx_max_abs_diff",
           (result.grad_hidden - single_result.grad_hidden).abs().max().item<double>()},
          {"dw_max_abs_diff", dw_diff},
          {"dw_max_abs", dw_max},
          {"bytes_worst_deviation_from_model", worst},
          {"ranks", ranks}};
}

// What --plot adds to a shape: naive (the full [N, V] logits and autograd in this process, dX
// and dW allocated by backward: a plain local head) and the two-phase step through the server
// (Forward, then Backward with dL/dloss = 1: the logits recomputed there), with the trainer's
// transient bytes of each. `step` numbers the gradient ids (each run accumulates afresh). Naive
// runs on `threads` LibTorch threads, as the in-process step; the client's side on one.
nlohmann::json PlotSeries(const Shape& s, const rh::core::Head& head,
                          const rh::core::TokenBatch& batch, rh::client::Client& client,
                          int threads, int64_t& step) {
  torch::set_num_threads(threads);
  torch::Tensor x = batch.hidden.detach().requires_grad_(true);
  torch::Tensor w = head.weight().detach().clone().requires_grad_(true);
  const bench::Measurement naive =
      OrDie(bench::Measure(
                torch::kCPU, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_repeats),
                [&] {
                  x.mutable_grad().reset();
                  w.mutable_grad().reset();
                },
                [&] {
                  torch::AutoGradMode grad_mode(true);
                  bench::NaiveStep(x, w, torch::Tensor(), batch.targets, "cross_entropy",
                                   rh::core::Reduction::kMean, s.n);
                  return absl::OkStatus();
                }),
            "naive step");
  torch::set_num_threads(1);
  const torch::Tensor one = torch::ones({});
  const rh::client::StepInputs inputs{.hidden = batch.hidden, .targets = batch.targets};
  const bench::Measurement two_phase = MeasureStep([&] {
    rh::client::StepSpec spec{.head_id = "bench",
                              .gradient_id = rh::client::GradientId{"bench", step++, 0}};
    OrDie(client.Forward(spec, inputs), "Forward");
    OrDie(client.Backward(spec, inputs, one), "Backward");
  });
  return {{"naive_seconds", naive.seconds},
          {"naive_peak_bytes", naive.peak_bytes},
          {"two_phase_remote_seconds", two_phase.seconds},
          {"two_phase_remote_trainer_peak_bytes", two_phase.peak_bytes}};
}

nlohmann::json RunShape(const Shape& s, rh::client::Client& client, const std::string& target,
                        pid_t server_pid, int metrics_port, Group* group) {
  torch::NoGradGuard no_grad;
  // The same head on both sides: Head::Initialize is deterministic in the seed.
  auto head = OrDie(
      rh::core::Head::Initialize({.vocab_size = s.v, .hidden_size = s.d, .seed = 1}, {}), "head");
  OrDie(client.CreateHead("bench",
                          rh::client::InitSpec{.vocab_size = s.v, .hidden_size = s.d, .seed = 1}),
        "CreateHead");
  torch::manual_seed(7);
  rh::core::TokenBatch batch;
  batch.hidden = torch::randn({s.n, s.d});
  batch.targets = torch::randint(0, s.v, {s.n}, torch::kLong);

  // In-process, the work the server does for the step: it computes the head's health on every
  // call that accumulates dW (its metrics show it; translate/step_header.cc), a pass over the
  // logits that core::StepOptions leaves off by default (remotehead-bench --head_health).
  rh::core::GradientBuffers grads = head->NewGradientBuffers();
  rh::core::FusedResult local;
  const rh::core::StepOptions as_served{.head_health = true};
  const bench::Measurement in_process_step = MeasureStep([&] {
    local = OrDie(rh::core::FusedForwardBackward(*head, batch, as_served, &grads),
                  "in-process step");
  });
  const double in_process = in_process_step.seconds;

  // The client's own tensor work (copying rows out, assembling dX) runs on one thread: the
  // server shares this machine's cores, and idle OpenMP workers of this process spinning after
  // each copy would take CPU from it (a real trainer runs on other machines).
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);

  // Remote: a fresh gradient id per run, so each one is really accumulated.
  int64_t step = 0;
  rh::client::ForwardBackwardResult remote_result;
  const rh::client::StepInputs inputs{.hidden = batch.hidden, .targets = batch.targets};
  double cpu_before = 0, cpu_after = 0;  // both processes, over the timed remote runs
  const bench::Measurement remote_step = MeasureStep([&] {
    if (step == absl::GetFlag(FLAGS_warmup))
      cpu_before = bench::CpuSeconds(0) + bench::CpuSeconds(server_pid);
    rh::client::StepSpec spec{.head_id = "bench",
                              .gradient_id = rh::client::GradientId{"bench", step++, 0}};
    remote_result = OrDie(client.ForwardBackward(spec, inputs), "ForwardBackward");
  });
  const double remote = remote_step.seconds;
  cpu_after = bench::CpuSeconds(0) + bench::CpuSeconds(server_pid);
  const double cpu_per_step = (cpu_after - cpu_before) / std::max(1, absl::GetFlag(FLAGS_repeats));
  nlohmann::json plot_series;
  if (!absl::GetFlag(FLAGS_plot).empty()) {
    plot_series = PlotSeries(s, *head, batch, client, threads, step);
    plot_series["fused_in_process_peak_bytes"] = in_process_step.peak_bytes;
    plot_series["fused_remote_trainer_peak_bytes"] = remote_step.peak_bytes;
  }
  nlohmann::json group_report;
  if (group != nullptr) {
    group_report = RunGroup(s, *group, client, inputs, remote_result, remote, step);
  }

  // The same bytes alone. Up: X through a Forward (sum) on a one-token vocabulary — the same
  // streaming path with next to no compute and nothing but the summary coming back. Down: an
  // X-sized tensor streamed back by ExportWeights (X uploaded once as a head, untimed).
  OrDie(client.CreateHead("probe_up", rh::client::InitSpec{.vocab_size = 1, .hidden_size = s.d}),
        "CreateHead");
  const rh::client::StepInputs up_inputs{.hidden = batch.hidden,
                                         .targets = torch::zeros({s.n}, torch::kLong)};
  const double up = TimeIt([&] {
    OrDie(client.Forward({.head_id = "probe_up", .reduction = rh::client::Reduction::kSum},
                         up_inputs),
          "Forward");
  });
  OrDie(client.UploadHead("probe_down", batch.hidden), "UploadHead");
  torch::Tensor echoed;
  const double down =
      TimeIt([&] { echoed = OrDie(client.ExportWeights("probe_down"), "ExportWeights").weight; });
  for (const char* id : {"probe_up", "probe_down", "bench"}) (void)client.DropHead(id);
  // The step's own path over C parallel streams (X up, dX down, next to no compute).
  std::vector<int> counts;
  for (const std::string& c : absl::GetFlag(FLAGS_streams)) {
    int count = 0;
    if (!absl::SimpleAtoi(c, &count) || count < 1) {
      std::cerr << "--streams: expected positive integers; got \"" << c << "\"" << std::endl;
      std::exit(2);
    }
    counts.push_back(count);
  }
  nlohmann::json striped = nlohmann::json::array();
  for (const bench::StripedWire& w : OrDie(
           bench::MeasureStripedWire(target, batch.hidden, counts, absl::GetFlag(FLAGS_chunk_bytes),
                                     absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_repeats)),
           "striped wire")) {
    striped.push_back({{"streams", w.streams},
                       {"seconds", w.seconds},
                       {"gb_per_s", w.gb_per_s},
                       {"dx_max_rel_diff", w.dx_max_rel_diff}});
  }
  // Half of the rows masked: unmasked, every row sent, compacted (bytes from the server's metrics).
  const nlohmann::json masked = bench::MaskedRowsJson(
      OrDie(bench::MeasureMaskedRows(client, metrics_port, batch.hidden, s.v,
                                     absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_repeats)),
            "masked rows"));
  torch::set_num_threads(threads);

  const double bytes = 2.0 * s.n * s.d * 4;  // X up + dX down
  const double serial = up + in_process + down;
  const auto& t = remote_result.summary.timings;
  nlohmann::json out = {
      {"n", s.n},
      {"d", s.d},
      {"v", s.v},
      {"in_process_seconds", in_process},
      {"remote_seconds", remote},
      {"remote_vs_in_process", remote / in_process},
      {"up_seconds", up},
      {"down_seconds", down},
      {"serial_seconds", serial},
      {"overlap_ratio", remote / serial},
      {"wire_goodput_gb_per_s", bytes / (up + down) / 1e9},
      {"remote_goodput_gb_per_s", bytes / remote / 1e9},
      {"remote_cpu_seconds", cpu_per_step},
      {"remote_cpu_utilisation", cpu_per_step / (remote * std::thread::hardware_concurrency())},
      {"server_compute_seconds", t.compute_seconds},
      {"server_receive_wait_seconds", t.receive_wait_seconds},
      {"server_send_wait_seconds", t.send_wait_seconds},
      {"server_total_seconds", t.total_seconds},
      {"loss_abs_diff", std::abs(remote_result.loss - local.loss)},
      {"dx_max_abs_diff",
       (remote_result.grad_hidden - local.grad_hidden).abs().max().item<double>()},
      {"dx_max_abs", local.grad_hidden.abs().max().item<double>()},
      {"loss", local.loss},
      {"echo_exact", torch::equal(echoed, batch.hidden)},
  };
  out["masked_rows"] = masked;
  if (!striped.empty()) out["striped_wire"] = striped;
  if (group != nullptr) out["group"] = group_report;
  if (!plot_series.is_null()) out["plot"] = plot_series;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // Before any tensor exists, so that every CPU allocation of this process (the trainer's side)
  // is counted.
  rh::core::InstallCpuMemoryTracker();
  absl::SetProgramUsageMessage(
      "remote fused step through remotehead-server on loopback vs in-process; see "
      "docs/benchmarks.md");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_threads) > 0) torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  std::vector<Shape> shapes;
  for (const std::string& spec : absl::GetFlag(FLAGS_shapes)) {
    const std::vector<std::string> p = absl::StrSplit(spec, ':');
    Shape s;
    if (p.size() != 3 || !absl::SimpleAtoi(p[0], &s.n) || !absl::SimpleAtoi(p[1], &s.d) ||
        !absl::SimpleAtoi(p[2], &s.v) || s.n < 1 || s.d < 1 || s.v < 1) {
      std::cerr << "--shapes: expected N:D:V with positive integers; got \"" << spec << "\""
                << std::endl;
      return 2;
    }
    shapes.push_back(s);
  }
  if (absl::GetFlag(FLAGS_replicas) > 1) {
    return bench::RunMeshBench({.n = shapes.front().n,
                                .d = shapes.front().d,
                                .v = shapes.front().v,
                                .ranks_per_replica = std::max(1, absl::GetFlag(FLAGS_group_size)),
                                .server = absl::GetFlag(FLAGS_server),
                                .server_args = absl::GetFlag(FLAGS_server_args),
                                .chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes),
                                .json = absl::GetFlag(FLAGS_json)});
  }
  std::vector<std::string> args = {absl::GetFlag(FLAGS_server), "--listen=127.0.0.1:0",
                                   "--device=cpu", "--memory_budget_bytes=0",
                                   "--metrics_address=127.0.0.1:0"};
  for (const auto& a : absl::GetFlag(FLAGS_server_args)) args.push_back(a);
  rh::testing::ServerProcess server(args);
  if (server.port() == 0) {
    std::cerr << "remotehead-remote-bench: the server did not start:\n" << server.log();
    return 1;
  }
  auto client = OrDie(rh::client::Client::Create({.target = server.target(),
                                                  .chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes),
                                                  .max_receive_message_bytes = 64 << 20}),
                      "Client::Create");
  nlohmann::json report;
  report["torch_threads"] = torch::get_num_threads();
  std::string admission_line;
  for (const std::string& line : std::vector<std::string>(absl::StrSplit(server.log(), '\n'))) {
    if (line.find("admission:") != std::string::npos) admission_line = line;
  }
  report["server_log"] = admission_line;
  report["cores"] = std::thread::hardware_concurrency();
  std::unique_ptr<Group> group;
  if (absl::GetFlag(FLAGS_group_size) >= 2) group = StartGroup(absl::GetFlag(FLAGS_group_size));
  for (const Shape& s : shapes) {
    report["shapes"].push_back(RunShape(s, *client, server.target(), server.pid(),
                                        PortAfter(server.log(), "metrics on port "), group.get()));
  }
  // The wire read against the loopback TCP limit, measured in the same run.
  if (const int64_t bytes = absl::GetFlag(FLAGS_loopback_bytes); bytes > 0) {
    const double limit = OrDie(bench::LoopbackTcpBytesPerSecond(bytes), "loopback limit") / 1e9;
    report["loopback_tcp_gb_per_s"] = limit;
    for (auto& r : report["shapes"]) {
      r["wire_vs_loopback"] = r["wire_goodput_gb_per_s"].get<double>() / limit;
      if (!r.contains("striped_wire")) continue;
      for (auto& w : r["striped_wire"]) w["vs_loopback"] = w["gb_per_s"].get<double>() / limit;
    }
  }
  report["bench"] = "remotehead-remote-bench";
  report["repeats"] = absl::GetFlag(FLAGS_repeats);
  report["warmup"] = absl::GetFlag(FLAGS_warmup);
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << report.dump(2) << std::endl;
  } else {
    bench::PrintRemoteBenchTable(report, std::cout);
  }
  int failures = 0;
  if (!absl::GetFlag(FLAGS_plot).empty()) {
    // Its rows go after the table (to stderr under --json: stdout stays one JSON object).
    const absl::Status plotted =
        bench::DrawPlot(report, absl::GetFlag(FLAGS_plot), absl::GetFlag(FLAGS_python),
                        REMOTEHEAD_PLOT_SCRIPT, absl::GetFlag(FLAGS_json) ? std::cerr : std::cout);
    if (!plotted.ok()) {
      std::cerr << "remotehead-remote-bench: " << plotted << std::endl;
      ++failures;
    }
  }
  if (absl::GetFlag(FLAGS_check)) {
    for (const auto& r : report["shapes"]) {
      if (!(r["loss_abs_diff"].get<double>() <= 1e-5 * std::abs(r["loss"].get<double>())) ||
          !(r["dx_max_abs_diff"].get<double>() <= 1e-5 * r["dx_max_abs"].get<double>()) ||
          !r["echo_exact"].get<bool>()) {
        std::cerr << "remotehead-remote-bench: remote and in-process results differ: " << r.dump()
                  << std::endl;
        ++failures;
      }
      if (!bench::MaskedRowsCheck(r["masked_rows"])) {
        std::cerr << "remotehead-remote-bench: the compacted masked step is not what the masked "
                     "step sent whole gives, or sent as many bytes: "
                  << r["masked_rows"].dump() << std::endl;
        ++failures;
      }
      if (!r.contains("group")) continue;
      // The group against the single server (fp32 1e-5 of the magnitudes), and its bytes
      // against the model (within 10%).
      const auto& g = r["group"];
      if (!(g["loss_abs_diff"].get<double>() <= 1e-5 * std::abs(r["loss"].get<double>())) ||
          !(g["dx_max_abs_diff"].get<double>() <= 1e-5 * r["dx_max_abs"].get<double>()) ||
          !(g["dw_max_abs_diff"].get<double>() >= 0 &&
            g["dw_max_abs_diff"].get<double>() <= 1e-5 * g["dw_max_abs"].get<double>()) ||
          !(g["bytes_worst_deviation_from_model"].get<double>() <= 0.10)) {
        std::cerr << "remotehead-remote-bench: the head group differs from the single server or "
                     "from its bytes model: "
                  << g.dump() << std::endl;
        ++failures;
      }
    }
  }
  if (group != nullptr) {
    for (auto& rank : group->ranks) kill(rank->pid(), SIGTERM);
    for (auto& rank : group->ranks) {
      if (rank->Wait() != 0) {
        std::cerr << "remotehead-remote-bench: a head group rank did not stop cleanly:\n"
                  << rank->log();
        ++failures;
      }
    }
  }
  return server.Terminate() == 0 && failures == 0 ? 0 : 1;
}
