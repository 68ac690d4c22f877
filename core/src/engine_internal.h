// The engine's own shared declarations (private to core/src): a call's validated Plan and the
// chunk loops that engine.cc's entry points run. By concern:
//   engine_inputs.cc      every input checked against the head and the options; the Plan
//   engine_chunks.cc      the one chunk loop behind the three modes (GEMMs, function blocks,
//                         autograd, dX / dW), and a head group's collectives within it
//   engine_fp32_logits.cc the GEMMs of fp32 logits from a half-precision head's weights
//   engine_generation.cc  the generation outputs' loop: logits rows, drawn tokens
//   engine_coupled.cc     a row-coupled call: both passes and the loss over the whole call
//   engine.cc             the entry points (engine.h): exceptions to statuses, dX buffers
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/torch_api.h"
#include "vocab_ops.h"

namespace remotehead::core::engine_internal {

// Everything a call needs, decided and validated before the first chunk is computed.
struct Plan {
  CallPlan call;  // function, params, chunk sizes: the memory model's plan (call_plan.h)
  Reduction reduction = Reduction::kMean;
  int64_t rows = 0;        // N
  int64_t chunk_rows = 0;  // rows per GEMM chunk, never above max(N, 1)
  int64_t block_rows = 0;  // rows per function block, never above chunk_rows
  int64_t valid_tokens = 0;
  double denominator = 1.0;
  int64_t ignore_index = -100;
  std::function<bool()> should_stop;                  // StepOptions::should_stop
  bool head_health = true;                            // StepOptions::head_health
  StepPhaseRecorder* phases = nullptr;                // StepOptions::phases
  torch::Tensor logits_workspace;                     // StepOptions::logits_workspace
  int64_t first_row = 0;                              // StepOptions::first_row
  const std::vector<int64_t>* row_numbers = nullptr;  // StepOptions::row_numbers
  const VocabShard* shard = nullptr;                  // StepOptions::shard
  const Head* teacher = nullptr;                      // StepOptions::teacher (two-head functions)
  int64_t vocab_size = 0;                             // V of the whole head (all shards of a group)
  // The extras this call's function reports (its params and aux inputs), sorted: RunChunks
  // checks each block against them; and those returned per token (StepOptions::token_extras).
  std::vector<std::string> reported_extras;
  std::vector<std::string> token_extras;
  std::unique_ptr<VocabOps> vocab;  // the functions' vocabulary reductions (functions.h)

