// The options of one engine call (engine.h's FusedForwardBackward, Forward and Backward), apart
// from the engine so that the call's plan (call_plan.h) and the engine both read them without
// including each other.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "remotehead/core/call_mode.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/step_phases.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead::core {

// Used when neither chunk_rows nor memory_budget_bytes is given, on a CPU head.
inline constexpr int64_t kDefaultMemoryBudgetBytes = int64_t{96} << 20;
// …and on a CUDA head. A GPU runs a chunk's GEMMs efficiently only with hundreds of rows (at
// V = 256,000 this is ~500 rows of a bf16 head), and a kernel over a few rows costs its launch,
// not its bytes: the first GPU run, with the CPU's 96 MiB and cache-sized blocks, took 2.9 s for
// a step that takes 90 ms as naive full logits (N = 8192, D = 2304, V = 256,000).
inline constexpr int64_t kDefaultCudaMemoryBudgetBytes = int64_t{1} << 30;

// The rules a call's plan (call_plan.cc) sizes its chunks, blocks and gradient buffers by.
enum class PlanRules {
  kDevice,  // the head's device's own
  // A CUDA head's, on whatever device the head is: the CUDA default budget, blocks sized by the
  // budget alone, and the chunk's gradient written over its logits where dW accumulates the
  // gradient rounded to the logits' dtype (as cuBLAS's fp32-output GEMM reads it on a GPU).
  // What a CPU cannot do as a GPU does is still the CPU's: the GEMM library's workspace, and an
  // fp32 dW GEMM's upcast of that gradient. For the CPU's tests of the GPU's plan: engine parity,
  // the memory model and budget and row compaction run under both rules in CI.
  kCuda,
};
// Whether a call on a head on `device` plans by the CUDA rules.
inline bool UsesCudaRules(const torch::Device& device, PlanRules rules) {
  return device.is_cuda() || rules == PlanRules::kCuda;
}
// The default for a head on `device` under `rules`.
inline int64_t DefaultMemoryBudgetBytes(const torch::Device& device,
                                        PlanRules rules = PlanRules::kDevice) {
  return UsesCudaRules(device, rules) ? kDefaultCudaMemoryBudgetBytes : kDefaultMemoryBudgetBytes;
}
// fp32 logits per function block on a CPU head: small enough that the upcast copy, the
// function's temporaries and their gradients stay in the CPU's caches. A GPU's blocks are sized
// by the budget alone (call_plan.cc): there, fewer and larger kernels are what pays.
inline constexpr int64_t kFunctionBlockBytes = int64_t{2} << 20;
// …and at most this much of the block's whole working set (the logits, their gradient and the
// function's own buffers, CallPlan::block_row_bytes): a function with many buffers (a two-head
// divergence: both log-softmaxes, their exponentials, the teacher's logits) gets fewer rows,
// so that its passes over the block stay near the cache (measured: the reverse KL's fused step
// 9% faster at V = 32,000 than with the logits-only rule).
inline constexpr int64_t kFunctionBlockWorkingSetBytes = int64_t{8} << 20;

struct StepOptions {
  std::string function = "cross_entropy";
  FunctionParams params;  // function options, plus the common temperature / softcap
  Reduction reduction = Reduction::kMean;
  std::optional<double> normalizer;  // > 0; see the reduction table in engine.h
  int64_t ignore_index = -100;
  int64_t chunk_rows = 0;  // rows per chunk; 0 = derive from memory_budget_bytes
  // Rows per function block; 0 = cache-sized under a CPU's rules (kFunctionBlock*Bytes), a
  // quarter of the budget under CUDA's (plan_rules).
  int64_t block_rows = 0;
  // Transient bytes per chunk; 0 = DefaultMemoryBudgetBytes(device, plan_rules).
  int64_t memory_budget_bytes = 0;
  // The rules the call's chunks, blocks and gradient buffers are planned by (PlanRules).
  PlanRules plan_rules = PlanRules::kDevice;
  double upstream_scale = 1.0;  // fused mode: dL/d(loss), e.g. a loss scale
  // Per-token diagnostics to return row by row (the result's token_extras), in every mode:
  // names of the function's extras (TransformFunction::extras) that this call reports. Their
  // sums are in StepStats::extras whether asked or not.
  std::vector<std::string> token_extras;
  // Whether a call that accumulates dW computes StepStats::health (engine.h): asked for, since it
  // is a pass over the logits no other head makes (a server asks for it on every call: its
  // metrics show it). On a head group every rank must be given the same value (it adds a
  // collective per chunk).
  bool head_health = false;
  // Compute the blocks of a function with a fused kernel (TransformFunction::fused:
  // cross_entropy, token_logprobs without a sampler, entropy) on one server's head: one kernel
  // per chunk gives the rows' values, extras and health, and writes dL/dz over the chunk's
  // logits in their dtype — no autograd, no upcast copy, no separate fp32 gradient buffer, and
  // the chunk is the block (CallPlan::fused). dW then accumulates the gradient rounded to the
  // logits' dtype. Other functions, head groups and row-coupled calls keep the autograd path.
  // On a CPU head the kernel's CPU twin runs (core/src/fused/).
  bool fused_blocks = false;
  // The fused loss only as FusedResult::loss_value, on the head's device: FusedResult::loss
  // (a host number) is left 0, so the call does not wait for the device to finish. For a caller
  // that sums many calls and reads the total once (a server computing a request batch by batch).
  bool loss_on_device = false;
  // Told where each chunk's phases begin and end (step_phases.h); null: nothing is marked.
  StepPhaseRecorder* phases = nullptr;
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
  // When not null: the request's index of each of this call's rows ([rows] entries), which error
  // messages name instead of first_row + i — a server that dropped the rows that contribute
  // nothing (TransformFunction::ignored_rows_contribute_nothing) computes rows that are not
  // consecutive in the request.
  const std::vector<int64_t>* row_numbers = nullptr;
  // Function "logits" (a generation output): the dtype of the returned rows (floating).
  torch::ScalarType output_dtype = torch::kFloat;
  // The dtype the logits GEMM forms z = X·Wᵀ in, for every function (and a two-head function's
  // teacher alike). Unset: the head's dtype (a bf16 head's logits are rounded to bf16 before
  // the function upcasts them). float32: the GEMM writes fp32 logits from the head's bf16 /
  // fp16 operands, with no fp32 copy of W and no half-precision rounding (the gradients then
  // stay fp32 until dX is rounded once); on a float32 or float64 head it changes nothing. Any
  // other dtype is refused (call_plan.h, GemmLogitsDtype).
  std::optional<torch::ScalarType> logits_dtype;
  // Where `function` is looked up; null: FunctionRegistry::Builtin().
  const FunctionRegistry* registry = nullptr;
  // Set when the head is one shard of a head group (vocab_group.h): targets are global token
  // ids in [0, shard->vocab_size()), the function's vocabulary reductions are combined across
  // the group, dX is summed to rank 0 (the only rank whose result holds it), and dW / db
  // accumulate this shard's rows. Every rank calls with the same batch and options (X included).
  // Chunks and blocks are sized for the largest shard, so all ranks run the same ones; any
  // rank's should_stop stops every rank at the same chunk.
  const VocabShard* shard = nullptr;
  // A two-head (distillation) function's teacher (TransformFunction::needs_teacher): a head of
  // the same V (on a group: the teacher's shard of the same rows), read only — it gets no dW and
  // no dX. Its hidden states are TokenBatch::teacher_hidden.
  const Head* teacher = nullptr;
};

}  // namespace remotehead::core
