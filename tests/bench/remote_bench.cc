// remotehead-remote-bench: one fused LM-head step (cross-entropy mean: loss, dX, dW accumulated)
// through the real remotehead-server on loopback, against the same step in-process, measured
// in one run. For each shape N:D:V (fp32):
//
//   in_process   core::FusedForwardBackward in this process (the compute floor of the remote step)
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
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <thread>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "remotehead/client/client.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"
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
ABSL_FLAG(bool, check, false,
          "exit 1 unless the remote results equal the in-process ones (loss and dX within 1e-5 "
          "of their magnitude) and the echoed bytes are exact (no timing checks)");

namespace {

namespace rh = remotehead;
using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t n = 0, d = 0, v = 0;
};

// CPU seconds (user + system) used so far by process `pid` (0: this process).
double CpuSeconds(pid_t pid) {
  if (pid == 0) {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
    return seconds(usage.ru_utime) + seconds(usage.ru_stime);
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
  const std::vector<std::string> fields =
      absl::StrSplit(text.substr(text.rfind(')') + 2), ' ', absl::SkipEmpty());
  if (fields.size() < 13) return 0;
  double utime = 0, stime = 0;
  if (!absl::SimpleAtod(fields[11], &utime) || !absl::SimpleAtod(fields[12], &stime)) return 0;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double Median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  return xs[xs.size() / 2];
}

// Runs `fn` warmup + repeats times and returns the median wall time of the timed runs.
double TimeIt(const std::function<void()>& fn) {
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_repeats)); ++i) {
    const auto t0 = Clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(times);
}

template <typename T>
T OrDie(absl::StatusOr<T> v, const std::string& what) {
  if (!v.ok()) {
    std::cerr << "remotehead-remote-bench: " << what << ": " << v.status() << std::endl;
    std::exit(1);
  }
  return *std::move(v);
}

nlohmann::json RunShape(const Shape& s, rh::client::Client& client, pid_t server_pid) {
  torch::NoGradGuard no_grad;
  // The same head on both sides: Head::Initialize is deterministic in the seed.
  auto head = OrDie(rh::core::Head::Initialize({.vocab_size = s.v, .hidden_size = s.d, .seed = 1},
                                               {}),
                    "head");
  OrDie(client.CreateHead("bench", rh::client::InitSpec{.vocab_size = s.v, .hidden_size = s.d,
                                                        .seed = 1}),
        "CreateHead");
  torch::manual_seed(7);
  rh::core::TokenBatch batch;
  batch.hidden = torch::randn({s.n, s.d});
  batch.targets = torch::randint(0, s.v, {s.n}, torch::kLong);

  // In-process.
  rh::core::GradientBuffers grads = head->NewGradientBuffers();
  rh::core::FusedResult local;
  const double in_process = TimeIt([&] {
    local = OrDie(rh::core::FusedForwardBackward(*head, batch, {}, &grads), "in-process step");
  });

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
  const double remote = TimeIt([&] {
    if (step == absl::GetFlag(FLAGS_warmup)) cpu_before = CpuSeconds(0) + CpuSeconds(server_pid);
    rh::client::StepSpec spec{.head_id = "bench",
                              .gradient_id = rh::client::GradientId{"bench", step++, 0}};
    remote_result = OrDie(client.ForwardBackward(spec, inputs), "ForwardBackward");
  });
  cpu_after = CpuSeconds(0) + CpuSeconds(server_pid);
  const double cpu_per_step =
      (cpu_after - cpu_before) / std::max(1, absl::GetFlag(FLAGS_repeats));

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
  torch::set_num_threads(threads);

  const double bytes = 2.0 * s.n * s.d * 4;  // X up + dX down
  const double serial = up + in_process + down;
  const auto& t = remote_result.summary.timings;
  return {
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
}

void PrintTable(const nlohmann::json& report) {
  std::cout << absl::StrFormat("# server: %s\n", report["server_log"].get<std::string>());
  std::cout << absl::StrFormat("%-18s %9s %9s %7s %8s %8s %9s %7s %9s %9s %9s %9s\n", "N:D:V",
                               "in_proc_s", "remote_s", "ratio", "up_s", "down_s", "serial_s",
                               "overlap", "wire_GB/s", "srv_comp", "srv_recvw", "srv_sendw");
  for (const auto& r : report["shapes"]) {
    std::cout << absl::StrFormat(
        "%-18s %9.3f %9.3f %7.3f %8.3f %8.3f %9.3f %7.3f %9.2f %9.3f %9.3f %9.3f\n",
        absl::StrFormat("%d:%d:%d", r["n"].get<int64_t>(), r["d"].get<int64_t>(),
                        r["v"].get<int64_t>()),
        r["in_process_seconds"].get<double>(), r["remote_seconds"].get<double>(),
        r["remote_vs_in_process"].get<double>(), r["up_seconds"].get<double>(),
        r["down_seconds"].get<double>(), r["serial_seconds"].get<double>(),
        r["overlap_ratio"].get<double>(), r["wire_goodput_gb_per_s"].get<double>(),
        r["server_compute_seconds"].get<double>(), r["server_receive_wait_seconds"].get<double>(),
        r["server_send_wait_seconds"].get<double>());
    std::cout << absl::StrFormat(
        "%-18s remote step: %.3f CPU-s in both processes = %.0f%% of %d cores; |loss diff| "
        "%.2e, max |dX diff| %.2e, echo exact: %s\n",
        "", r["remote_cpu_seconds"].get<double>(),
        100 * r["remote_cpu_utilisation"].get<double>(), report["cores"].get<int>(),
        r["loss_abs_diff"].get<double>(), r["dx_max_abs_diff"].get<double>(),
        r["echo_exact"].get<bool>() ? "yes" : "NO");
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "remote fused step through remotehead-server on loopback vs in-process; see README.md");
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
  std::vector<std::string> args = {absl::GetFlag(FLAGS_server), "--listen=127.0.0.1:0",
                                   "--device=cpu", "--memory_budget_bytes=0"};
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
  for (const Shape& s : shapes) report["shapes"].push_back(RunShape(s, *client, server.pid()));
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << report.dump(2) << std::endl;
  } else {
    PrintTable(report);
  }
  int failures = 0;
  if (absl::GetFlag(FLAGS_check)) {
    for (const auto& r : report["shapes"]) {
      if (!(r["loss_abs_diff"].get<double>() <= 1e-5 * std::abs(r["loss"].get<double>())) ||
          !(r["dx_max_abs_diff"].get<double>() <= 1e-5 * r["dx_max_abs"].get<double>()) ||
          !r["echo_exact"].get<bool>()) {
        std::cerr << "remotehead-remote-bench: remote and in-process results differ: " << r.dump()
                  << std::endl;
        ++failures;
      }
    }
  }
  return server.Terminate() == 0 && failures == 0 ? 0 : 1;
}
