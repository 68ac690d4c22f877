// remotehead-wire-bench: the service's data path at next to no compute, against the loopback TCP
// limit measured in the same run. One ForwardBackward (cross-entropy mean, no dW accumulated) on
// a head of --v tokens (256: the GEMMs are a few percent of the bytes' time) with X of --x_bytes
// ([N, --d] rows, N = x_bytes / (d · element size)), for each dtype of --dtypes and each stream
// count C of --streams (ClientOptions::streams, StepHeader.stripe), through the real server
// binary this program starts on 127.0.0.1 (one per message size of --chunk_sizes: the sweep of
// the client's request chunks and the server's response chunks — and per HTTP/2 settings of
// --http2_settings, which both ends take). Reported per (S, HTTP/2, dtype, C):
//
//   GB/s        (X bytes + dX bytes) / the call's wall time (median of --repeats)
//   vs_loop1    that over the loopback TCP limit of one connection (a plain socket pair)
//   vs_loopC    that over the limit of C connections at once
//   dX_vs_C1    max |dX − dX with one stream| (0: striping changes no bit)
//   CPU-s       each server thread family's CPU seconds per call (rh-compute: the compute pool;
//               the rest are gRPC's), and this client's, over the timed calls
//   faults      each process's minor page faults per call (fresh pages zeroed by the kernel)
//
// --check exits 1 unless every C's loss and dX equal one stream's bit for bit and dX equals the
// in-process engine's (1e-5 of its magnitude); it checks no timing.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/bench_flags.h"
#include "bench/loopback_limit.h"
#include "bench/thread_cpu.h"
#include "remotehead/client/client.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/wire/http2_settings.h"
#include "support/child_process.h"

ABSL_FLAG(int64_t, x_bytes, int64_t{128} << 20, "bytes of X per call (dX is as many)");
ABSL_FLAG(int64_t, d, 4096, "hidden size D");
ABSL_FLAG(int64_t, v, 256, "vocabulary size V (small: the compute stays negligible)");
ABSL_FLAG(std::vector<std::string>, dtypes, std::vector<std::string>({"float32", "bfloat16"}),
          "head and X dtypes (float32, bfloat16)");
ABSL_FLAG(std::vector<std::string>, streams, std::vector<std::string>({"1", "2", "4"}),
          "stream counts C");
ABSL_FLAG(std::vector<std::string>, chunk_sizes, std::vector<std::string>({"1048576"}),
          "message sizes S to sweep: the client's request chunks (ClientOptions::chunk_bytes) "
          "and the server's response chunks (--response_chunk_bytes), both S; a server each");
ABSL_FLAG(
    std::vector<std::string>, http2_settings, std::vector<std::string>({"default"}),
    "HTTP/2 settings to sweep, each \"default\" (gRPC's) or FRAME:WINDOW:WRITE_BUFFER in bytes "
    "(0: gRPC's): the largest DATA frame each end accepts, a stream's initial flow-control "
    "window, its write buffer (wire/http2_settings.h); both ends take them, a server each");
ABSL_FLAG(int32_t, repeats, 3, "timed calls per (dtype, C) (the median is reported)");
ABSL_FLAG(int32_t, warmup, 1, "untimed calls before the timed ones");
ABSL_FLAG(int64_t, loopback_bytes, 0,
          "bytes through the loopback socket pairs (0: 2 · x_bytes, what one call moves)");
ABSL_FLAG(std::string, server, REMOTEHEAD_SERVER_BINARY, "the remotehead-server binary to start");
ABSL_FLAG(std::vector<std::string>, server_args, {},
          "extra flags for the server, e.g. --compute_threads=2");
ABSL_FLAG(std::string, device, "cpu",
          "the server's device (--device), and the in-process step's: cpu, cuda or cuda:N");
ABSL_FLAG(bool, json, false, "print one JSON object on stdout instead of the table");
ABSL_FLAG(bool, check, false,
          "exit 1 unless every C gives one stream's bits and dX equals the in-process engine's");

