// remotehead-fp32-logits-bench: what fp32 logits (StepOptions::logits_dtype = float32) buy and
// cost on a bf16 head. For one fused cross-entropy step (loss, dX, dW) in the same run: the
// loss's error relative to a float64 reference computed from the same bf16 W and X, with the
// default bf16 logits and with fp32 logits, the median step time of each, their ratio, and the
// transient bytes of each. --json prints the same as one JSON object.
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "bench/bench_measure.h"
#include "nlohmann/json.hpp"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"
#include "remotehead/core/memory_stats.h"

ABSL_FLAG(int64_t, n, 2048, "rows (tokens) N");
ABSL_FLAG(int64_t, d, 1024, "hidden size D");
ABSL_FLAG(int64_t, v, 32000, "vocabulary size V");
ABSL_FLAG(std::string, device, "auto", "auto (cuda:0 if available, else cpu), cpu or cuda[:N]");
ABSL_FLAG(int64_t, memory_budget_bytes, 0, "engine transient budget; 0 = the device's default");
ABSL_FLAG(int, warmup, 1, "untimed steps before the timed ones");
ABSL_FLAG(int, repeats, 3, "timed steps (the median is reported)");
ABSL_FLAG(bool, json, false, "print one JSON object instead of the table");

namespace remotehead::bench {
namespace {

struct Row {
  std::string logits;  // "bfloat16" (the head's dtype: the default) or "float32"
  double loss = 0;
  double relative_error = 0;  // |loss − float64 loss| / |float64 loss|
  Measurement measured;
};

// The mean cross-entropy over the valid targets, in float64 from the bf16 head's values (exact
// in float64), a block of rows at a time so that [N, V] float64 logits are never whole.
double Float64Loss(const core::Head& head, const torch::Tensor& hidden,
                   const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  const torch::Tensor w = head.weight().to(torch::kDouble);
  double sum = 0;
  int64_t valid = 0;
  constexpr int64_t kBlock = 256;
  for (int64_t start = 0; start < hidden.size(0); start += kBlock) {
    const int64_t rows = std::min(kBlock, hidden.size(0) - start);
    const torch::Tensor z = torch::mm(hidden.narrow(0, start, rows).to(torch::kDouble), w.t());
    const torch::Tensor t = targets.narrow(0, start, rows);
    sum += torch::nn::functional::cross_entropy(z, t,
                                                torch::nn::functional::CrossEntropyFuncOptions()
                                                    .ignore_index(kIgnoreIndex)
                                                    .reduction(torch::kSum))
               .item<double>();
    valid += (t != kIgnoreIndex).sum().item<int64_t>();
  }
  return sum / static_cast<double>(std::max<int64_t>(valid, 1));
}

absl::Status Run() {
  core::InstallCpuMemoryTracker();
  const int64_t n = absl::GetFlag(FLAGS_n), d = absl::GetFlag(FLAGS_d), v = absl::GetFlag(FLAGS_v);
  std::string device_name = absl::GetFlag(FLAGS_device);
  if (device_name == "auto") device_name = torch::cuda::is_available() ? "cuda:0" : "cpu";
  const torch::Device device(device_name);
  torch::manual_seed(0);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  // Logits of O(1) for unit-variance hidden states, as in a trained model's head.
  ASSIGN_OR_RETURN(std::unique_ptr<core::Head> head,
                   core::Head::FromTensors((torch::randn({v, d}) / std::sqrt(d)).to(bf16),
                                           torch::Tensor(), {.device = device}));
  const torch::Tensor hidden = torch::randn({n, d}).to(bf16);
  torch::Tensor targets = torch::randint(v, {n}, torch::kLong);
  targets.masked_fill_(torch::rand({n}) < kIgnoredFraction, kIgnoreIndex);
  const double reference = Float64Loss(*head, hidden.cpu(), targets);
  const core::TokenBatch batch{.hidden = hidden, .targets = targets.to(device)};
  core::GradientBuffers grads = head->NewGradientBuffers();
  const torch::Tensor grad_hidden = torch::empty({n, d}, bf16);

  Row rows[] = {{.logits = "bfloat16"}, {.logits = "float32"}};
  for (Row& row : rows) {
    const core::StepOptions options{
        .memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes),
        .logits_dtype = row.logits == "float32" ? std::optional(torch::kFloat) : std::nullopt};
    ASSIGN_OR_RETURN(row.measured, Measure(
                                       device, absl::GetFlag(FLAGS_warmup),
                                       absl::GetFlag(FLAGS_repeats), [&] { grads.weight.zero_(); },
                                       [&]() -> absl::Status {
                                         ASSIGN_OR_RETURN(
                                             const core::FusedResult r,
                                             core::FusedForwardBackward(*head, batch, options,
                                                                        &grads, grad_hidden));
                                         row.loss = r.loss;
                                         return absl::OkStatus();
                                       }));
    row.relative_error = std::abs(row.loss - reference) / std::abs(reference);
  }
  const double ratio = rows[1].measured.seconds / rows[0].measured.seconds;
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = {{"n", n},
                          {"d", d},
                          {"v", v},
                          {"device", device.str()},
                          {"reference_loss", reference},
                          {"time_ratio_fp32_over_bf16", ratio}};
    for (const Row& row : rows) {
      out["logits"][row.logits] = {{"loss", row.loss},
                                   {"relative_error", row.relative_error},
                                   {"seconds", row.measured.seconds},
                                   {"peak_bytes", row.measured.peak_bytes}};
    }
    std::printf("%s\n", out.dump().c_str());
    return absl::OkStatus();
  }
  std::printf("%s", absl::StrFormat("fused cross-entropy of a bf16 head, N=%d D=%d V=%d on %s "
                                    "(%d threads); float64 loss %.10f\n",
                                    n, d, v, device.str(), at::get_num_threads(), reference)
                        .c_str());
  std::printf("%-9s %-14s %-12s %-10s %s\n", "logits", "loss", "rel. error", "ms", "MiB");
  for (const Row& row : rows) {
    std::printf("%s", absl::StrFormat("%-9s %-14.10f %-12.2e %-10.1f %.1f\n", row.logits, row.loss,
                                      row.relative_error, 1e3 * row.measured.seconds,
                                      row.measured.peak_bytes / 1048576.0)
                          .c_str());
  }
  std::printf("%s", absl::StrFormat("time fp32 / bf16 logits: %.2f\n", ratio).c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace remotehead::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = remotehead::bench::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
