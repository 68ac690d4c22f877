// remotehead-bench: one LM-head training step (loss, dX, dW) measured four ways at each N:
//
//   naive      full [N, V] logits through LibTorch autograd (what a framework does by default)
//   fused      remotehead::core::FusedForwardBackward (one chunked pass, three GEMMs per chunk)
//   two_phase  Forward, then Backward with dL/dloss = 1 (recomputes the logits: four GEMMs)
//   gemm       just the three GEMMs of the step at full size (X·Wᵀ, dZ·W, dZᵀ·X): the floor
//
// A two-head function (--function distill_kl, distill_reverse_kl, distill_jsd) adds a frozen
// teacher head of the same V (width --teacher_d): naive forms both [N, V] logits (the teacher's
// under no_grad) and the divergence; gemm adds the teacher's GEMM (8·N·D·V FLOPs at D_t = D).
//
// step_seconds is the median over --repeats after --warmup untimed steps. peak_bytes is the
// transient memory of a warm step: the peak allocated during it minus what was allocated just
// before it, with weights, inputs and gradient buffers already in place (CPU memory is measured
// by the engine's counting allocator, CUDA by the caching allocator's statistics). Accuracy is
// the max |difference| of the loss, dX and dW from naive, from the last timed repetition (each
// repetition starts from zeroed gradients, so that is one step's result).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_flags.h"
#include "bench/bench_measure.h"
#include "bench/bench_phases.h"
#include "bench/bench_results.h"
#include "bench/bench_plot.h"
#include "remotehead/core/device.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/head.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/core/torch_api.h"

// Flag names are snake_case for Abseil; main() also accepts the kebab-case spelling
// (--chunk-rows), which is how the documentation writes them.
ABSL_FLAG(std::vector<std::string>, n, std::vector<std::string>({"2048"}),
          "rows (tokens) per step; a comma list runs each, e.g. 2048,8192,16384");
ABSL_FLAG(int64_t, d, 1024, "hidden size D");
ABSL_FLAG(int64_t, v, 32000, "vocabulary size V");
ABSL_FLAG(std::string, dtype, "float32", "head dtype: float32, bfloat16, float16 (or float64)");
ABSL_FLAG(std::string, grad_dtype, "",
          "the dW accumulators' dtype (HeadOptions::grad_dtype): empty for the default (float32; "
          "float64 for a float64 head), or the head's own dtype (the memory mode)");
ABSL_FLAG(std::string, device, "auto", "auto (cuda:0 if available, else cpu), cpu, cuda or cuda:N");
ABSL_FLAG(std::string, function, "cross_entropy",
          "cross_entropy, token_logprobs, mse_onehot, entropy or sigmoid_sum");
ABSL_FLAG(std::string, reduction, "mean", "mean or sum");
ABSL_FLAG(double, softcap, 0,
          "cap·tanh(z/cap) on the logits before the function (Gemma 2's 30); 0 = none");
ABSL_FLAG(int64_t, chunk_rows, 0, "rows per chunk; 0 = derived from --memory_budget_bytes");
ABSL_FLAG(int64_t, memory_budget_bytes, 0, "engine transient budget per chunk; 0 = default");
ABSL_FLAG(int64_t, block_rows, 0, "rows per function block; 0 = the plan rules' default");
ABSL_FLAG(bool, cuda_plan_rules, false,
          "plan chunks, blocks and the gradient's buffer by CUDA's rules on any device "
          "(StepOptions::plan_rules; a CUDA head always does)");
ABSL_FLAG(int32_t, repeats, 3, "timed repetitions (the median is reported)");
ABSL_FLAG(int32_t, warmup, 1, "untimed repetitions before the timed ones");
ABSL_FLAG(bool, bias, false, "give the head a bias");
ABSL_FLAG(bool, head_health, false,
          "compute the head's health (StepStats::health; no peer computes it)");
ABSL_FLAG(bool, fused_blocks, false,
          "fused function blocks (StepOptions::fused_blocks): the CUDA kernel on a GPU, its CPU "
          "twin on a CPU; the chunk is the block and dz overwrites the logits");
ABSL_FLAG(int64_t, teacher_d, 0,
          "two-head functions: the teacher's hidden size (0 = D); its V is the student's");
