// What both benchmarks measure the same way: the median step time over repeated runs and the
// transient memory of a warm step, and the naive full-logits reference step.
#pragma once

#include <torch/nn/functional.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::bench {

// The value of tokens left out of the loss, and the share of them in the benches' targets.
inline constexpr int64_t kIgnoreIndex = -100;
inline constexpr double kIgnoredFraction = 0.05;

struct Measurement {
  double seconds = 0;      // median wall time of the timed runs
  int64_t peak_bytes = 0;  // transient bytes of the last timed run (warm when runs > 1)
};

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

inline void Synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Runs `prepare` (untimed: zeroing gradients, …) then `step` (timed) warmup + repeats times on
// `device`. The transient bytes are the peak allocated during the step minus what was allocated
// just before it (CPU: the counting allocator of core::InstallCpuMemoryTracker, which the
// program installs first; CUDA: the caching allocator's statistics).
inline absl::StatusOr<Measurement> Measure(const torch::Device& device, int warmup, int repeats,
                                           const std::function<void()>& prepare,
                                           const std::function<absl::Status()>& step) {
  Measurement out;
  std::vector<double> times;
  for (int i = 0; i < warmup + std::max(1, repeats); ++i) {
    prepare();
    Synchronize(device);
    ASSIGN_OR_RETURN(const core::MemoryStats before, core::GetMemoryStats(device));
    RETURN_IF_ERROR(core::ResetPeakMemory(device));
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(step());
    Synchronize(device);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSIGN_OR_RETURN(const core::MemoryStats after, core::GetMemoryStats(device));
    if (i < warmup) continue;
    times.push_back(seconds);
    out.peak_bytes = after.peak_allocated_bytes - before.allocated_bytes;
  }
  out.seconds = Median(times);
  return out;
}

// The textbook full-logits formula of each function on z [N, V] fp32, reduced over the valid
// tokens as the engine does (mean divides by their count, at least 1).
inline torch::Tensor NaiveLoss(const torch::Tensor& z, const torch::Tensor& targets,
                               const std::string& function, core::Reduction reduction,
                               int64_t valid_count) {
  namespace F = torch::nn::functional;
  if (function == "cross_entropy") {
    auto options = F::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex);
    if (reduction == core::Reduction::kSum) {
      options.reduction(torch::kSum);
    } else {
      options.reduction(torch::kMean);
    }
    return F::cross_entropy(z, targets, options);
  }
  const torch::Tensor valid = targets != kIgnoreIndex;
  const torch::Tensor safe = targets.masked_fill(valid.logical_not(), 0).unsqueeze(1);
  torch::Tensor per_token;
  if (function == "token_logprobs") {
    per_token = torch::log_softmax(z, 1).gather(1, safe).squeeze(1);
  } else if (function == "mse_onehot") {
    per_token = (z - torch::zeros_like(z).scatter_(1, safe, 1.0)).square().mean(1);
  } else if (function == "entropy") {
    per_token = -(torch::softmax(z, 1) * torch::log_softmax(z, 1)).sum(1);
  } else {  // sigmoid_sum
    per_token = torch::sigmoid(z).sum(1);
  }
  torch::Tensor total = torch::where(valid, per_token, 0.0).sum();
  if (reduction == core::Reduction::kMean) {
    total = total / static_cast<double>(std::max<int64_t>(valid_count, 1));
  }
  return total;
}

// One naive step: the full [N, V] logits (upcast to fp32 as the engine does; a float64 head
// stays fp64), the loss and loss.backward() into x, w (and b) — requires_grad leaves. Returns
// the loss.
inline double NaiveStep(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                        const torch::Tensor& targets, const std::string& function,
                        core::Reduction reduction, int64_t valid_count, double softcap = 0) {
  torch::Tensor z = b.defined() ? torch::addmm(b, x, w.t()) : torch::mm(x, w.t());
  if (z.scalar_type() != torch::kDouble) z = z.to(torch::kFloat);
  if (softcap > 0) z = torch::tanh(z / softcap) * softcap;
  torch::Tensor loss = NaiveLoss(z, targets, function, reduction, valid_count);
  loss.backward();
  return loss.item<double>();
}

// One naive distillation step, as a trainer with both heads writes it: the teacher's [N, V]
// logits under no_grad (it is frozen), the student's with autograd, both upcast to fp32, the
// divergence of TRL's definition (beta 0: forward KL(t || s), 1: reverse, else the generalized
// JSD) per token from the full log-softmaxes, masked like the targets, and loss.backward() into
// x, w (and b). Returns the loss.
inline double NaiveDistillStep(const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, const torch::Tensor& teacher_x,
                               const torch::Tensor& teacher_w, const torch::Tensor& targets,
                               double beta, core::Reduction reduction, int64_t valid_count) {
  torch::Tensor zt;
  {
    torch::NoGradGuard no_grad;
    zt = torch::mm(teacher_x, teacher_w.t()).to(torch::kFloat);
  }
  torch::Tensor zs = b.defined() ? torch::addmm(b, x, w.t()) : torch::mm(x, w.t());
  zs = zs.to(torch::kFloat);
  const torch::Tensor ls = torch::log_softmax(zs, 1);
  const torch::Tensor lt = torch::log_softmax(zt, 1);
  torch::Tensor per_token;
  if (beta == 0) {
    per_token = (torch::exp(lt) * (lt - ls)).sum(1);
  } else if (beta == 1) {
    per_token = (torch::exp(ls) * (ls - lt)).sum(1);
  } else {
    const torch::Tensor lm = torch::logaddexp(ls + std::log1p(-beta), lt + std::log(beta));
    per_token = (beta * torch::exp(lt) * (lt - lm) + (1 - beta) * torch::exp(ls) * (ls - lm)).sum(1);
  }
  torch::Tensor loss = torch::where(targets != kIgnoreIndex, per_token, 0.0).sum();
  if (reduction == core::Reduction::kMean) {
    loss = loss / static_cast<double>(std::max<int64_t>(valid_count, 1));
  }
  loss.backward();
  return loss.item<double>();
}

}  // namespace remotehead::bench