  const TransformFunction& fn() const { return *call.function; }
  // Whether this call's dX is summed here: always on one server, on rank 0 of a group.
  bool holds_grad_hidden() const { return shard == nullptr || shard->group->rank() == 0; }
  const FunctionParams& params() const { return call.params; }
  // How error messages name row i of this call: its index in the caller's request.
  int64_t RowNumber(int64_t i) const {
    return row_numbers != nullptr && i >= 0 && i < static_cast<int64_t>(row_numbers->size())
               ? (*row_numbers)[static_cast<size_t>(i)]
               : first_row + i;
  }
};

// Thrown between chunks when Plan::should_stop says so; StatusFromExceptions makes it CANCELLED.
struct StopRequested : std::exception {
  const char* what() const noexcept override { return "stop requested"; }
};

// --- engine_inputs.cc

bool IsFloating(torch::ScalarType t);
// "[2, 3]", or "no tensor" for an undefined one (error messages).
std::string ShapeOf(const torch::Tensor& t);

// First row of `t` ([N] or [N, D]) holding NaN or Inf, or -1 if all values are finite.
int64_t FirstNonFiniteRow(const torch::Tensor& t);

// Checks a per-token input: [N], on `device`, floating (or integral when `integral`); a bad row
// is named by plan.RowNumber.
absl::Status CheckPerToken(const torch::Tensor& t, const std::string& field, int64_t n,
                           const torch::Device& device, bool integral, const Plan& plan);

// Validates every input and fixes the chunk size and the reduction's denominator.
absl::StatusOr<Plan> MakePlan(const Head& head, const TokenBatch& batch, const StepOptions& options,
                              CallMode mode);

// --- engine_chunks.cc

// z = X_c·Wᵀ (+ b) in `out`'s dtype ([rows, V]): the head's own, or fp32 for a half-precision
// head with StepOptions::logits_dtype = float32 (GemmLogitsDtype; Fp32ChunkLogits). Logits in a
// half-precision dtype are upcast to fp32 by RunFunctionBlock block by block: the upcast keeps
// softmax and its gradient numerically sound; blocking keeps it affordable.
void ChunkLogits(const Head& head, const CallPlan& call, const torch::Tensor& x_chunk,
                 torch::Tensor& out);

// The common params on fp32 logits: logit scale (z ← z·s), softcap (z ← softcap·tanh(z /
// softcap)), then temperature.
torch::Tensor TransformLogits(torch::Tensor z, const FunctionParams& params);
// The same for a two-head function's teacher: its own scale and softcap, the shared temperature.
torch::Tensor TransformTeacherLogits(torch::Tensor z, const FunctionParams& params);

// dL/dy for the `rows` tokens from `start`, given their token weights (valid × weights).
using UpstreamFn =
    std::function<torch::Tensor(int64_t start, int64_t rows, const torch::Tensor& token_weights)>;

// The call's health sums so far (HeadHealth), 0-d fp64 tensors on the head's device: added to
// chunk by chunk with no host synchronisation, read once at the end.
struct HealthSums {
  torch::Tensor entropy, lse_sq, logit_max_sum, logit_max;
};

struct ChunkOutputs {
  torch::Tensor loss_sum;  // 0-d fp64: Σ w_i·y_i (before division by the denominator)
  std::map<std::string, torch::Tensor> extras;  // 0-d fp64 sums over valid tokens
  std::optional<HealthSums> health;             // with ChunkPass::health
  torch::Tensor per_token;                      // [N] when requested
  TokenExtras token_extras;                     // [N] each: Plan::token_extras
  int64_t num_chunks = 0;
};

// What a pass over the chunks computes besides the outputs, and where it writes them.
struct ChunkPass {
  const UpstreamFn* upstream = nullptr;  // dL/dy of each token; null: outputs only (Forward)
  GradientBuffers* grads = nullptr;      // dW / db += (with upstream; null: dX only)
  torch::Tensor grad_hidden;             // dX [N, D] written here (with upstream), if defined
  bool keep_per_token = false;           // fill ChunkOutputs::per_token
  bool health = false;                   // fill ChunkOutputs::health
};

// A pass that trains: dL/dy from `upstream`, dX into `grad_hidden`, dW into `grads`, and the
// head's health where the call trains (grads) and the plan asks for it.
inline ChunkPass TrainingPass(const Plan& plan, const UpstreamFn* upstream,
                              GradientBuffers* grads, const torch::Tensor& grad_hidden) {
  return {.upstream = upstream,
          .grads = grads,
          .grad_hidden = grad_hidden,
          .health = grads != nullptr && plan.head_health};
}

// --- engine_fp32_logits.cc (CallPlan::fp32_logits_of_half_head)

// z = X_c·Wᵀ (+ b) into the fp32 `out` from a half-precision head's X_c and W.
void Fp32ChunkLogits(const Head& head, const CallPlan& call, const torch::Tensor& x_chunk,
                     torch::Tensor& out);
// From the fp32 dz [rows, V]: dx = dz·W into the fp32 `dx` [rows, D] when defined, and
// dW += dzᵀ·X_c into `dw` (fp32 or the head's dtype) when defined.
void Fp32ChunkBackward(const Head& head, const CallPlan& call, const torch::Tensor& x_chunk,
                       const torch::Tensor& dz, const torch::Tensor& dx, const torch::Tensor& dw);

// --- engine_chunks.cc (continued)

// The [chunk_rows, V] buffers of one pass, allocated once (or taken from the caller's
// workspace): a fresh buffer per chunk would cost page faults.
struct ChunkBuffers {
  torch::Tensor logits;  // z in the GEMM's dtype (CallPlan::gemm_dtype)
  // dL/dz: for fp32 logits (an fp32 head's, or asked for by StepOptions::logits_dtype) the
  // logits buffer itself (each block's logits are dead once its gradient exists); otherwise a
  // separate fp32 buffer, so dW accumulates the unrounded gradient. Undefined without
  // gradients. A fused call's (CallPlan::fused) is the logits buffer, in its dtype.
  torch::Tensor grad;
  // A two-head function's teacher logits [chunk_rows, V] in its GEMM's dtype.
  torch::Tensor teacher_logits;
};

ChunkBuffers AllocateChunkBuffers(const Head& head, const Plan& plan, bool gradients);

// Whether the call stops before this chunk: its own should_stop, or on a group any rank's (one
// small collective per chunk, so that every rank stops at the same chunk).
bool StopBeforeChunk(const Plan& plan);

// The one chunk loop behind every mode. Two levels:
//  - a chunk of `chunk_rows` rows is what the three GEMMs see (large, so W and dW stream
//    through memory few times per step); its logits live in one [rows, V] buffer of the
//    GEMM's dtype, allocated once per call, which each block's gradient overwrites;
//  - a block of `block_rows` rows is what the function and autograd see (small, so the fp32
//    upcast and the function's temporaries stay in cache).
ChunkOutputs RunChunks(const Head& head, const TokenBatch& batch, const Plan& plan,
                       const ChunkPass& pass);

// The call's StepStats: the plan's sizes and denominator, the chunks run, the extras' sums.
StepStats MakeStats(const Plan& plan, const ChunkOutputs& outputs);

// A function reports exactly the extras its declaration says this call reports (ExtraSpec);
// a mismatch is a bug in its registry entry: std::logic_error (INTERNAL) naming both lists.
void CheckReportedExtras(const Plan& plan, const std::map<std::string, torch::Tensor>& extras);

// --- engine_coupled.cc: a row-coupled call (TransformFunction::couples_rows, Plan::call), in
// the three modes. Called by engine.cc once the plan, the gradient buffers and dX are checked.

FusedResult FusedCoupled(const Head& head, const TokenBatch& batch, const Plan& plan,
                         double upstream_scale, GradientBuffers* grads, torch::Tensor grad_hidden);
ForwardResult ForwardCoupled(const Head& head, const TokenBatch& batch, const Plan& plan);
// `grad_output`: [N] (reduction none, checked) or the scalar dL/dloss.
BackwardResult BackwardCoupled(const Head& head, const TokenBatch& batch, const Plan& plan,
                               const torch::Tensor& grad_output, GradientBuffers* grads,
                               torch::Tensor grad_hidden);

// --- engine_health.cc

// One block's per-row partials of the health from its transformed fp32 logits z ([rows, V] of
// the columns this process holds): [rows, 3] of (max_j z_j, Σ_j e_j, Σ_j e_j·(z_j − max)) with
// e_j = exp(z_j − max).
torch::Tensor HealthPartials(const torch::Tensor& z);
HealthSums ZeroHealthSums(const torch::TensorOptions& f64);
// Adds one chunk's valid rows (`valid` [rows] bool, undefined: all) to `sums` from their
// partials ([rows, 3]); on a head group first combined with every rank's in one all-gather
// (the same on every rank; a failed collective throws GroupFailure).
void AddChunkHealth(const Plan& plan, const torch::Tensor& partials, const torch::Tensor& valid,
                    HealthSums& sums);
HeadHealth ToHeadHealth(const HealthSums& sums, int64_t tokens);

// --- engine_generation.cc

// The generation outputs (OutputKind): per chunk z = X_c·Wᵀ (+ b), then per block the fp32
// upcast with softcap and temperature, copied out as the rows' logits (function "logits") or
// turned into a drawn token and its log-probability ("sample", sampling.h). No autograd.
absl::StatusOr<ForwardResult> RunGenerationChunks(const Head& head, const TokenBatch& batch,
                                                  const Plan& plan, torch::ScalarType output_dtype);

}  // namespace remotehead::core::engine_internal