ABSL_FLAG(double, beta, 0.5, "distill_jsd: TRL's beta (0 forward KL, 1 reverse KL)");
ABSL_FLAG(bool, json, false, "print one JSON object on stdout instead of the table");
ABSL_FLAG(int64_t, skip_naive_above_bytes, int64_t{8} << 30,
          "skip naive (and gemm) when its estimated logits memory N*V*4*3 exceeds this");
ABSL_FLAG(int32_t, threads, 0, "torch::set_num_threads when > 0");
ABSL_FLAG(uint64_t, seed, 0, "seed of the head's weights and of the inputs");
ABSL_FLAG(bool, torch_lce, true,
          "also measure PyTorch's own chunked linear_cross_entropy (cross_entropy only; a "
          "Python op, run by --python)");
ABSL_FLAG(std::string, plot, "",
          "also draw time and peak memory against N (naive, PyTorch's linear_cross_entropy, "
          "fused, two-phase) into this PNG");
ABSL_FLAG(std::string, python, REMOTEHEAD_PYTHON,
          "the Python (torch, matplotlib) that runs plot_bench.py for --torch_lce and --plot");

namespace {

namespace rh = remotehead::core;
namespace bench = remotehead::bench;
using Clock = std::chrono::steady_clock;

using bench::kIgnoredFraction;

// --cuda_plan_rules as the engine's option.
rh::PlanRules PlanRulesFlag() {
  return absl::GetFlag(FLAGS_cuda_plan_rules) ? rh::PlanRules::kCuda : rh::PlanRules::kDevice;
}

using bench::kIgnoreIndex;
using bench::NResult;
using bench::OrNull;
using bench::Variant;
// Functions whose only per-token input is the targets; the others (grpo) need aux inputs
// whose choice would change what is being measured.
const std::vector<std::string> kSupportedFunctions = {
    "cross_entropy", "token_logprobs", "mse_onehot",        "entropy",
    "sigmoid_sum",   "distill_kl",     "distill_reverse_kl", "distill_jsd"};

// TRL's beta of a two-head function: what the naive step computes.
double DistillBeta(const std::string& function, double jsd_beta) {
  if (function == "distill_kl") return 0.0;
  if (function == "distill_reverse_kl") return 1.0;
  return jsd_beta;
}

struct Config {
  std::vector<int64_t> ns;
  int64_t d = 0, v = 0;
  int64_t teacher_d = 0;  // > 0: a two-head function's teacher width
  double beta = 0.5;      // distill_jsd
  torch::ScalarType dtype = torch::kFloat;
  std::optional<torch::ScalarType> grad_dtype;  // unset: the default accumulators
  torch::Device device = torch::kCPU;
  std::string function;
  rh::Reduction reduction = rh::Reduction::kMean;
  double softcap = 0;  // 0: none
  int64_t chunk_rows = 0, memory_budget_bytes = 0, skip_naive_above_bytes = 0;
  int repeats = 0, warmup = 0, threads = 0;
  bool bias = false, json = false;
  uint64_t seed = 0;
};

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  for (const std::string& item : absl::GetFlag(FLAGS_n)) {
    for (absl::string_view part : absl::StrSplit(item, ',', absl::SkipEmpty())) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(part, &n) || n < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("--n: expected positive integers; got \"", std::string(part), "\""));
      }
      c.ns.push_back(n);
    }
  }
  if (c.ns.empty()) return absl::InvalidArgumentError("--n: expected at least one value");
  c.d = absl::GetFlag(FLAGS_d);
  c.v = absl::GetFlag(FLAGS_v);
  if (c.d < 1 || c.v < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--d, --v: expected >= 1; got ", c.d, ", ", c.v));
  }
  ASSIGN_OR_RETURN(c.dtype, rh::ParseHeadDtype(absl::GetFlag(FLAGS_dtype)));
  if (!absl::GetFlag(FLAGS_grad_dtype).empty()) {
    ASSIGN_OR_RETURN(c.grad_dtype, rh::ParseHeadDtype(absl::GetFlag(FLAGS_grad_dtype)));
  }
  ASSIGN_OR_RETURN(c.device, rh::ResolveDevice(absl::GetFlag(FLAGS_device), "--device"));
  c.function = absl::GetFlag(FLAGS_function);
  RETURN_IF_ERROR(rh::FunctionRegistry::Builtin().Find(c.function).status());
  if (std::find(kSupportedFunctions.begin(), kSupportedFunctions.end(), c.function) ==
      kSupportedFunctions.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--function: the bench supplies only targets, so it supports ",
                     absl::StrJoin(kSupportedFunctions, ", "), "; got ", c.function,
                     " (which needs other per-token inputs)"));
  }
  if ((*rh::FunctionRegistry::Builtin().Find(c.function))->needs_teacher) {
    c.teacher_d = absl::GetFlag(FLAGS_teacher_d) > 0 ? absl::GetFlag(FLAGS_teacher_d) : c.d;
  }
  if (c.teacher_d > 0 && c.softcap > 0) {
    return absl::InvalidArgumentError(
        "--softcap: the naive distillation step applies none; got a softcap with a two-head "
        "function");
  }
  c.beta = absl::GetFlag(FLAGS_beta);
  if (!(c.beta >= 0 && c.beta <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--beta: expected [0, 1]; got ", c.beta));
  }
  ASSIGN_OR_RETURN(c.reduction, rh::ParseReduction(absl::GetFlag(FLAGS_reduction)));
  if (c.reduction != rh::Reduction::kMean && c.reduction != rh::Reduction::kSum) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--reduction: the bench times a scalar loss without weights: mean or sum; got ",
        absl::GetFlag(FLAGS_reduction)));
  }
  c.softcap = absl::GetFlag(FLAGS_softcap);
  if (!(c.softcap >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--softcap: expected >= 0 (0 = none); got ", c.softcap));
  }
  c.chunk_rows = absl::GetFlag(FLAGS_chunk_rows);
  c.memory_budget_bytes = absl::GetFlag(FLAGS_memory_budget_bytes);
  c.skip_naive_above_bytes = absl::GetFlag(FLAGS_skip_naive_above_bytes);
  c.repeats = absl::GetFlag(FLAGS_repeats);
  c.warmup = absl::GetFlag(FLAGS_warmup);
  c.threads = absl::GetFlag(FLAGS_threads);
  if (c.repeats < 1 || c.warmup < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--repeats >= 1 and --warmup >= 0 expected; got ", c.repeats, ", ", c.warmup));
  }
  c.bias = absl::GetFlag(FLAGS_bias);
  c.json = absl::GetFlag(FLAGS_json);
  c.seed = absl::GetFlag(FLAGS_seed);
  return c;
}