namespace {

namespace rh = remotehead;
namespace bench = remotehead::bench;
using Clock = std::chrono::steady_clock;

using bench::OrDie;

torch::ScalarType DtypeOf(const std::string& name) {
  if (name == "float32") return torch::kFloat;
  if (name == "bfloat16") return torch::kBFloat16;
  std::cerr << "remotehead-wire-bench: --dtypes: expected float32 or bfloat16; got " << name
            << std::endl;
  std::exit(2);
}

std::vector<int> Counts() {
  std::vector<int> out;
  for (const std::string& s : absl::GetFlag(FLAGS_streams)) {
    int c = 0;
    if (!absl::SimpleAtoi(s, &c) || c < 1) {
      std::cerr << "remotehead-wire-bench: --streams: expected counts >= 1; got " << s << "\n";
      std::exit(2);
    }
    out.push_back(c);
  }
  return out;
}

std::vector<int64_t> ChunkSizes() {
  std::vector<int64_t> out;
  for (const std::string& s : absl::GetFlag(FLAGS_chunk_sizes)) {
    int64_t size = 0;
    if (!absl::SimpleAtoi(s, &size) || size < 4096) {
      std::cerr << "remotehead-wire-bench: --chunk_sizes: expected sizes >= 4096; got " << s
                << "\n";
      std::exit(2);
    }
    out.push_back(size);
  }
  return out;
}

std::vector<rh::wire::Http2Settings> Http2Sweep() {
  std::vector<rh::wire::Http2Settings> out;
  for (const std::string& s : absl::GetFlag(FLAGS_http2_settings)) {
    absl::StatusOr<rh::wire::Http2Settings> settings = rh::wire::ParseHttp2Settings(s);
    if (!settings.ok()) {
      std::cerr << "remotehead-wire-bench: --http2_settings: " << settings.status().message()
                << "\n";
      std::exit(2);
    }
    out.push_back(*settings);
  }
  return out;
}

struct Row {
  int64_t chunk_bytes = 0;
  rh::wire::Http2Settings http2;
  std::string dtype;
  int streams = 1;
  double seconds = 0, gb_per_s = 0, vs_loop1 = 0, vs_loop_c = 0, dx_vs_one = 0, loss = 0;
  std::map<std::string, double> server_cpu, client_cpu;  // per call
  double server_faults = 0, client_faults = 0;           // minor page faults per call
};

// One (dtype, C): `calls` through a client of C streams; the median wall time and the threads'
// CPU seconds per timed call.
Row Measure(const std::string& target, pid_t server_pid, int64_t chunk_bytes,
            const rh::wire::Http2Settings& http2, const std::string& dtype, int streams,
            const rh::client::StepInputs& inputs, torch::Tensor* dx) {
  auto client = OrDie(rh::client::Client::Create({.target = target,
                                                  .chunk_bytes = chunk_bytes,
                                                  .max_receive_message_bytes = 64 << 20,
                                                  .http2 = http2,
                                                  .streams = streams}),
                      "Client::Create");
  const std::string head = absl::StrCat("wire_", dtype);
  const rh::client::StepSpec spec{.head_id = head, .accumulate_weight_grad = false};
  Row row{.chunk_bytes = chunk_bytes, .http2 = http2, .dtype = dtype, .streams = streams};
  auto call = [&] {
    auto r = OrDie(client->ForwardBackward(spec, inputs), "ForwardBackward");
    row.loss = r.loss;
    *dx = std::move(r.grad_hidden);
  };
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) call();
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const auto server_before = bench::ThreadCpuSeconds(server_pid);
  const auto client_before = bench::ThreadCpuSeconds(getpid());
  const long long server_faults = bench::MinorFaults(server_pid);
  const long long client_faults = bench::MinorFaults(getpid());
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    call();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  for (auto* cpu : {&row.server_cpu, &row.client_cpu}) {
    *cpu = cpu == &row.server_cpu
               ? bench::CpuSecondsSpent(server_before, bench::ThreadCpuSeconds(server_pid))
               : bench::CpuSecondsSpent(client_before, bench::ThreadCpuSeconds(getpid()));
    for (auto& [name, seconds] : *cpu) seconds /= repeats;
  }
  row.server_faults = static_cast<double>(bench::MinorFaults(server_pid) - server_faults) / repeats;
  row.client_faults = static_cast<double>(bench::MinorFaults(getpid()) - client_faults) / repeats;
  std::sort(times.begin(), times.end());
  row.seconds = times[times.size() / 2];
  row.gb_per_s = 2.0 * static_cast<double>(inputs.hidden.nbytes()) / row.seconds / 1e9;
  return row;
}

