// The chunked head engine: loss, per-token outputs, dX and dW of f(X·Wᵀ + b) computed a block
// of rows at a time, so the [N, V] logits are never materialised.
//
// Per chunk: z = X_c·Wᵀ (+ b) in the head's dtype; then, one cache-sized block of rows at a
// time, upcast to fp32, y = f(z, …) (a registered TransformFunction) and autograd gives dz;
// then dX_c = dz·W and dW += dzᵀ·X_c (db += Σ dz), accumulated in the head's gradient dtype
// (fp32 by default). Three GEMMs per chunk in fused mode; peak memory is about one [rows, V]
// buffer per chunk plus one block's function workspace.
//
// Reductions over the valid tokens (targets != ignore_index; all tokens when no targets):
//   none          per-token y_i (0 at ignored positions)             two-phase only
//   sum           Σ y_i / normalizer            (normalizer default 1)
//   mean          Σ y_i / normalizer            (normalizer default: valid tokens in this call)
//   weighted_sum  Σ w_i·y_i / normalizer        (normalizer default 1)
// The denominator is fixed before the first chunk, so results do not depend on the chunk size,
// and a caller-supplied normalizer (e.g. the tokens of a whole accumulated batch across
// micro-batches and ranks) makes gradient accumulation exact. A mean over zero valid tokens
// is 0 with zero gradients (not NaN).
//
// Every entry point validates all of its inputs before touching any state: an invalid input
// (INVALID_ARGUMENT, message naming the field, expected and actual) leaves the gradient buffers
// bit-identical. A failure during compute (LibTorch out of memory → RESOURCE_EXHAUSTED, other
// LibTorch errors → INTERNAL; no exception escapes) may leave a partial addition in `grads`:
// callers that need all-or-nothing accumulate into scratch buffers (Head::NewGradientBuffers)
// and add them to the head's only on success.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/call_plan.h"  // PlanCall: what a call will hold, for its callers
#include "remotehead/core/functions.h"
#include "remotehead/core/head.h"
#include "remotehead/core/step_options.h"
#include "remotehead/core/token_batch.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead::core {

// The head's health over a call's valid tokens: what an RL trainer watches per optimizer step
// (entropy collapse, logits drifting up). Taken from the fp32 logits the function saw — after
// the logit scale, the softcap and the temperature — over the whole vocabulary (a head group's
// ranks combined), with no GEMM of its own. Sums, so they add exactly across calls and
// micro-batches. Only calls that accumulate dW (FusedForwardBackward / Backward with `grads`,
// and StepOptions::head_health) compute it: a Forward (old or reference log-probs) sees the same
// logits again and would count them twice.
struct HeadHealth {
  int64_t tokens = 0;          // valid tokens summed over (0: not computed)
  double entropy_sum = 0.0;    // Σ H(softmax(z_i)) = Σ (lse_i − E_p[z_i]), nats
  double lse_sq_sum = 0.0;     // Σ lse_i²: the z-loss without its coefficient
  double logit_max_sum = 0.0;  // Σ max_j z_ij
  double logit_max = -std::numeric_limits<double>::infinity();  // max_i max_j z_ij

  void Add(const HeadHealth& other) {
    tokens += other.tokens;
    entropy_sum += other.entropy_sum;
    lse_sq_sum += other.lse_sq_sum;
    logit_max_sum += other.logit_max_sum;
    logit_max = std::max(logit_max, other.logit_max);
  }
};

struct StepStats {
  int64_t valid_tokens = 0;
  double denominator = 1.0;  // what Σ was divided by
  int64_t chunk_rows = 0;    // the chunk size actually used (rows per GEMM)
  int64_t block_rows = 0;    // rows per function block (what autograd differentiates at once)
  int64_t num_chunks = 0;
  // Σ over valid tokens of each per-token diagnostic the function reports (e.g. "nll",
  // "z_loss", "kl"); sums, so they add exactly across micro-batches.
  std::map<std::string, double> extras;
  HeadHealth health;  // tokens == 0 unless this call accumulated dW
};

// StepOptions::token_extras, by name: [N] each, in the outputs' dtype, 0 at ignored positions.
using TokenExtras = std::map<std::string, torch::Tensor>;

struct FusedResult {
  double loss = 0.0;          // the reduced loss (not multiplied by upstream_scale); 0 when
                              // StepOptions::loss_on_device
  torch::Tensor loss_value;   // the same, 0-d float64 on the head's device (always set)
  torch::Tensor grad_hidden;  // dX [N, D] in the head's dtype (a group: undefined off rank 0)
  StepStats stats;
  TokenExtras token_extras;
};

struct BackwardResult {
  torch::Tensor grad_hidden;  // dX [N, D] in the head's dtype (a group: undefined off rank 0)
  StepStats stats;
  TokenExtras token_extras;
};

struct ForwardResult {
  // reduction none: per-token outputs [N] fp32 (0 at ignored positions); otherwise a 0-d fp32.
  // Function "logits": [N, V] in options.output_dtype; "sample": the drawn tokens' log-probs [N].
  torch::Tensor output;
  torch::Tensor token_ids;  // function "sample": the drawn tokens [N] int64
  StepStats stats;
  TokenExtras token_extras;
};

// Fused mode: the scalar loss, dX and (if `grads` is not null) dW/db += in one pass, three
// GEMMs per chunk, no recompute. `grad_hidden_out`, if defined, receives dX in place
// ([N, D], the head's dtype, contiguous) instead of a newly allocated tensor.
absl::StatusOr<FusedResult> FusedForwardBackward(const Head& head, const TokenBatch& batch,
                                                 const StepOptions& options, GradientBuffers* grads,
                                                 torch::Tensor grad_hidden_out = {});

// Two-phase mode, phase 1: outputs only, no gradients, no state touched. Also generation: with
// the function "logits" or "sample" (OutputKind, reduction none) the rows' logits or a drawn
// token, a chunk of logits at a time.
absl::StatusOr<ForwardResult> Forward(const Head& head, const TokenBatch& batch,
                                      const StepOptions& options);

// Two-phase mode, phase 2: given dL/d(output) — [N] for reduction none, a scalar otherwise —
// recomputes each chunk's logits, returns dX and (if `grads` is not null) adds dW/db.
absl::StatusOr<BackwardResult> Backward(const Head& head, const TokenBatch& batch,
                                        const StepOptions& options,
                                        const torch::Tensor& grad_output, GradientBuffers* grads,
                                        torch::Tensor grad_hidden_out = {});

// Makes LibTorch's CPU vector math (the elementwise exp, log, tanh, sqrt, ... that it runs on
// MKL's VML) ready in this process, once, on the calling thread; later calls return at once.
// VML picks its kernels on its first call in a process, and that is not thread-safe: when the
// first call comes from several OpenMP threads at once (any tensor above LibTorch's grain size),
// a thread that enters while another is still choosing can compute with the wrong kernel. The
// engine's entry points call this first; a server calls it at start, before any request runs.
void WarmUpCpuMath();

}  // namespace remotehead::core
