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

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/head.h"
#include "remotehead/core/token_batch.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead::core {

enum class Reduction { kNone, kSum, kMean, kWeightedSum };
absl::StatusOr<Reduction> ParseReduction(std::string_view name);
std::string_view ReductionName(Reduction reduction);

// Used when neither chunk_rows nor memory_budget_bytes is given.
inline constexpr int64_t kDefaultMemoryBudgetBytes = int64_t{96} << 20;
// fp32 logits per function block: small enough that the upcast copy, the function's
// temporaries and their gradients stay in the CPU's caches (or a GPU's L2).
inline constexpr int64_t kFunctionBlockBytes = int64_t{2} << 20;

struct StepOptions {
  std::string function = "cross_entropy";
  FunctionParams params;  // function options, plus the common temperature / softcap
  Reduction reduction = Reduction::kMean;
  std::optional<double> normalizer;  // > 0; see the reduction table above
  int64_t ignore_index = -100;
  int64_t chunk_rows = 0;           // rows per chunk; 0 = derive from memory_budget_bytes
  int64_t block_rows = 0;           // rows per function block; 0 = cache-sized (see below)
  int64_t memory_budget_bytes = 0;  // transient bytes per chunk; 0 = kDefaultMemoryBudgetBytes
  double upstream_scale = 1.0;      // fused mode: dL/d(loss), e.g. a loss scale
  // Asked before every chunk; returning true abandons the call with CANCELLED (a server's
  // cancelled or expired request stops within one chunk). `grads` may then hold a partial
  // addition, like any failure during compute.
  std::function<bool()> should_stop;
  // Optional [rows ≥ chunk_rows, V] buffer in the head's dtype and device for the chunk logits,
  // reused across calls (a server computing one request batch by batch); undefined or too
  // small: the engine allocates its own for the call.
  torch::Tensor logits_workspace;
  // Index, in the caller's request, of this call's first row: error messages name a bad row by
  // first_row + its index in the call (a server computing one request batch by batch).
  int64_t first_row = 0;
  // Function "logits" (a generation output): the dtype of the returned rows (floating).
  torch::ScalarType logits_dtype = torch::kFloat;
  // Where `function` is looked up; null: FunctionRegistry::Builtin().
  const FunctionRegistry* registry = nullptr;
  // Set when the head is one shard of a head group (vocab_group.h): targets are global token
  // ids in [0, shard->vocab_size()), the function's vocabulary reductions are combined across
  // the group, dX is summed to rank 0 (the only rank whose result holds it), and dW / db
  // accumulate this shard's rows. Every rank calls with the same batch and options (X included).
  // Chunks and blocks are sized for the largest shard, so all ranks run the same ones; any
  // rank's should_stop stops every rank at the same chunk.
  const VocabShard* shard = nullptr;
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
};

struct FusedResult {
  double loss = 0.0;          // the reduced loss (not multiplied by upstream_scale)
  torch::Tensor grad_hidden;  // dX [N, D] in the head's dtype (a group: undefined off rank 0)
  StepStats stats;
};

struct BackwardResult {
  torch::Tensor grad_hidden;  // dX [N, D] in the head's dtype (a group: undefined off rank 0)
  StepStats stats;
};

struct ForwardResult {
  // reduction none: per-token outputs [N] fp32 (0 at ignored positions); otherwise a 0-d fp32.
  // Function "logits": [N, V] in options.logits_dtype; "sample": the drawn tokens' log-probs [N].
  torch::Tensor output;
  torch::Tensor token_ids;  // function "sample": the drawn tokens [N] int64
  StepStats stats;
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

}  // namespace remotehead::core