// The engine's step on `batch` in this process with `threads` LibTorch threads (the server's
// default: every core): its median time; its dX (float32) in *dx.
double InProcess(const rh::core::Head& head, const rh::core::TokenBatch& batch, int threads,
                 torch::Tensor* dx) {
  std::vector<double> times;
  const int saved = torch::get_num_threads();
  torch::set_num_threads(threads);
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup) + std::max(1, absl::GetFlag(FLAGS_repeats));
       ++i) {
    const auto start = Clock::now();
    *dx = OrDie(rh::core::FusedForwardBackward(head, batch, {}, nullptr), "in-process step")
              .grad_hidden.to(torch::kCPU, torch::kFloat);
    if (i >= absl::GetFlag(FLAGS_warmup)) {
      times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  torch::set_num_threads(saved);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

std::string CpuLine(const std::map<std::string, double>& cpu) {
  std::vector<std::pair<double, std::string>> sorted;
  double total = 0;
  for (const auto& [name, seconds] : cpu) {
    total += seconds;
    if (seconds >= 0.0005) sorted.emplace_back(seconds, name);
  }
  std::sort(sorted.rbegin(), sorted.rend());
  std::vector<std::string> parts;
  for (const auto& [seconds, name] : sorted) {
    parts.push_back(absl::StrFormat("%s %.3f", name, seconds));
  }
  return absl::StrFormat("%.3f (%s)", total, absl::StrJoin(parts, ", "));
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "remotehead-wire-bench: the step's data path at negligible compute vs the loopback TCP "
      "limit; see docs/benchmarks.md");
  absl::ParseCommandLine(argc, argv);
  torch::NoGradGuard no_grad;
  const std::vector<int> counts = Counts();
  const int64_t d = absl::GetFlag(FLAGS_d), v = absl::GetFlag(FLAGS_v);

  // The client's tensor work on one thread: it shares this machine's cores with the server.
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);

  // The loopback limits: one connection and each C at once, with a call's bytes.
  const int64_t loop_bytes = absl::GetFlag(FLAGS_loopback_bytes) > 0
                                 ? absl::GetFlag(FLAGS_loopback_bytes)
                                 : 2 * absl::GetFlag(FLAGS_x_bytes);
  std::map<int, double> loop;  // connections → GB/s
  loop[1] = OrDie(bench::LoopbackTcpBytesPerSecond(loop_bytes, 3, 1), "loopback limit") / 1e9;
  for (const int c : counts) {
    if (!loop.count(c)) {
      loop[c] = OrDie(bench::LoopbackTcpBytesPerSecond(loop_bytes, 3, c), "loopback limit") / 1e9;
    }
  }

  nlohmann::json report;
  report["cores"] = std::thread::hardware_concurrency();
  for (const auto& [c, gb] : loop) report["loopback_tcp_gb_per_s"][std::to_string(c)] = gb;
  std::vector<Row> rows;
  std::map<std::string, double> in_process;  // dtype → the engine's step in this process, s
  bool exact = true;
  std::vector<std::pair<int64_t, rh::wire::Http2Settings>> servers;  // one per (S, HTTP/2)
  for (const int64_t chunk_bytes : ChunkSizes()) {
    for (const rh::wire::Http2Settings& http2 : Http2Sweep())
      servers.emplace_back(chunk_bytes, http2);
  }
  for (const auto& [chunk_bytes, http2] : servers) {
    std::vector<std::string> args = {
        absl::GetFlag(FLAGS_server),
        "--listen=127.0.0.1:0",
        absl::StrCat("--device=", absl::GetFlag(FLAGS_device)),
        "--memory_budget_bytes=0",
        "--metrics_address=127.0.0.1:0",
        absl::StrCat("--response_chunk_bytes=", chunk_bytes),
        absl::StrCat("--http2_max_frame_bytes=", http2.max_frame_bytes),
        absl::StrCat("--http2_stream_window_bytes=", http2.stream_window_bytes),
        absl::StrCat("--http2_write_buffer_bytes=", http2.write_buffer_bytes)};
    for (const auto& a : absl::GetFlag(FLAGS_server_args)) args.push_back(a);
    rh::testing::ServerProcess server(args);
    if (server.port() == 0) {
      std::cerr << "remotehead-wire-bench: the server did not start:\n" << server.log();
      return 1;
    }
    for (const std::string& name : absl::GetFlag(FLAGS_dtypes)) {
      const torch::ScalarType dtype = DtypeOf(name);
      const int64_t n = std::max<int64_t>(
          1, absl::GetFlag(FLAGS_x_bytes) / (d * static_cast<int64_t>(c10::elementSize(dtype))));
      const torch::Device device(absl::GetFlag(FLAGS_device));
      auto head = OrDie(
          rh::core::Head::Initialize({.vocab_size = v, .hidden_size = d, .dtype = dtype, .seed = 1},
                                     {.device = device}),
          "head");
      auto admin = OrDie(rh::client::Client::Create({.target = server.target()}), "Client::Create");
      OrDie(admin->CreateHead(
                absl::StrCat("wire_", name),
                rh::client::InitSpec{.vocab_size = v, .hidden_size = d, .seed = 1, .dtype = dtype}),
            "CreateHead");
      torch::manual_seed(7);
      const rh::client::StepInputs inputs{.hidden = torch::randn({n, d}).to(dtype),
                                          .targets = torch::randint(0, v, {n}, torch::kLong)};
      // The in-process engine's dX (on the server's device): what every C must give.
      rh::core::TokenBatch batch{.hidden = inputs.hidden.to(device),
                                 .targets = inputs.targets.to(device)};
      torch::Tensor local;
      in_process[name] = InProcess(*head, batch, threads, &local);
      torch::Tensor first;
      double first_loss = 0;
      for (const int c : counts) {
        torch::Tensor dx;
        Row row = Measure(server.target(), server.pid(), chunk_bytes, http2, name, c, inputs, &dx);
        row.vs_loop1 = row.gb_per_s / loop[1];
        row.vs_loop_c = row.gb_per_s / loop[c];
        if (!first.defined()) {
          first = dx;
          first_loss = row.loss;
          const double scale = std::max(local.abs().max().item<double>(), 1e-30);
          const double off = (dx.to(torch::kFloat) - local).abs().max().item<double>() / scale;
          if (off > 1e-5) {
            std::cerr << "remotehead-wire-bench: " << name << ": dX off the in-process engine's by "
                      << off << " of its magnitude\n";
            exact = false;
          }
        }
        row.dx_vs_one = (dx.to(torch::kFloat) - first.to(torch::kFloat)).abs().max().item<double>();
        if (row.dx_vs_one != 0 || row.loss != first_loss) exact = false;
        rows.push_back(row);
      }
      (void)admin->DropHead(absl::StrCat("wire_", name));
    }
  }
  if (absl::GetFlag(FLAGS_json)) {
    for (const Row& r : rows) {
      report["rows"].push_back({{"chunk_bytes", r.chunk_bytes},
                                {"http2", rh::wire::Http2SettingsName(r.http2)},
                                {"dtype", r.dtype},
                                {"streams", r.streams},
                                {"seconds", r.seconds},
                                {"gb_per_s", r.gb_per_s},
                                {"vs_loopback_1", r.vs_loop1},
                                {"vs_loopback_c", r.vs_loop_c},
                                {"dx_vs_one_stream", r.dx_vs_one},
                                {"server_cpu_seconds", r.server_cpu},
                                {"client_cpu_seconds", r.client_cpu},
                                {"server_minor_faults", r.server_faults},
                                {"client_minor_faults", r.client_faults}});
    }
    report["in_process_seconds"] = in_process;
    report["exact"] = exact;
    std::cout << report.dump() << std::endl;
  } else {
    std::cout << absl::StrFormat(
        "# X %.0f MiB per call (dX as many), D %d, V %d; %d cores\n# loopback TCP limit:",
        absl::GetFlag(FLAGS_x_bytes) / 1048576.0, d, v, std::thread::hardware_concurrency());
    for (const auto& [c, gb] : loop) std::cout << absl::StrFormat(" %d conn %.2f GB/s;", c, gb);
    std::cout
        << "\n# in_proc_s: the same step in this process (the engine alone, its compute "
           "floor)\n# http2: FRAME:WINDOW:WRITE_BUFFER bytes both ends take (default: gRPC's own)\n"
           "chunk_KiB http2                    dtype      C   call_s    GB/s  vs_loop1  "
           "vs_loopC  dX_vs_C1  in_proc_s\n";
    for (const Row& r : rows) {
      std::cout << absl::StrFormat("%9d %-24s %-9s %2d %8.3f %7.2f %9.2f %9.2f %9.1e %10.3f\n",
                                   r.chunk_bytes / 1024, rh::wire::Http2SettingsName(r.http2),
                                   r.dtype, r.streams, r.seconds, r.gb_per_s, r.vs_loop1,
                                   r.vs_loop_c, r.dx_vs_one, in_process[r.dtype])
                << "                       server CPU-s per call " << CpuLine(r.server_cpu)
                << absl::StrFormat("; %.0f page faults\n", r.server_faults)
                << "                       client CPU-s per call " << CpuLine(r.client_cpu)
                << absl::StrFormat("; %.0f page faults\n", r.client_faults);
    }
    std::cout << "# every C exact (loss and dX equal one stream's bits, dX the engine's): "
              << (exact ? "yes" : "NO") << std::endl;
  }
  if (absl::GetFlag(FLAGS_check) && !exact) return 1;
  return 0;
}