// bench::Measure into `out`: the step's median time and the transient bytes of its last
// repetition, which is warm whenever warmup + repeats > 1.
absl::Status Measure(const Config& cfg, const std::function<void()>& prepare,
                     const std::function<absl::Status()>& step, Variant* out) {
  ASSIGN_OR_RETURN(const bench::Measurement m,
                   bench::Measure(cfg.device, cfg.warmup, cfg.repeats, prepare, step));
  out->seconds = m.seconds;
  out->peak_bytes = m.peak_bytes;
  out->skipped = false;
  return absl::OkStatus();
}

// In fp64, so that comparing an fp32 (or fp64) result adds no rounding of its own.
double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  torch::NoGradGuard no_grad;
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

absl::StatusOr<NResult> RunOne(const Config& cfg, const rh::Head& head,
                               const rh::StepOptions& options, int64_t n) {
  const rh::Head* teacher = options.teacher;
  NResult r;
  r.n = n;
  const int64_t d = cfg.d, v = cfg.v;
  const auto head_opts = head.weight().options();

  // Inputs are drawn on the CPU so that every device sees the same values. Targets are passed
  // to every function, also to entropy / sigmoid_sum, which need none: their ignored tokens
  // are then left out on both sides, like padding.
  rh::TokenBatch batch;
  torch::Tensor targets = torch::randint(0, v, {n}, torch::kLong);
  targets.masked_fill_(torch::rand({n}) < kIgnoredFraction, kIgnoreIndex);
  batch.hidden = torch::randn({n, d}).to(head_opts);
  batch.targets = targets.to(cfg.device);
  if (teacher != nullptr) {
    batch.teacher_hidden = torch::randn({n, cfg.teacher_d}).to(teacher->weight().options());
  }
  const int64_t valid_count = (targets != kIgnoreIndex).sum().item<int64_t>();

  // 1. naive. Its X.grad / W.grad are reset to undefined before each step, so autograd
  // allocates dX and dW inside the step and naive's peak includes them: that is what a plain
  // loss.backward() costs. (The engine's dW accumulator and dX output are preallocated.)
  torch::Tensor naive_dx, naive_dw;
  const int64_t naive_estimate = n * v * 4 * 3;
  if (naive_estimate <= cfg.skip_naive_above_bytes) {
    torch::Tensor x = batch.hidden.detach().requires_grad_(true);  // shares X's storage
    torch::Tensor w = head.weight().detach().clone().requires_grad_(true);
    torch::Tensor b =
        cfg.bias ? head.bias().detach().clone().requires_grad_(true) : torch::Tensor();
    RETURN_IF_ERROR(Measure(
        cfg,
        [&] {
          x.mutable_grad().reset();
          w.mutable_grad().reset();
          if (b.defined()) b.mutable_grad().reset();
        },
        [&]() -> absl::Status {
          r.naive.loss =
              teacher != nullptr
                  ? bench::NaiveDistillStep(x, w, b, batch.teacher_hidden, teacher->weight(),
                                            batch.targets, DistillBeta(cfg.function, cfg.beta),
                                            cfg.reduction, valid_count)
                  : bench::NaiveStep(x, w, b, batch.targets, cfg.function, cfg.reduction,
                                     valid_count, cfg.softcap);
          return absl::OkStatus();
        },
        &r.naive));
    naive_dx = x.grad();
    naive_dw = w.grad();
  }

  // 2./3. engine. Gradient buffers and the dX output are allocated once, outside the clock,
  // and zeroed before every repetition so each leaves exactly one step's dW.
  rh::GradientBuffers grads = head.NewGradientBuffers();
  torch::Tensor grad_hidden = torch::empty({n, d}, head_opts);
  const auto zero_grads = [&] {
    grads.weight.zero_();
    if (grads.bias.defined()) grads.bias.zero_();
  };
  const auto compare = [&](Variant& variant) {
    if (!naive_dx.defined()) return;
    variant.d_loss = std::abs(variant.loss - r.naive.loss);
    variant.d_hidden = MaxAbsDiff(grad_hidden, naive_dx);
    variant.d_weight = MaxAbsDiff(grads.weight, naive_dw);
  };

  RETURN_IF_ERROR(Measure(
      cfg, zero_grads,
      [&]() -> absl::Status {
        ASSIGN_OR_RETURN(rh::FusedResult fused,
                         rh::FusedForwardBackward(head, batch, options, &grads, grad_hidden));
        r.fused.loss = fused.loss;
        r.stats = std::move(fused.stats);
        return absl::OkStatus();
      },
      &r.fused));
  compare(r.fused);
  {
    bench::PhaseClock clock(cfg.device);
    rh::StepOptions marked = options;
    marked.phases = &clock;
    zero_grads();
    bench::Synchronize(cfg.device);
    clock.StepBegins();
    RETURN_IF_ERROR(rh::FusedForwardBackward(head, batch, marked, &grads, grad_hidden).status());
    clock.StepEnds();
    bench::Synchronize(cfg.device);
    r.fused_phases = clock.TakeSeconds();
    r.fused_phases_step = clock.StepSeconds();
  }

  const torch::Tensor one = torch::ones({}, torch::TensorOptions().device(cfg.device));
  RETURN_IF_ERROR(Measure(
      cfg, zero_grads,
      [&]() -> absl::Status {
        ASSIGN_OR_RETURN(rh::ForwardResult fwd, rh::Forward(head, batch, options));
        RETURN_IF_ERROR(rh::Backward(head, batch, options, one, &grads, grad_hidden).status());
        r.two_phase.loss = fwd.output.item<double>();
        return absl::OkStatus();
      },
      &r.two_phase));
  compare(r.two_phase);
  naive_dx = naive_dw = torch::Tensor();

  // 4. gemm: the step's three GEMMs at full size into preallocated buffers (and a teacher's
  // logits GEMM). The dW GEMM runs in the accumulator's dtype, as the engine's does (fp32 for a
  // half-precision head), with its operands converted outside the clock.
  const bool fp32_dw = grads.weight.scalar_type() != head.dtype();
  const int64_t gemm_bytes = n * v * (c10::elementSize(head.dtype()) + (fp32_dw ? 4 : 0));
  if (gemm_bytes <= cfg.skip_naive_above_bytes) {
    torch::NoGradGuard no_grad;
    torch::Tensor z = torch::empty({n, v}, head_opts);
    torch::Tensor dx = torch::empty({n, d}, head_opts);
    torch::Tensor dz_dw = fp32_dw ? torch::randn({n, v}, grads.weight.options()) : z;
    torch::Tensor x_dw = fp32_dw ? batch.hidden.to(torch::kFloat) : batch.hidden;
    torch::Tensor zt = teacher != nullptr ? torch::empty({n, v}, teacher->weight().options())
                                          : torch::Tensor();
    RETURN_IF_ERROR(Measure(
        cfg, zero_grads,
        [&]() -> absl::Status {
          if (zt.defined()) torch::mm_out(zt, batch.teacher_hidden, teacher->weight().t());
          torch::mm_out(z, batch.hidden, head.weight().t());
          torch::mm_out(dx, z, head.weight());
          if (fp32_dw && cfg.device.is_cuda()) {
            // The engine's dW on CUDA: the bf16 dz and X_c on tensor cores into the fp32 dW.
            at::addmm_out(grads.weight, grads.weight, z.t(), batch.hidden, torch::kFloat);
          } else {
            grads.weight.addmm_(dz_dw.t(), x_dw);
          }
          return absl::OkStatus();
        },
        &r.gemm));
  }
  return r;
}

