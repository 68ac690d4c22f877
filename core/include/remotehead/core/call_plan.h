// What one engine call will do and hold, decided from the head and the options before any data
// is looked at: the function with its complete parameters, the chunk and block sizes, and the
// memory the call allocates. This is the engine's memory model, in one place: the engine sizes
// its buffers from it and a server admits requests by it, so the two cannot disagree.
// tests/core/memory_model_test.cc checks it against the counting allocator's measured peak for
// every function, mode and dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/head.h"
#include "remotehead/core/step_options.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// The dtype the functions see: fp32, or fp64 for a float64 (verification) head.
torch::ScalarType LogitsDtype(const Head& head);

// The dtype the logits GEMM writes a chunk's logits z = X·Wᵀ in, for a head of `head_dtype` and
// a call's StepOptions::logits_dtype (checked by PlanCall): float32 for a bfloat16 / float16
// head asked for float32 (fp32 logits from half-precision operands), else the head's own dtype
// (float32 asked of a float32 or float64 head changes nothing).
torch::ScalarType GemmLogitsDtype(torch::ScalarType head_dtype,
                                  std::optional<torch::ScalarType> logits_dtype);

// Bytes one call allocates at its peak, beyond its inputs (X, targets, …) and the gradient
// accumulators it adds into.
struct CallMemory {
  int64_t logits_bytes = 0;  // the [chunk rows, V] logits buffer (+ its fp32 gradient and the
                             // fp32 GEMM operands of a half-precision head, and the fp32 slices
                             // of W that fp32 logits of a half head are formed from, or of the
                             // gradient a CPU's dW GEMM reads)
  int64_t block_bytes = 0;   // one function block: fp32 logits, their gradient, what the
                             // function and the logit transforms keep for autograd (or the
                             // backward's slices of the gradient, made after the blocks)
  int64_t token_bytes = 0;   // O(N) bookkeeping: masks, per-token values, row checks
  int64_t output_bytes = 0;  // what the call returns: dX [N, D], per-token outputs [N] (or the
                             // generation outputs' rows: [N, V] logits, [N] ids and log-probs),
                             // and the token extras asked for ([N] each)
  int64_t gemm_bytes = 0;    // the GEMM library's own workspace (see GemmWorkspace)
  int64_t total() const {
    return logits_bytes + block_bytes + token_bytes + output_bytes + gemm_bytes;
  }
  std::string Breakdown() const;  // "logits 4 MiB + block 2 MiB + tokens 0.1 MiB + output 1 MiB"
};

// The workspace the GEMM library allocates through the device allocator during the dX GEMM
// (dz[M, V]·W[V, D]): per chunk row and fixed per call. Zero where the library takes none
// (cuBLAS keeps one fixed workspace per handle, allocated once; MKL's fp32 GEMMs take none).
struct GemmWorkspace {
  double row_bytes = 0;
  int64_t fixed_bytes = 0;
  int64_t BytesFor(int64_t chunk_rows) const {
    return fixed_bytes + static_cast<int64_t>(std::ceil(row_bytes * chunk_rows));
  }
};

// fp32 [rows, V] buffers the head's health (StepStats::health) keeps alive at a block's peak.
inline constexpr double kHealthWorkspaceBuffers = 2.0;

struct CallPlan {
  const TransformFunction* function = nullptr;
  FunctionParams params;   // complete: defaults filled in, ranges checked
  int64_t chunk_rows = 0;  // rows per GEMM chunk (a call of fewer rows uses one chunk of them)
  int64_t block_rows = 0;  // rows the function and autograd see at once, <= chunk_rows
  // The function couples the call's rows for these params (TransformFunction::couples_rows):
  // the engine runs two passes over all of them, and a server gives it the call in one batch.
  bool couples_rows = false;
  // StepOptions::fused_blocks asked for it and the fused kernel covers the call: the block is the
  // whole chunk and the gradient is written over the chunk's logits (no fp32 gradient buffer).
  bool fused = false;
  // dL/dz is written over the chunk's logits buffer, in its dtype, with no buffer of its own: an
  // fp32 (or fp64) head's logits are already the functions' dtype; a fused call writes it there;
  // and where dW accumulates the gradient rounded to the head's dtype anyway — CUDA's rules (a
  // GEMM of half-precision inputs into fp32 dW), or a head whose dW is kept in its own dtype.
  // Otherwise (a half-precision head under a CPU's rules) the gradient has an fp32 buffer and dW
  // accumulates it unrounded.
  bool gradient_in_logits = false;
  // gradient_in_logits on a CPU head of half precision with fp32 accumulators: the CPU has no
  // GEMM of half-precision inputs into fp32, so the dW GEMM reads fp32 copies of the gradient's
  // columns, at most this many bytes of them at a time; with split_gradient, the temporaries of
  // the split's slice. 0 otherwise.
  int64_t gradient_slice_bytes = 0;
  // Bytes per logit of such a slice: the fp32 copy (4); the split's hi and lo, and on a CPU the
  // fp32 temporary of their sum (8).
  int64_t GradientSliceBytesPerLogit() const { return split_gradient ? 8 : 4; }
  // Columns of such a slice for a chunk of `rows` rows: at least 1, at most `vocab` (all of them
  // when gradient_slice_bytes is 0).
  int64_t GradientSliceColumns(int64_t rows, int64_t vocab) const;

