#include "remotehead/core/sampler_kept_set.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace remotehead::core {
namespace {

// top-p without top-k asks for this many largest values first, then kTopPGrowth times more
// each round: a language model's nucleus is usually a few hundred tokens.
constexpr int64_t kFirstTopPValues = 64;
constexpr int64_t kTopPGrowth = 4;
// fp32 buffers per candidate column (of `columns`) while τ is formed, measured by
// tests/core/memory_budget_test.cc and memory_model_test.cc: topk's values and int64 indices;
// for top-p also the float64 probabilities, their cumulative sums and masks.
constexpr double kLargestBuffers = 3.0;
constexpr double kCumulativeBuffers = 4.0;
// The bool mask autograd keeps, and the masked logits while the log-softmax reads them.
constexpr double kMaskBuffers = 1.25;

double ParamOr(const FunctionParams& params, const char* name, double off) {
  const auto it = params.find(name);
  return it == params.end() ? off : it->second;
}

// The sampler's settings, with a top_k that keeps the whole vocabulary turned off.
struct Sampler {
  int64_t top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  bool min_p_first = false;
};

Sampler ReadSampler(const FunctionParams& params, int64_t vocab_size) {
  Sampler s;
  s.top_k = static_cast<int64_t>(ParamOr(params, kTopKParam, 0.0));
  if (s.top_k >= vocab_size) s.top_k = 0;
  s.top_p = ParamOr(params, kTopPParam, 1.0);
  s.min_p = ParamOr(params, kMinPParam, 0.0);
  s.min_p_first = ParamOr(params, kMinPFirstParam, 0.0) != 0.0;
  return s;
}

// The smallest value of `dtype` >= x (float64 [n]): for every z of that dtype, z >= the result
// exactly when z >= x, so min-p's boundary is the real-number one.
torch::Tensor RoundUpTo(const torch::Tensor& x, torch::ScalarType dtype) {
  const torch::Tensor r = x.to(dtype);
  if (dtype == torch::kDouble) return r;
  const torch::Tensor up = torch::nextafter(r, torch::full_like(r, kInf));
  return torch::where(r.to(torch::kDouble) < x, up, r);
}

struct TopPStep {
  torch::Tensor tau;   // [n] τ_p, or −inf where the whole set is kept
  torch::Tensor done;  // [n] whether the values seen decide the row
};

// top-p from a row's m largest values `values` [n, m] (descending) of the set {z >= floor}
// renormalised by its log-sum-exp `lse` [n]. The cumulative sums are float64 (p >= 0 keeps them
// non-decreasing in floating point too, so "reached" is false then true along a row). A row is
// decided once its sum reaches top_p, once a value below the floor shows the whole set was seen,
// or when the values are the whole row.
TopPStep TopPFromLargest(const torch::Tensor& values, const torch::Tensor& floor,
                         const torch::Tensor& lse, double top_p, bool whole_row) {
  const int64_t m = values.size(1);
  const torch::Tensor outside = values < floor.unsqueeze(1);
  // A copy (a float64 row's own values are read again below).
  torch::Tensor cumulative = values.to(torch::kDouble, /*non_blocking=*/false, /*copy=*/true);
  cumulative.sub_(lse.to(torch::kDouble).unsqueeze(1)).exp_().masked_fill_(outside, 0.0);
  cumulative = cumulative.cumsum(1);
  const torch::Tensor reached = cumulative >= top_p;
  cumulative.reset();
  const torch::Tensor first = reached.logical_not().sum(1).clamp_max(m - 1);
  const torch::Tensor any = reached.select(1, m - 1);
  TopPStep step;
  step.tau = torch::where(any, values.gather(1, first.unsqueeze(1)).squeeze(1), -kInf);
  step.done = any.logical_or(outside.select(1, m - 1));
  if (whole_row) step.done.fill_(true);
  return step;
}

}  // namespace

std::vector<ParamSpec> SamplerParams() {
  return {
      {kTopKParam, 0.0, 0.0, 2147483647.0,
       "if > 0: only the k largest logits are kept (ties with the k-th kept)"},
      {kTopPParam, 1.0, 1e-9, 1.0,
       "nucleus: the smallest set of largest tokens with probability >= top_p (1: off)"},
      {kMinPParam, 0.0, 0.0, 1.0, "if > 0: only tokens with p >= min_p * p_max are kept"},
      {kMinPFirstParam, 0.0, 0.0, 1.0,
       "0: top-k, top-p, then min-p (Hugging Face); 1: min-p first (vLLM)"},
  };
}

absl::Status ValidateSamplerParams(const FunctionParams& params) {
  const double top_k = ParamOr(params, kTopKParam, 0.0);
  if (top_k != std::floor(top_k)) {
    return absl::InvalidArgumentError(
        absl::StrCat("params[\"", kTopKParam, "\"]: expected a whole number; got ", top_k));
  }
  const double first = ParamOr(params, kMinPFirstParam, 0.0);
  if (first != 0.0 && first != 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("params[\"", kMinPFirstParam, "\"]: expected 0 or 1; got ", first));
  }
  return absl::OkStatus();
}