nlohmann::json ToJson(const Config& cfg, int64_t chunk_rows, const std::vector<NResult>& rs) {
  nlohmann::json results = nlohmann::json::array();
  for (const NResult& r : rs) {
    nlohmann::json naive = VariantJson(r.naive, r, false);
    if (!r.naive.skipped) naive["loss"] = r.naive.loss;
    results.push_back({
        {"n", r.n},
        {"valid_tokens", r.stats.valid_tokens},
        {"chunk_rows", r.stats.chunk_rows},
        {"num_chunks", r.stats.num_chunks},
        {"gemm_seconds", r.gemm.skipped ? nlohmann::json(nullptr) : nlohmann::json(r.gemm.seconds)},
        {"fused_over_naive", OrNull(Ratio(r.fused, r.naive))},
        {"fused_over_torch_lce", OrNull(Ratio(r.fused, r.torch_lce))},
        {"fused_peak_over_torch_lce", OrNull(PeakRatio(r.fused, r.torch_lce))},
        {"fused_gemm_ratio", OrNull(Ratio(r.gemm, r.fused))},
        {"fused_phases", PhasesJson(r)},
        {"variants",
         {{"naive", naive},
          {"fused", VariantJson(r.fused, r, true)},
          {"two_phase", VariantJson(r.two_phase, r, true)},
          {"gemm", VariantJson(r.gemm, r, false)},
          {"torch_lce", BaselineJson(r.torch_lce, r)}}},
    });
  }
  return {
      {"bench", "remotehead-bench"},
      {"config",
       {{"n", cfg.ns},
        {"d", cfg.d},
        {"v", cfg.v},
        {"teacher_d", cfg.teacher_d > 0 ? nlohmann::json(cfg.teacher_d) : nlohmann::json(nullptr)},
        {"beta", cfg.beta},
        {"dtype", rh::DtypeName(cfg.dtype)},
        {"device", cfg.device.str()},
        {"function", cfg.function},
        {"reduction", std::string(rh::ReductionName(cfg.reduction))},
        {"softcap", cfg.softcap},
        {"bias", cfg.bias},
        {"threads", torch::get_num_threads()},
        {"chunk_rows", chunk_rows},
        {"memory_budget_bytes",
         cfg.memory_budget_bytes > 0 ? cfg.memory_budget_bytes
                                     : rh::DefaultMemoryBudgetBytes(cfg.device, PlanRulesFlag())},
        {"repeats", cfg.repeats},
        {"warmup", cfg.warmup},
        {"seed", cfg.seed},
        {"ignored_fraction", kIgnoredFraction},
        {"skip_naive_above_bytes", cfg.skip_naive_above_bytes}}},
      {"results", results},
  };
}

