// The one chunk loop behind every mode (RunChunks, engine_internal.h): per chunk the logits
// GEMM, the function a block of rows at a time under autograd, then dX and dW; on a head group,
// the collectives that combine the shards.
#include <torch/version.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_internal.h"
#include "fused/fused_block.h"

namespace remotehead::core::engine_internal {
namespace {

// Whether this LibTorch's CUDA addmm takes half-precision inputs with an fp32 `self` and `out`
// (addmm.dtype_out, a cuBLAS GEMM with an fp32 C; in every LibTorch of the supported range,
// cmake/RemoteheadTorch.cmake). Its first releases wanted `self` in the inputs' dtype, so it is
// tried once, on a 2×2 product, before it is used.
bool CudaAddmmAccumulatesIntoFloat(const torch::Tensor& accumulator) {
  static const bool accepted = [options = accumulator.options()] {
    try {
      torch::Tensor acc = torch::ones({2, 2}, options.dtype(torch::kFloat));
      const torch::Tensor a = torch::ones({2, 3}, options.dtype(torch::kBFloat16));
      at::addmm_out(acc, acc, a, a.t(), torch::kFloat);
      return acc.eq(4).all().item<bool>();
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return accepted;
}

// dW += dzᵀ·X_c into the accumulator's dtype. `dz_logits`: the gradient in the functions' dtype,
// or the head's when the plan writes it over the logits (CallPlan::gradient_in_logits).
void AccumulateWeightGrad(torch::Tensor& dw, const torch::Tensor& dz_logits,
                          const torch::Tensor& dz_head, const torch::Tensor& x_chunk,
                          const CallPlan& call) {
  if (dw.scalar_type() == x_chunk.scalar_type()) {
    dw.addmm_(dz_head.t(), x_chunk);
  } else if (dw.is_cuda() && CudaAddmmAccumulatesIntoFloat(dw)) {
    // fp32 accumulators of a half-precision head on CUDA: the GEMM reads the head-dtype dz
    // and X_c on tensor cores and accumulates into dW in fp32 (no fp32 copy of anything).
    at::addmm_out(dw, dw, dz_head.t(), x_chunk, torch::kFloat);
  } else if (dz_logits.scalar_type() == dw.scalar_type()) {
    // fp32 accumulators of a half-precision head: the GEMM runs in fp32 on the unrounded
    // logits gradient, so each micro-batch adds its exact (to fp32) contribution.
    dw.addmm_(dz_logits.t(), x_chunk.to(dw.scalar_type()));
  } else {
    // …the gradient rounded to the head's dtype, with no GEMM of half-precision inputs into fp32
    // here: fp32 copies of its columns, CallPlan::gradient_slice_bytes at a time.
    const torch::Tensor x = x_chunk.to(dw.scalar_type());
    const int64_t vocab = dz_head.size(1);
    const int64_t columns = call.GradientSliceColumns(dz_head.size(0), vocab);
    for (int64_t v = 0; v < vocab; v += columns) {
      const int64_t n = std::min(columns, vocab - v);
      dw.narrow(0, v, n).addmm_(dz_head.narrow(1, v, n).to(dw.scalar_type()).t(), x);
    }
  }
}

// The per-token inputs of one chunk, prepared once per chunk and sliced per block.
struct ChunkTokens {
  torch::Tensor targets;        // [rows] int64, ignored positions replaced by 0; or undefined
  torch::Tensor valid;          // [rows] bool; undefined when every token is valid
  torch::Tensor token_weights;  // [rows] valid × weights, in the logits dtype
  AuxTensors aux;               // [rows] each, in the logits dtype

  ChunkTokens Slice(int64_t start, int64_t rows) const {
    ChunkTokens s;
    if (targets.defined()) s.targets = targets.narrow(0, start, rows);
    if (valid.defined()) s.valid = valid.narrow(0, start, rows);
    s.token_weights = token_weights.narrow(0, start, rows);
    for (const auto& [name, t] : aux) s.aux[name] = t.narrow(0, start, rows);
    return s;
  }
};

// `chunk`: the call's batch sliced to one chunk's rows.
ChunkTokens PrepareChunkTokens(const TokenBatch& chunk, const Plan& plan,
                               const torch::TensorOptions& logits_opts) {
  ChunkTokens tokens;
  if (chunk.targets.defined()) {
    const torch::Tensor t = chunk.targets.to(torch::kLong);
    tokens.valid = t != plan.ignore_index;
    tokens.targets = t.masked_fill(tokens.valid.logical_not(), 0);
    tokens.token_weights = tokens.valid.to(logits_opts.dtype());
  } else {
    tokens.token_weights = torch::ones({chunk.rows()}, logits_opts);
  }
  if (plan.reduction == Reduction::kWeightedSum) tokens.token_weights.mul_(chunk.weights);
  for (const auto& [name, tensor] : chunk.aux) {
    const AuxKind kind = plan.fn().aux_kind(name);
    const bool ids = kind == AuxKind::kTopkIds || kind == AuxKind::kPerTokenIds;
    tokens.aux[name] = tensor.to(ids ? torch::kLong : logits_opts.dtype().toScalarType());
  }
  return tokens;
}

struct BlockResult {
  torch::Tensor y;                              // [rows] per-token outputs (detached)
  std::map<std::string, torch::Tensor> extras;  // [rows] each (detached)
  torch::Tensor dz;                             // [rows, V] dL/dz when `dy` is given
  torch::Tensor health;                         // [rows, 3] HealthPartials, when asked
};

// Runs the function on one block of logits rows (`z_head`, the head's dtype) and, when `dy`
// (dL/dy of the block's tokens) is defined, differentiates it with autograd; with `health`, takes
// the health partials of the logits the function saw.
// `zt_head`: the teacher's logits rows of a two-head function (else undefined).
BlockResult RunFunctionBlock(const Plan& plan, const ChunkTokens& tokens,
                             const torch::Tensor& z_head, const torch::Tensor& zt_head,
                             const torch::Tensor& dy, torch::ScalarType logits_dtype,
                             bool health) {
  const bool want_grad = dy.defined();
  ChunkInputs in;
  in.params = &plan.params();
  in.vocab = plan.vocab.get();
  in.targets = tokens.targets;
  in.aux = tokens.aux;
  if (zt_head.defined()) {
    in.teacher_logits = TransformTeacherLogits(zt_head.to(logits_dtype), plan.params());
  }
  // A leaf of its own (for an fp32 head, a view of the chunk buffer: no copy).
  torch::Tensor z = z_head.to(logits_dtype).detach();
  if (want_grad) z.requires_grad_(true);
  BlockResult result;
  torch::Tensor y;
  {
    torch::AutoGradMode grad_mode(want_grad);
    in.logits = TransformLogits(z, plan.params());
    if (health) result.health = HealthPartials(in.logits.detach());
    // A row-coupled call's blocks compute its per-token values; the loss comes after all rows.
    FunctionOutput fo = plan.call.couples_rows ? FunctionOutput{plan.fn().per_token_value(in), {}}
                                               : plan.fn().forward(in);
    y = std::move(fo.per_token);
    result.extras = std::move(fo.extras);
  }
  in.logits.reset();  // only autograd's saved tensors keep block buffers alive now
  result.y = y.detach();
  if (want_grad) result.dz = torch::autograd::grad({y}, {z}, {dy})[0];
  return result;
}

// Adds Σ over valid tokens of `values` ([rows]) into the 0-d fp64 `sum`. Masked with where
// (not a multiply) so a non-finite value at an ignored position stays out.
void AddMaskedSum(const torch::Tensor& values, const ChunkTokens& tokens,
                  const torch::Tensor& weights, torch::Tensor& sum) {
  torch::Tensor v = tokens.valid.defined() ? torch::where(tokens.valid, values, 0.0) : values;
  v = v.to(torch::kDouble);
  if (weights.defined()) v = v * weights;
  sum += v.sum();
}

// The function's per-token values of one chunk.
struct ChunkValues {
  torch::Tensor y;                              // [rows]
  std::map<std::string, torch::Tensor> extras;  // [rows] each
  torch::Tensor health;                         // [rows, 3] when asked
};

// Runs the function over one chunk's logits `z`, one block at a time; with `dy` defined, writes
// dL/dz into `dz` ([rows, V], the logits dtype); with `health`, the rows' health partials.
// `zt`: the teacher's logits of the chunk (two-head functions; else undefined).
ChunkValues RunFunctionBlocks(const Plan& plan, const ChunkTokens& tokens, const torch::Tensor& z,
                              const torch::Tensor& zt, const torch::Tensor& dy, torch::Tensor& dz,
                              const torch::TensorOptions& logits_opts, bool health) {
  const int64_t rows = z.size(0);
  ChunkValues values;
  values.y = torch::empty({rows}, logits_opts);
  if (health) values.health = torch::empty({rows, 3}, logits_opts);
  for (int64_t b = 0; b < rows; b += plan.block_rows) {
    const int64_t block = std::min(plan.block_rows, rows - b);
    BlockResult r = RunFunctionBlock(plan, tokens.Slice(b, block), z.narrow(0, b, block),
                                     zt.defined() ? zt.narrow(0, b, block) : torch::Tensor(),
                                     dy.defined() ? dy.narrow(0, b, block) : torch::Tensor(),
                                     logits_opts.dtype().toScalarType(), health);
    values.y.narrow(0, b, block).copy_(r.y);
    if (health) values.health.narrow(0, b, block).copy_(r.health);
    for (auto& [name, extra] : r.extras) {
      auto [it, inserted] = values.extras.try_emplace(name, torch::Tensor());
      if (inserted) it->second = torch::empty({rows}, logits_opts);
      it->second.narrow(0, b, block).copy_(extra);
    }
    if (r.dz.defined()) dz.narrow(0, b, block).copy_(r.dz);
  }
  return values;
}

// RunFunctionBlocks for a fused call (CallPlan::fused): the whole chunk in one fused block, dL/dz
// written over `z` (the chunk's logits) when `dy` is defined.
ChunkValues RunFusedChunk(const Plan& plan, const ChunkTokens& tokens, const torch::Tensor& z,
                          const torch::Tensor& dy, bool health) {
  fused::BlockOutputs out = fused::RunBlock({.function = &plan.fn(),
                                             .params = &plan.params(),
                                             .vocab_size = plan.vocab_size,
                                             .logits = z,
                                             .targets = tokens.targets,
                                             .dy = dy.defined() ? dy.contiguous() : dy,
                                             .health = health});
  return {std::move(out.y), std::move(out.extras), std::move(out.health)};
}

// Per-token values with 0 at the ignored positions (where: a non-finite value there stays out).
torch::Tensor ValidOnly(const torch::Tensor& values, const ChunkTokens& tokens) {
  return tokens.valid.defined() ? torch::where(tokens.valid, values, 0.0) : values;
}


// A group's dX_c from this shard's `partial` dz_r·W_r ([rows, D], the logits dtype): summed over
// the ranks into rank 0's rows of `grad_hidden` from `start` (the other ranks hold no dX). When
// `partial` is not those rows already (a half-precision head), the sum is taken in fp32 and
// rounded once.
void SumGroupGradHidden(const Plan& plan, torch::Tensor& partial, int64_t start,
                        const torch::Tensor& grad_hidden) {
  const absl::Status reduced = plan.shard->group->ReduceSum(partial, /*root=*/0);
  if (!reduced.ok()) throw GroupFailure(reduced);
  if (!plan.holds_grad_hidden()) return;
  torch::Tensor rows = grad_hidden.narrow(0, start, partial.size(0));
  if (!rows.is_same(partial)) rows.copy_(partial);
}

// A group's dX_c: this shard's partial dz_r·W_r (written into rank 0's rows directly for an
// fp32 head), then SumGroupGradHidden.
void GroupGradHidden(const Head& head, const Plan& plan, const torch::Tensor& dz_head,
                     int64_t start, const torch::Tensor& grad_hidden) {
  torch::Tensor partial;
  if (head.dtype() == LogitsDtype(head) && plan.holds_grad_hidden()) {
    partial = grad_hidden.narrow(0, start, dz_head.size(0));
    torch::mm_out(partial, dz_head, head.weight());
  } else {
    partial = torch::mm(dz_head, head.weight()).to(LogitsDtype(head));
  }
  SumGroupGradHidden(plan, partial, start, grad_hidden);
}

// BackpropagateChunk for fp32 logits of a half-precision head: dX_c in fp32 from the fp32 dz
// (Fp32ChunkBackward), rounded once into dX (after a group's sum).
void BackpropagateFp32Chunk(const Head& head, const Plan& plan, const torch::Tensor& x_chunk,
                            const torch::Tensor& dz, int64_t start, const ChunkPass& pass) {
  torch::Tensor dx;
  if (plan.shard != nullptr || pass.grad_hidden.defined()) {
    dx =
        torch::empty({x_chunk.size(0), head.hidden_size()}, x_chunk.options().dtype(torch::kFloat));
  }
  Fp32ChunkBackward(head, plan.call, x_chunk, dz, dx,
                    pass.grads != nullptr ? pass.grads->weight : torch::Tensor());
  if (pass.grads != nullptr && pass.grads->bias.defined()) pass.grads->bias.add_(dz.sum(0));
  if (plan.shard != nullptr) {
    SumGroupGradHidden(plan, dx, start, pass.grad_hidden);
  } else if (dx.defined()) {
    pass.grad_hidden.narrow(0, start, x_chunk.size(0)).copy_(dx);
  }
}

// dX_c = dz·W into the pass's dX rows and dW += dzᵀ·X_c (db += Σ dz) for one chunk. `z` (the
// chunk's logits buffer, dead by now) holds dz rounded to the head's dtype when that is not
// the logits dtype (half-precision logits).
void BackpropagateChunk(const Head& head, const Plan& plan, const torch::Tensor& x_chunk,
                        torch::Tensor& z, const torch::Tensor& dz, int64_t start,
                        const ChunkPass& pass) {
  if (plan.call.fp32_logits_of_half_head) {
    // Its dX and dW GEMMs run slice by slice together: one phase.
    const PhaseScope phase(plan.phases, StepPhase::kDxGemm);
    BackpropagateFp32Chunk(head, plan, x_chunk, dz, start, pass);
    return;
  }
  torch::Tensor dz_head = dz;
  // Written over the logits buffer (CallPlan::gradient_in_logits), dz is already in the head's
  // dtype; else it is rounded into the (dead) logits buffer for the GEMMs.
  if (!plan.call.gradient_in_logits) dz_head = z.copy_(dz);
  {
    const PhaseScope phase(plan.phases, StepPhase::kDxGemm);
    if (plan.shard != nullptr) {
      GroupGradHidden(head, plan, dz_head, start, pass.grad_hidden);
    } else if (pass.grad_hidden.defined()) {
      torch::Tensor dx_chunk = pass.grad_hidden.narrow(0, start, x_chunk.size(0));
      torch::mm_out(dx_chunk, dz_head, head.weight());
    }
  }
  if (pass.grads != nullptr) {
    const PhaseScope phase(plan.phases, StepPhase::kDwGemm);
    AccumulateWeightGrad(pass.grads->weight, dz, dz_head, x_chunk, plan.call);
    // Summed in the bias's dtype: a fused call's dz is half-precision.
    if (pass.grads->bias.defined()) {
      pass.grads->bias.add_(dz.sum(0, /*keepdim=*/false, pass.grads->bias.scalar_type()));
    }
  }
}

}  // namespace

// A function reports exactly the extras its declaration says this call reports (ExtraSpec):
// what ListFunctions tells clients and what StepOptions::token_extras is checked against. A
// mismatch is a bug in the function's entry, reported as INTERNAL naming both lists.
void CheckReportedExtras(const Plan& plan, const std::map<std::string, torch::Tensor>& extras) {
  std::vector<std::string> got;
  for (const auto& [name, extra] : extras) got.push_back(name);  // a map: sorted
  if (got != plan.reported_extras) {
    throw std::logic_error(absl::StrCat("function ", plan.fn().name, " reported the extras [",
                                        absl::StrJoin(got, ", "), "]; its declaration says [",
                                        absl::StrJoin(plan.reported_extras, ", "), "]"));
  }
}

void ChunkLogits(const Head& head, const CallPlan& call, const torch::Tensor& x_chunk,
                 torch::Tensor& out) {
  if (out.scalar_type() != head.dtype()) {
    Fp32ChunkLogits(head, call, x_chunk, out);
  } else if (head.has_bias()) {
    torch::addmm_out(out, head.bias(), x_chunk, head.weight().t());
  } else {
    torch::mm_out(out, x_chunk, head.weight().t());
  }
}

namespace {

torch::Tensor ScaleCapAndTemper(torch::Tensor z, double scale, double cap, double temperature) {
  if (scale != 1.0) z = z * scale;
  if (cap > 0) z = torch::tanh(z / cap) * cap;
  if (temperature != 1.0) z = z / temperature;
  return z;
}

}  // namespace

torch::Tensor TransformLogits(torch::Tensor z, const FunctionParams& params) {
  return ScaleCapAndTemper(std::move(z), params.at(kLogitScaleParam), params.at(kSoftcapParam),
                           params.at(kTemperatureParam));
}

torch::Tensor TransformTeacherLogits(torch::Tensor z, const FunctionParams& params) {
  torch::NoGradGuard no_grad;  // the teacher is a constant
  return ScaleCapAndTemper(std::move(z), params.at(kTeacherLogitScaleParam),
                           params.at(kTeacherSoftcapParam), params.at(kTemperatureParam));
}

ChunkBuffers AllocateChunkBuffers(const Head& head, const Plan& plan, bool gradients) {
  const torch::Tensor& w = plan.logits_workspace;
  const torch::ScalarType dtype = plan.call.gemm_dtype;
  ChunkBuffers buffers;
  buffers.logits = w.defined() && w.dim() == 2 && w.size(0) >= plan.chunk_rows &&
                           w.size(1) == head.vocab_size() && w.is_contiguous() &&
                           w.scalar_type() == dtype && w.device() == head.device()
                       ? w.narrow(0, 0, plan.chunk_rows)
                       : torch::empty({plan.chunk_rows, head.vocab_size()},
                                      head.weight().options().dtype(dtype));
  if (gradients) {
    buffers.grad = plan.call.gradient_in_logits
                       ? buffers.logits
                       : torch::empty(buffers.logits.sizes(),
                                      buffers.logits.options().dtype(LogitsDtype(head)));
  }
  if (plan.teacher != nullptr) {
    buffers.teacher_logits = torch::empty({plan.chunk_rows, plan.teacher->vocab_size()},
                                          plan.teacher->weight().options().dtype(GemmLogitsDtype(
                                              plan.teacher->dtype(), plan.call.logits_dtype)));
  }
  return buffers;
}

bool StopBeforeChunk(const Plan& plan) {
  const bool mine = plan.should_stop && plan.should_stop();
  if (plan.shard == nullptr) return mine;
  absl::StatusOr<torch::Tensor> all =
      plan.shard->group->AllGather(torch::full({1}, mine ? 1 : 0, torch::kInt));
  if (!all.ok()) throw GroupFailure(std::move(all).status());
  return all->any().item<bool>();
}

ChunkOutputs RunChunks(const Head& head, const TokenBatch& batch, const Plan& plan,
                       const ChunkPass& pass) {
  torch::NoGradGuard no_grad;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(head.device());
  const auto logits_opts = f64.dtype(LogitsDtype(head));
  const bool weighted = plan.reduction == Reduction::kWeightedSum;
  ChunkOutputs out;
  out.loss_sum = torch::zeros({}, f64);
  if (pass.keep_per_token) out.per_token = torch::zeros({plan.rows}, logits_opts);
  // A row-coupled call's extras come from its coupled forward (engine_coupled.cc), not the blocks.
  const std::vector<std::string> no_extras;
  const std::vector<std::string>& token_extras =
      plan.call.couples_rows ? no_extras : plan.token_extras;
  for (const std::string& name : token_extras) {
    out.token_extras[name] = torch::zeros({plan.rows}, logits_opts);
  }
  if (pass.health) out.health = ZeroHealthSums(f64);
  if (plan.rows == 0) return out;

  const ChunkBuffers buffers = AllocateChunkBuffers(head, plan, pass.upstream != nullptr);
  for (int64_t start = 0; start < plan.rows; start += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, plan.rows - start);
    if (StopBeforeChunk(plan)) throw StopRequested();
    ++out.num_chunks;
    const TokenBatch chunk = batch.Slice(start, rows);
    torch::Tensor z = buffers.logits.narrow(0, 0, rows);
    torch::Tensor zt;
    {
      const PhaseScope phase(plan.phases, StepPhase::kLogitsGemm);
      ChunkLogits(head, plan.call, chunk.hidden, z);
      if (plan.teacher != nullptr) {
        zt = buffers.teacher_logits.narrow(0, 0, rows);
        ChunkLogits(*plan.teacher, plan.call, chunk.teacher_hidden, zt);
      }
    }
    const ChunkTokens tokens = PrepareChunkTokens(chunk, plan, logits_opts);
    torch::Tensor dy;  // [rows] dL/dy
    if (pass.upstream != nullptr) dy = (*pass.upstream)(start, rows, tokens.token_weights);
    torch::Tensor dz = dy.defined() ? buffers.grad.narrow(0, 0, rows) : torch::Tensor();

    ChunkValues values;
    {
      const PhaseScope phase(plan.phases, StepPhase::kFunction);
      values = plan.call.fused
                   ? RunFusedChunk(plan, tokens, z, dy, pass.health)
                   : RunFunctionBlocks(plan, tokens, z, zt, dy, dz, logits_opts, pass.health);
    }
    if (!plan.call.couples_rows) CheckReportedExtras(plan, values.extras);
    if (pass.health) AddChunkHealth(plan, values.health, tokens.valid, *out.health);
    AddMaskedSum(values.y, tokens, weighted ? chunk.weights : torch::Tensor(), out.loss_sum);
    for (const auto& [name, extra] : values.extras) {
      auto [it, inserted] = out.extras.try_emplace(name, torch::zeros({}, f64));
      AddMaskedSum(extra, tokens, {}, it->second);
    }
    if (pass.keep_per_token)
      out.per_token.narrow(0, start, rows).copy_(ValidOnly(values.y, tokens));
    for (const std::string& name : token_extras) {
      out.token_extras[name]
          .narrow(0, start, rows)
          .copy_(ValidOnly(values.extras.at(name), tokens));
    }
    if (dy.defined()) BackpropagateChunk(head, plan, chunk.hidden, z, dz, start, pass);
  }
  return out;
}

StepStats MakeStats(const Plan& plan, const ChunkOutputs& outputs) {
  const PhaseScope sync(plan.phases, StepPhase::kHostSync);
  StepStats stats;
  stats.valid_tokens = plan.valid_tokens;
  stats.denominator = plan.denominator;
  stats.chunk_rows = plan.chunk_rows;
  stats.block_rows = plan.block_rows;
  stats.num_chunks = outputs.num_chunks;
  for (const auto& [name, sum] : outputs.extras) stats.extras[name] = sum.item<double>();
  if (outputs.health.has_value()) stats.health = ToHeadHealth(*outputs.health, plan.valid_tokens);
  return stats;
}

}  // namespace remotehead::core::engine_internal