bool SamplerActive(const FunctionParams& params) {
  return ParamOr(params, kTopKParam, 0.0) > 0 || ParamOr(params, kTopPParam, 1.0) < 1 ||
         ParamOr(params, kMinPParam, 0.0) > 0;
}

torch::Tensor KeptThreshold(const torch::Tensor& z, const FunctionParams& params,
                            const VocabOps& vocab) {
  torch::NoGradGuard no_grad;
  const torch::Tensor zd = z.detach();
  const int64_t v = vocab.vocab_size();
  const Sampler s = ReadSampler(params, v);
  torch::Tensor tau = torch::full({zd.size(0)}, -kInf, zd.options());
  torch::Tensor largest;  // the top_k largest values, when top_k is on
  if (s.top_k > 0) {
    largest = vocab.LargestValues(zd, s.top_k);
    tau = largest.select(1, s.top_k - 1).clone();
  }
  torch::Tensor tau_min_p;
  if (s.min_p > 0) {
    const torch::Tensor max =
        s.top_k > 0 ? largest.select(1, 0) : vocab.LargestValues(zd, 1).select(1, 0);
    tau_min_p = RoundUpTo(max.to(torch::kDouble) + std::log(s.min_p), zd.scalar_type());
    if (s.min_p_first) tau = torch::maximum(tau, tau_min_p);
  }
  if (s.top_p < 1) {
    // top-p renormalises over what the truncations before it kept: {z >= tau}.
    const bool truncated = s.top_k > 0 || (s.min_p > 0 && s.min_p_first);
    const torch::Tensor lse =
        truncated ? vocab.LogSumExp(zd.masked_fill(zd < tau.unsqueeze(1), -kInf))
                  : vocab.LogSumExp(zd);
    torch::Tensor tau_p;
    if (s.top_k > 0) {
      // The set is the top_k values and ties with the k-th: if their sum stays below top_p,
      // the rest of the set equals τ_k, which keeps it whole.
      tau_p = TopPFromLargest(largest, tau, lse, s.top_p, /*whole_row=*/true).tau;
    } else {
      // How many values to ask for depends on the values, yet every rank of a head group makes
      // the same calls in the same order (functions.h, rule 4): each decides from the same
      // gathered values and the same combined lse, which VocabOps makes identical bit for bit
      // on every rank.
      for (int64_t m = std::min(kFirstTopPValues, v);; m = std::min(m * kTopPGrowth, v)) {
        TopPStep step = TopPFromLargest(vocab.LargestValues(zd, m), tau, lse, s.top_p, m == v);
        if (step.done.all().item<bool>()) {
          tau_p = std::move(step.tau);
          break;
        }
      }
    }
    tau = torch::maximum(tau, tau_p);
  }
  if (s.min_p > 0 && !s.min_p_first) tau = torch::maximum(tau, tau_min_p);
  return tau;
}

SampledLogProb TargetLogProbAndKept(const ChunkInputs& in) {
  if (!SamplerActive(*in.params)) {
    return {in.vocab->LogSoftmaxAtTarget(in.logits, in.targets),
            torch::ones({in.logits.size(0)}, in.logits.options())};
  }
  const torch::Tensor tau = KeptThreshold(in.logits, *in.params, *in.vocab);
  const torch::Tensor outside = in.logits.detach() < tau.unsqueeze(1);
  // z_t − lse over K in one VocabOps call; a target outside K reads −inf there, and the where
  // below gives it a zero gradient (the masked log-softmax alone would still pass −p'_j).
  const torch::Tensor y =
      in.vocab->LogSoftmaxAtTarget(in.logits.masked_fill(outside, -kInf), in.targets);
  const torch::Tensor kept = y.detach().isneginf().logical_not();
  return {torch::where(kept, y, -kInf), kept.to(in.logits.scalar_type())};
}

torch::Tensor TargetLogProb(const ChunkInputs& in) { return TargetLogProbAndKept(in).logprob; }

double SamplerWorkspaceBuffers(const FunctionParams& params, int64_t columns, int64_t ranks) {
  if (!SamplerActive(params) || columns < 1) return 0.0;
  const Sampler s = ReadSampler(params, std::numeric_limits<int64_t>::max());
  double sorted = 0.0;  // the largest values a block sorts at once, per row
  if (s.top_k > 0) {
    sorted = static_cast<double>(ranks * std::min(s.top_k, columns));
  } else if (s.top_p < 1) {
    sorted = static_cast<double>(ranks * columns);
  }
  const double per_column = kLargestBuffers + (s.top_p < 1 ? kCumulativeBuffers : 0.0);
  return kMaskBuffers + per_column * std::min(sorted, static_cast<double>(ranks * columns)) /
                            static_cast<double>(columns);
}

}  // namespace remotehead::core