// "-" for a missing value, else fixed (%.Nf) or scientific (%.Ne) notation.
std::string Fmt(const std::optional<double>& x, int precision, bool scientific = false) {
  if (!x.has_value()) return "-";
  return scientific ? absl::StrFormat("%.*e", precision, *x)
                    : absl::StrFormat("%.*f", precision, *x);
}

void PrintTable(const Config& cfg, int64_t chunk_rows, const std::vector<NResult>& rs) {
  absl::PrintF(
      "remotehead-bench  d=%d v=%d dtype=%s device=%s function=%s reduction=%s "
      "bias=%s threads=%d chunk_rows=%d repeats=%d warmup=%d\n",
      cfg.d, cfg.v, rh::DtypeName(cfg.dtype), cfg.device.str(), cfg.function,
      std::string(rh::ReductionName(cfg.reduction)), cfg.bias ? "true" : "false",
      torch::get_num_threads(), chunk_rows, cfg.repeats, cfg.warmup);
  absl::PrintF(
      "x_naive = step time / naive's; gemm/step = bare-GEMM time / step time; "
      "peak = transient bytes of a warm step\n\n");
  absl::PrintF("%7s  %-9s  %9s  %7s  %9s  %10s  %10s  %9s  %9s  %9s\n", "N", "variant", "step_s",
               "x_naive", "gemm/step", "peak_MiB", "peak/naive", "|dloss|", "|dX|", "|dW|");
  for (const NResult& r : rs) {
    absl::PrintF("# N=%d: valid_tokens=%d chunk_rows=%d num_chunks=%d\n", r.n, r.stats.valid_tokens,
                 r.stats.chunk_rows, r.stats.num_chunks);
    const std::pair<const char*, const Variant*> rows[] = {{"naive", &r.naive},
                                                           {"torch_lce", &r.torch_lce},
                                                           {"fused", &r.fused},
                                                           {"two_phase", &r.two_phase},
                                                           {"gemm", &r.gemm}};
    for (const auto& [name, v] : rows) {
      if (v->skipped) {
        absl::PrintF("%7d  %-9s  %9s\n", r.n, name, "skipped");
        continue;
      }
      const bool engine = v == &r.fused || v == &r.two_phase;
      absl::PrintF("%7d  %-9s  %9.4f  %7s  %9s  %10.1f  %10s  %9s  %9s  %9s\n", r.n, name,
                   v->seconds, Fmt(Ratio(*v, r.naive), 3), engine ? Fmt(Ratio(r.gemm, *v), 3) : "-",
                   static_cast<double>(v->peak_bytes) / (1 << 20), Fmt(PeakRatio(*v, r.naive), 4),
                   engine ? Fmt(v->d_loss, 2, true) : "-", engine ? Fmt(v->d_hidden, 2, true) : "-",
                   engine ? Fmt(v->d_weight, 2, true) : "-");
    }
    std::string phases;
    for (size_t i = 0; i < r.fused_phases.size(); ++i) {
      absl::StrAppend(&phases, " ", std::string(rh::kStepPhaseNames[i]), "=",
                      absl::StrFormat("%.4f", r.fused_phases[i]));
    }
    absl::PrintF("# N=%d fused phases (s) of a step of %.4f:%s other=%.4f\n", r.n,
                 r.fused_phases_step, phases, UnmarkedSeconds(r));
  }
}

