#include "bench/masked_rows.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "bench/bench_measure.h"
#include "bench/bench_metrics.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::bench {
namespace {

constexpr char kMaskedProbeHead[] = "probe_masked";

// The server's ForwardBackward bytes so far: received, sent.
std::pair<double, double> StepBytes(int port) {
  const std::string body = ScrapeMetrics(port);
  return {MetricValue(body, "remotehead_received_bytes_total{rpc=\"ForwardBackward\"}"),
          MetricValue(body, "remotehead_sent_bytes_total{rpc=\"ForwardBackward\"}")};
}

}  // namespace

absl::StatusOr<MaskedRows> MeasureMaskedRows(client::Client& client, int metrics_port,
                                             const torch::Tensor& hidden, int64_t vocab, int warmup,
                                             int repeats) {
  const int64_t n = hidden.size(0);
  RETURN_IF_ERROR(client
                      .CreateHead(kMaskedProbeHead, client::InitSpec{.vocab_size = vocab,
                                                          .hidden_size = hidden.size(1),
                                                          .seed = 1})
                      .status());
  torch::manual_seed(11);
  const torch::Tensor targets = torch::randint(0, vocab, {n}, torch::kLong);
  torch::Tensor masked = targets.clone();
  masked.narrow(0, 0, n / 2).fill_(-100);  // the prompt half

  MaskedRows out;
  out.masked_rows = n / 2;
  std::vector<client::ForwardBackwardResult> last;
  int64_t micro_batch = 0;
  for (const std::string name : {"unmasked", "masked_full", "masked_compacted"}) {
    const client::StepInputs inputs{.hidden = hidden,
                                    .targets = name == "unmasked" ? targets : masked};
    client::StepSpec spec{.head_id = kMaskedProbeHead, .compact_rows = name != "masked_full"};
    std::vector<double> times, compute;
    double up = 0, down = 0;
    client::ForwardBackwardResult r;
    for (int i = 0; i < warmup + std::max(1, repeats); ++i) {
      spec.gradient_id = client::GradientId{"probe_masked", 0, micro_batch++};
      const auto [up0, down0] = StepBytes(metrics_port);
      const auto start = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(r, client.ForwardBackward(spec, inputs));
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      const auto [up1, down1] = StepBytes(metrics_port);
      if (i < warmup) continue;
      times.push_back(took.count());
      compute.push_back(r.summary.timings.compute_seconds);
      up += up1 - up0;
      down += down1 - down0;
    }
    const double runs = std::max(1, repeats);
    out.steps.push_back({.name = name,
                         .seconds = Median(times),
                         .server_compute_seconds = Median(compute),
                         .bytes_up = up / runs,
                         .bytes_down = down / runs});
    last.push_back(std::move(r));
  }
  (void)client.DropHead(kMaskedProbeHead);
  const client::ForwardBackwardResult& full = last[1];
  const client::ForwardBackwardResult& compacted = last[2];
  out.equal_bits =
      full.loss == compacted.loss && torch::equal(full.grad_hidden, compacted.grad_hidden);
  out.loss_abs_diff = std::abs(full.loss - compacted.loss);
  out.dx_max_abs_diff = (full.grad_hidden - compacted.grad_hidden).abs().max().item<double>();
  out.dx_max_abs = full.grad_hidden.abs().max().item<double>();
  out.loss = full.loss;
  return out;
}

nlohmann::json MaskedRowsJson(const MaskedRows& m) {
  nlohmann::json out = {{"masked_rows", m.masked_rows},
                        {"equal_bits", m.equal_bits},
                        {"loss", m.loss},
                        {"loss_abs_diff", m.loss_abs_diff},
                        {"dx_max_abs_diff", m.dx_max_abs_diff},
                        {"dx_max_abs", m.dx_max_abs}};
  for (const MaskedRowsStep& s : m.steps) {
    out["steps"][s.name] = {{"seconds", s.seconds},
                            {"server_compute_seconds", s.server_compute_seconds},
                            {"bytes_up", s.bytes_up},
                            {"bytes_down", s.bytes_down}};
  }
  const nlohmann::json& st = out["steps"];
  const auto& c = st["masked_compacted"];
  for (const char* other : {"unmasked", "masked_full"}) {
    out[absl::StrCat("compacted_vs_", other)] = {
        {"bytes_up", c["bytes_up"].get<double>() / st[other]["bytes_up"].get<double>()},
        {"bytes_down", c["bytes_down"].get<double>() / st[other]["bytes_down"].get<double>()},
        {"server_compute", c["server_compute_seconds"].get<double>() /
                               std::max(st[other]["server_compute_seconds"].get<double>(), 1e-9)},
        {"seconds", c["seconds"].get<double>() / st[other]["seconds"].get<double>()}};
  }
  return out;
}

bool MaskedRowsCheck(const nlohmann::json& m) {
  const double rows = m["steps"]["masked_full"]["bytes_up"].get<double>();
  const double compacted = m["steps"]["masked_compacted"]["bytes_up"].get<double>();
  return m["loss_abs_diff"].get<double>() <= 1e-6 * std::abs(m["loss"].get<double>()) &&
         m["dx_max_abs_diff"].get<double>() <= 1e-5 * m["dx_max_abs"].get<double>() &&
         compacted < rows * 0.75;
}

}  // namespace remotehead::bench