  // The memory of a call on `rows` rows in `mode` that allocates its own dX (the server's case).
  CallMemory Memory(int64_t rows, CallMode mode) const;
  // Rows per chunk and per block of a call on `rows` rows.
  int64_t ChunkRowsFor(int64_t rows) const;
  int64_t BlockRowsFor(int64_t rows) const;

  // Per-row costs of the head and options (bytes); set by PlanCall.
  int64_t vocab_size = 0;  // logits columns planned for: V, or a head group's largest shard
  int64_t hidden_size = 0;
  int64_t head_elem_bytes = 0;    // the head's dtype
  int64_t logits_elem_bytes = 0;  // what the function sees: fp32 (fp64 for a float64 head)
  double chunk_row_bytes = 0;     // logits row (+ gradient row and fp32 operands), gradient calls
  double chunk_row_bytes_forward = 0;  // the same without gradients
  double block_row_bytes = 0;          // one function-block row
  int64_t output_row_bytes = 0;        // what a Forward returns per row: a per-token value, a
                                       // row of logits (function logits), id + log-prob (sample)
  int64_t token_extra_row_bytes = 0;   // the StepOptions::token_extras of a row, any mode
  GemmWorkspace gemm;                  // the dX GEMM's library workspace, gradient calls
  // StepOptions::logits_dtype (checked) and what it makes of this head: the dtype of the chunk
  // logits buffer (GemmLogitsDtype), and whether that is an fp32 buffer formed from a half-
  // precision head's operands (then X_c·Wᵀ, dz·W and dzᵀ·X_c run on fp32 slices of W where the
  // device has no half-precision GEMM with an fp32 output: engine_fp32_logits.cc).
  std::optional<torch::ScalarType> logits_dtype;
  torch::ScalarType gemm_dtype = torch::kFloat;
  bool fp32_logits_of_half_head = false;
  // fp32_logits_of_half_head under CUDA's rules: the backward's GEMMs read the fp32 dz as two
  // terms in the head's dtype, hi = dz rounded and lo = (dz − hi) rounded — 16 of fp32's 24
  // significant bits (a relative error ≤ 2⁻¹⁶ per element) — so that they run as half-precision
  // GEMMs into fp32 (cuBLAS, tensor cores) rather than as fp32 GEMMs. A CPU (no such GEMM) sums
  // the two terms back into dz, and runs its fp32 GEMMs on that: what a GPU computes, up to the
  // order of summation. Both work a slice of dz's columns at a time (gradient_slice_bytes).
  bool split_gradient = false;
  // fp32_logits_of_half_head (or a half-precision teacher's fp32 logits): the bytes of the one
  // fp32 slice of W rows (WeightSliceRows) a GEMM holds at a time. 0 otherwise.
  int64_t weight_slice_bytes = 0;
  // Rows of a W of `hidden` columns in one such slice: at least 1, at most `vocab`.
  int64_t WeightSliceRows(int64_t vocab, int64_t hidden) const;
};

// Whether `mode` and `reduction` can compute the plan's function: a generation output (function
// "logits" or "sample") only in a Forward with reduction none. INVALID_ARGUMENT naming the field.
absl::Status CheckCallMode(const CallPlan& plan, CallMode mode, Reduction reduction);

// Resolves the function and its params and fixes the chunk sizes: options.chunk_rows as given,
// or the largest that fits options.memory_budget_bytes together with one function block, by
// options.plan_rules.
// INVALID_ARGUMENT naming the field for an unknown function, a bad param or chunk option, or a
// budget too small for one row.
absl::StatusOr<CallPlan> PlanCall(const Head& head, const StepOptions& options);

// A logits buffer a caller can keep across calls that use `plan` (StepOptions::logits_workspace):
// [min(chunk_rows, max_rows), V] in the plan's gemm_dtype on the head's device.
torch::Tensor NewLogitsWorkspace(const Head& head, const CallPlan& plan, int64_t max_rows);

}  // namespace remotehead::core