// PyTorch's linear_cross_entropy at every N, in the same run (plot_bench.py --measure with the
// bench's dtype, device, reduction, ignored share, warm-up and repeats). A baseline that cannot
// run is reported as skipped, with the reason on stderr.
void MeasureTorchLce(const Config& cfg, int64_t chunk_rows, std::vector<NResult>* results) {
  absl::StatusOr<std::vector<bench::Measurement>> measured = bench::MeasureTorchLce(
      ToJson(cfg, chunk_rows, *results), absl::GetFlag(FLAGS_python), REMOTEHEAD_PLOT_SCRIPT);
  if (!measured.ok() || measured->size() != results->size()) {
    std::cerr << "remotehead-bench: torch_lce not measured: "
              << (measured.ok() ? "wrong number of results" : measured.status().ToString()) << "\n";
    return;
  }
  for (size_t i = 0; i < results->size(); ++i) {
    Variant& v = (*results)[i].torch_lce;
    v.skipped = false;
    v.seconds = (*measured)[i].seconds;
    v.peak_bytes = (*measured)[i].peak_bytes;
  }
}

absl::Status Run() {
  ASSIGN_OR_RETURN(const Config cfg, ConfigFromFlags());
  if (cfg.threads > 0) torch::set_num_threads(cfg.threads);
  torch::manual_seed(cfg.seed);

  ASSIGN_OR_RETURN(std::unique_ptr<rh::Head> head, rh::Head::Initialize({.vocab_size = cfg.v,
                                                                         .hidden_size = cfg.d,
                                                                         .dtype = cfg.dtype,
                                                                         .bias = cfg.bias,
                                                                         .seed = cfg.seed},
                                                                        {.device = cfg.device,
                                                                         .grad_dtype = cfg.grad_dtype}));
  rh::FunctionParams params;
  if (cfg.softcap > 0) params["softcap"] = cfg.softcap;
  if (cfg.function == "distill_jsd") params["beta"] = cfg.beta;
  // A two-head function's frozen teacher: the same V, its own width and weights.
  std::unique_ptr<rh::Head> teacher;
  if (cfg.teacher_d > 0) {
    ASSIGN_OR_RETURN(teacher, rh::Head::Initialize({.vocab_size = cfg.v,
                                                    .hidden_size = cfg.teacher_d,
                                                    .dtype = cfg.dtype,
                                                    .seed = cfg.seed + 1},
                                                   {.device = cfg.device}));
  }
  const rh::StepOptions options{.function = cfg.function,
                                .params = params,
                                .reduction = cfg.reduction,
                                .ignore_index = kIgnoreIndex,
                                .chunk_rows = cfg.chunk_rows,
                                .block_rows = absl::GetFlag(FLAGS_block_rows),
                                .memory_budget_bytes = cfg.memory_budget_bytes,
                                .plan_rules = PlanRulesFlag(),
                                .head_health = absl::GetFlag(FLAGS_head_health),
                                .fused_blocks = absl::GetFlag(FLAGS_fused_blocks),
                                .teacher = teacher.get()};
  ASSIGN_OR_RETURN(const rh::CallPlan plan, rh::PlanCall(*head, options));
  const int64_t chunk_rows = plan.chunk_rows;

  std::vector<NResult> results;
  for (const int64_t n : cfg.ns) {
    ASSIGN_OR_RETURN(NResult r, RunOne(cfg, *head, options, n));
    results.push_back(std::move(r));
  }
  // PyTorch's linear_cross_entropy has no softcap: with one it would compute another loss.
  if (absl::GetFlag(FLAGS_torch_lce) && cfg.function == "cross_entropy" && cfg.softcap == 0) {
    MeasureTorchLce(cfg, chunk_rows, &results);
  }
  const nlohmann::json report = ToJson(cfg, chunk_rows, results);
  if (cfg.json) {
    std::cout << report.dump(2) << std::endl;
  } else {
    PrintTable(cfg, chunk_rows, results);
  }
  if (absl::GetFlag(FLAGS_plot).empty()) return absl::OkStatus();
  // After the table, its rows for PyTorch's linear_cross_entropy (to stderr under --json, so
  // that stdout stays one JSON object).
  return bench::DrawPlot(report, absl::GetFlag(FLAGS_plot), absl::GetFlag(FLAGS_python),
                         REMOTEHEAD_PLOT_SCRIPT, cfg.json ? std::cerr : std::cout);
}

}  // namespace

int main(int argc, char** argv) {
  // Before any tensor exists, so that every CPU allocation is counted.
  remotehead::core::InstallCpuMemoryTracker();
  absl::SetProgramUsageMessage(
      "times naive full-logits autograd, the fused and two-phase chunked engine, and bare "
      "GEMMs for one LM-head step; e.g. remotehead-bench --n 2048,8192 --d 1024 --v 32000");
  std::vector<std::string> args = remotehead::bench::NormalizeFlagNames(argc, argv);
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(arg_ptrs.size()), arg_ptrs.data());
  if (positional.size() > 1) {
    std::cerr << "remotehead-bench: unexpected argument \"" << positional[1] << "\"\n";
    return 2;
  }
  try {
    const absl::Status status = Run();
    if (!status.ok()) {
      std::cerr << "remotehead-bench: " << status.ToString() << "\n";
      return 1;
    }
  } catch (const c10::Error& e) {
    std::cerr << "remotehead-bench: torch error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "remotehead-bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
