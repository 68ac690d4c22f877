#include "remotehead/core/engine.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/sampling.h"
#include "remotehead/core/status_macros.h"
#include "vocab_ops.h"

namespace remotehead::core {
namespace {

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
  std::function<bool()> should_stop;  // StepOptions::should_stop
  torch::Tensor logits_workspace;     // StepOptions::logits_workspace
  int64_t first_row = 0;              // StepOptions::first_row
  const VocabShard* shard = nullptr;  // StepOptions::shard
  int64_t vocab_size = 0;             // V of the whole head (all shards of a group)
  std::unique_ptr<VocabOps> vocab;    // the functions' vocabulary reductions (functions.h)

  const TransformFunction& fn() const { return *call.function; }
  // Whether this call's dX is summed here: always on one server, on rank 0 of a group.
  bool holds_grad_hidden() const { return shard == nullptr || shard->group->rank() == 0; }
  const FunctionParams& params() const { return call.params; }
};

// Thrown between chunks when Plan::should_stop says so; StatusFromExceptions makes it CANCELLED.
struct StopRequested : std::exception {
  const char* what() const noexcept override { return "stop requested"; }
};

bool IsFloating(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kDouble || t == torch::kBFloat16 || t == torch::kHalf;
}

std::string ShapeOf(const torch::Tensor& t) {
  return t.defined() ? c10::str(t.sizes()) : std::string("no tensor");
}

// First row of `t` ([N] or [N, D]) holding NaN or Inf, or -1 if all values are finite.
int64_t FirstNonFiniteRow(const torch::Tensor& t) {
  const torch::Tensor bad = torch::isfinite(t).logical_not();
  const torch::Tensor rows = t.dim() == 1 ? bad : bad.any(1);
  if (!rows.any().item<bool>()) return -1;
  return rows.nonzero()[0][0].item<int64_t>();
}

// Checks a per-token input: [N], on `device`, floating (or integral when `integral`).
absl::Status CheckPerToken(const torch::Tensor& t, const std::string& field, int64_t n,
                           const torch::Device& device, bool integral, int64_t first_row) {
  if (t.dim() != 1 || t.size(0) != n) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected shape [", n,
                                                   "] (one per row of hidden); got ", ShapeOf(t)));
  }
  if (t.device() != device) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected device ", device.str(), "; got ", t.device().str()));
  }
  const torch::ScalarType dt = t.scalar_type();
  if (integral ? (dt != torch::kLong && dt != torch::kInt) : !IsFloating(dt)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected dtype ",
                                                   integral ? "int64 or int32" : "a floating dtype",
                                                   "; got ", DtypeName(dt)));
  }
  if (!integral) {
    const int64_t bad = FirstNonFiniteRow(t);
    if (bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", first_row + bad, "]: expected a finite value; got ", t[bad].item<double>()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTargets(const Head& head, const TokenBatch& batch, const Plan& plan) {
  RETURN_IF_ERROR(
      CheckPerToken(batch.targets, "targets", plan.rows, head.device(), true, plan.first_row));
  const torch::Tensor t = batch.targets;
  const torch::Tensor bad =
      (t != plan.ignore_index).logical_and((t < 0).logical_or(t >= plan.vocab_size));
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero()[0][0].item<int64_t>();
    return absl::InvalidArgumentError(absl::StrCat(
        "targets[", plan.first_row + i, "]: expected a token id in [0, ", plan.vocab_size,
        ") or ignore_index (", plan.ignore_index, "); got ", t[i].item<int64_t>()));
  }
  return absl::OkStatus();
}

absl::Status CheckAux(const Head& head, const TokenBatch& batch, const Plan& plan) {
  const TransformFunction& fn = plan.fn();
  for (const auto& [name, tensor] : batch.aux) {
    const bool known = std::count(fn.required_aux.begin(), fn.required_aux.end(), name) +
                           std::count(fn.optional_aux.begin(), fn.optional_aux.end(), name) >
                       0;
    if (!known) {
      std::vector<std::string> accepted = fn.required_aux;
      accepted.insert(accepted.end(), fn.optional_aux.begin(), fn.optional_aux.end());
      return absl::InvalidArgumentError(
          absl::StrCat("aux[\"", name, "\"]: function ", fn.name, " accepts ",
                       accepted.empty() ? std::string("no per-token inputs")
                                        : absl::StrCat("only ", absl::StrJoin(accepted, ", "))));
    }
    RETURN_IF_ERROR(CheckPerToken(tensor, absl::StrCat("aux[\"", name, "\"]"), plan.rows,
                                  head.device(), false, plan.first_row));
  }
  for (const std::string& name : fn.required_aux) {
    if (!batch.aux.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("aux[\"", name, "\"]: function ", fn.name,
                                                     " needs this per-token input; got none"));
    }
  }
  if (fn.validate) RETURN_IF_ERROR(fn.validate(plan.params(), batch.aux));
  return absl::OkStatus();
}

absl::Status CheckHidden(const Head& head, const TokenBatch& batch) {
  const torch::Tensor& x = batch.hidden;
  if (!x.defined() || x.dim() != 2 || x.size(1) != head.hidden_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: expected shape [N, ", head.hidden_size(), "]; got ", ShapeOf(x)));
  }
  if (x.scalar_type() != head.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("hidden.dtype: expected ",
                                                   DtypeName(head.dtype()), " (the head's); got ",
                                                   DtypeName(x.scalar_type())));
  }
  if (x.device() != head.device()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: expected device ", head.device().str(), "; got ", x.device().str()));
  }
  return absl::OkStatus();
}

// Row-chunked so that the check's own memory stays within one chunk.
absl::Status CheckHiddenFinite(const torch::Tensor& x, int64_t chunk_rows, int64_t first_row) {
  torch::NoGradGuard no_grad;
  for (int64_t start = 0; start < x.size(0); start += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, x.size(0) - start);
    const int64_t bad = FirstNonFiniteRow(x.narrow(0, start, rows));
    if (bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("hidden[", first_row + start + bad,
                                                     "]: expected finite values; got NaN or Inf"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckGradientBuffers(const Head& head, const GradientBuffers* grads) {
  if (grads == nullptr) return absl::OkStatus();
  const torch::Tensor& w = grads->weight;
  if (!w.defined() || w.sizes() != head.weight().sizes() || w.device() != head.device() ||
      (w.scalar_type() != torch::kFloat && w.scalar_type() != head.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grads.weight: expected ", c10::str(head.weight().sizes()), " float32 or ",
        DtypeName(head.dtype()), " on ", head.device().str(), "; got ", ShapeOf(w),
        w.defined() ? absl::StrCat(" ", DtypeName(w.scalar_type()), " on ", w.device().str())
                    : ""));
  }
  if (head.has_bias() != grads->bias.defined() ||
      (head.has_bias() &&
       (grads->bias.sizes() != head.bias().sizes() || grads->bias.device() != head.device()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grads.bias: expected ", head.has_bias() ? c10::str(head.bias().sizes()) : "none", "; got ",
        ShapeOf(grads->bias)));
  }
  return absl::OkStatus();
}

absl::Status CheckGradHiddenOut(const Head& head, const Plan& plan, const torch::Tensor& out) {
  if (!out.defined()) return absl::OkStatus();
  if (out.dim() != 2 || out.size(0) != plan.rows || out.size(1) != head.hidden_size() ||
      out.scalar_type() != head.dtype() || out.device() != head.device() || !out.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_hidden_out: expected a contiguous [", plan.rows, ", ", head.hidden_size(), "] ",
        DtypeName(head.dtype()), " tensor on ", head.device().str(), "; got ", ShapeOf(out)));
  }
  return absl::OkStatus();
}

// Checks the per-token inputs against the head and the function: targets, weights and aux.
absl::Status CheckTokenInputs(const Head& head, const TokenBatch& batch, const StepOptions& options,
                              const Plan& plan) {
  if (batch.targets.defined() && plan.fn().output != OutputKind::kPerToken) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets: function ", plan.fn().name,
        " takes none (it is computed from hidden alone); got ", ShapeOf(batch.targets)));
  }
  if (batch.targets.defined()) {
    RETURN_IF_ERROR(CheckTargets(head, batch, plan));
  } else if (plan.fn().needs_targets) {
    return absl::InvalidArgumentError(absl::StrCat("targets: function ", plan.fn().name,
                                                   " needs per-token targets [", plan.rows,
                                                   "]; got none"));
  }
  if (options.reduction == Reduction::kWeightedSum) {
    if (!batch.weights.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weights: reduction weighted_sum needs per-token weights [", plan.rows, "]; got none"));
    }
    RETURN_IF_ERROR(
        CheckPerToken(batch.weights, "weights", plan.rows, head.device(), false, plan.first_row));
  } else if (batch.weights.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights: only used by reduction weighted_sum; got weights with reduction ",
                     std::string(ReductionName(options.reduction))));
  }
  return CheckAux(head, batch, plan);
}

absl::Status CheckScalarOptions(const StepOptions& options) {
  if (options.normalizer.has_value() &&
      (!std::isfinite(*options.normalizer) || *options.normalizer <= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalizer: expected a finite value > 0; got ", *options.normalizer));
  }
  if (!std::isfinite(options.upstream_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("upstream_scale: expected a finite value; got ", options.upstream_scale));
  }
  return absl::OkStatus();
}

// Validates every input and fixes the chunk size and the reduction's denominator.
absl::StatusOr<Plan> MakePlan(const Head& head, const TokenBatch& batch, const StepOptions& options,
                              CallMode mode) {
  Plan plan;
  if (options.shard != nullptr) RETURN_IF_ERROR(CheckVocabShard(*options.shard, head.vocab_size()));
  ASSIGN_OR_RETURN(plan.call, PlanCall(head, options));
  RETURN_IF_ERROR(CheckCallMode(plan.call, mode, options.reduction));
  plan.shard = options.shard;
  plan.vocab_size = options.shard != nullptr ? options.shard->vocab_size() : head.vocab_size();
  if (options.shard != nullptr && options.shard->ranges.size() > 1) {
    plan.vocab = std::make_unique<ShardVocabOps>(*options.shard);
  } else {
    plan.vocab = std::make_unique<LocalVocabOps>(head.vocab_size());
  }
  plan.reduction = options.reduction;
  plan.should_stop = options.should_stop;
  plan.logits_workspace = options.logits_workspace;
  plan.first_row = options.first_row;
  plan.ignore_index = options.ignore_index;
  RETURN_IF_ERROR(CheckHidden(head, batch));
  plan.rows = batch.rows();

  torch::NoGradGuard no_grad;
  RETURN_IF_ERROR(CheckTokenInputs(head, batch, options, plan));
  RETURN_IF_ERROR(CheckScalarOptions(options));
  plan.chunk_rows = plan.call.ChunkRowsFor(plan.rows);
  plan.block_rows = plan.call.BlockRowsFor(plan.rows);
  RETURN_IF_ERROR(CheckHiddenFinite(batch.hidden, plan.chunk_rows, plan.first_row));

  plan.valid_tokens = CountValidTokens(batch.targets, options.ignore_index, plan.rows);
  if (options.normalizer.has_value()) {
    plan.denominator = *options.normalizer;
  } else if (options.reduction == Reduction::kMean) {
    plan.denominator = std::max<int64_t>(plan.valid_tokens, 1);  // Σ over 0 tokens is 0
  }
  return plan;
}

// z = X_c·Wᵀ (+ b) in the head's dtype, written into `out` ([rows, V]). RunFunctionBlock
// upcasts it to fp32 block by block: the upcast keeps softmax and its gradient numerically
// sound; blocking keeps it affordable.
void ChunkLogits(const Head& head, const torch::Tensor& x_chunk, torch::Tensor& out) {
  if (head.has_bias()) {
    torch::addmm_out(out, head.bias(), x_chunk, head.weight().t());
  } else {
    torch::mm_out(out, x_chunk, head.weight().t());
  }
}

torch::Tensor TransformLogits(torch::Tensor z, const FunctionParams& params) {
  const double cap = params.at(kSoftcapParam);
  if (cap > 0) z = torch::tanh(z / cap) * cap;
  const double temperature = params.at(kTemperatureParam);
  if (temperature != 1.0) z = z / temperature;
  return z;
}

// addmm.dtype_out (half-precision inputs, fp32 output) is in LibTorch from 2.8.
#define REMOTEHEAD_HAS_ADDMM_OUT_DTYPE \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8))

// Whether this LibTorch's CUDA addmm takes half-precision inputs with an fp32 `self` and `out`
// (addmm.dtype_out, a cuBLAS GEMM with an fp32 C). Its first releases wanted `self` in the
// inputs' dtype, so it is tried once, on a 2×2 product, before it is used.
bool CudaAddmmAccumulatesIntoFloat(const torch::Tensor& accumulator) {
#if REMOTEHEAD_HAS_ADDMM_OUT_DTYPE
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
#else
  (void)accumulator;
  return false;
#endif
}

// dW += dzᵀ·X_c into the accumulator's dtype.
void AccumulateWeightGrad(torch::Tensor& dw, const torch::Tensor& dz_logits,
                          const torch::Tensor& dz_head, const torch::Tensor& x_chunk) {
  if (dw.scalar_type() == x_chunk.scalar_type()) {
    dw.addmm_(dz_head.t(), x_chunk);
#if REMOTEHEAD_HAS_ADDMM_OUT_DTYPE
  } else if (dw.is_cuda() && CudaAddmmAccumulatesIntoFloat(dw)) {
    // fp32 accumulators of a half-precision head on CUDA: the GEMM reads the head-dtype dz
    // and X_c on tensor cores and accumulates into dW in fp32 (no fp32 copy of anything).
    at::addmm_out(dw, dw, dz_head.t(), x_chunk, torch::kFloat);
#endif
  } else {
    // fp32 accumulators of a half-precision head: the GEMM runs in fp32 on the unrounded
    // logits gradient, so each micro-batch adds its exact (to fp32) contribution.
    dw.addmm_(dz_logits.to(dw.scalar_type()).t(), x_chunk.to(dw.scalar_type()));
  }
}

// dL/dy for the `rows` tokens from `start`, given their token weights (valid × weights).
using UpstreamFn =
    std::function<torch::Tensor(int64_t start, int64_t rows, const torch::Tensor& token_weights)>;

struct ChunkOutputs {
  torch::Tensor loss_sum;  // 0-d fp64: Σ w_i·y_i (before division by the denominator)
  std::map<std::string, torch::Tensor> extras;  // 0-d fp64 sums over valid tokens
  torch::Tensor per_token;                      // [N] when requested
  int64_t num_chunks = 0;
};

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
  for (const auto& [name, tensor] : chunk.aux) tokens.aux[name] = tensor.to(logits_opts.dtype());
  return tokens;
}

struct BlockResult {
  torch::Tensor y;                              // [rows] per-token outputs (detached)
  std::map<std::string, torch::Tensor> extras;  // [rows] each (detached)
  torch::Tensor dz;                             // [rows, V] dL/dz when `dy` is given
};

// Runs the function on one block of logits rows (`z_head`, the head's dtype) and, when `dy`
// (dL/dy of the block's tokens) is defined, differentiates it with autograd.
BlockResult RunFunctionBlock(const Plan& plan, const ChunkTokens& tokens,
                             const torch::Tensor& z_head, const torch::Tensor& dy,
                             torch::ScalarType logits_dtype) {
  const bool want_grad = dy.defined();
  ChunkInputs in;
  in.params = &plan.params();
  in.vocab = plan.vocab.get();
  in.targets = tokens.targets;
  in.aux = tokens.aux;
  // A leaf of its own (for an fp32 head, a view of the chunk buffer: no copy).
  torch::Tensor z = z_head.to(logits_dtype).detach();
  if (want_grad) z.requires_grad_(true);
  BlockResult result;
  torch::Tensor y;
  {
    torch::AutoGradMode grad_mode(want_grad);
    in.logits = TransformLogits(z, plan.params());
    FunctionOutput fo = plan.fn().forward(in);
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

// What a pass over the chunks computes besides the outputs, and where it writes them.
struct ChunkPass {
  const UpstreamFn* upstream = nullptr;  // dL/dy of each token; null: outputs only (Forward)
  GradientBuffers* grads = nullptr;      // dW / db += (with upstream; null: dX only)
  torch::Tensor grad_hidden;             // dX [N, D] written here (with upstream), if defined
  bool keep_per_token = false;           // fill ChunkOutputs::per_token
};

// The [chunk_rows, V] buffers of one pass, allocated once (or taken from the caller's
// workspace): a fresh buffer per chunk would cost page faults.
struct ChunkBuffers {
  torch::Tensor logits;  // z in the head's dtype
  // dL/dz: for an fp32 head the logits buffer itself (each block's logits are dead once its
  // gradient exists); otherwise a separate fp32 buffer, so dW accumulates the unrounded
  // gradient. Undefined without gradients.
  torch::Tensor grad;
};

ChunkBuffers AllocateChunkBuffers(const Head& head, const Plan& plan, bool gradients) {
  const torch::Tensor& w = plan.logits_workspace;
  ChunkBuffers buffers;
  buffers.logits =
      w.defined() && w.dim() == 2 && w.size(0) >= plan.chunk_rows &&
              w.size(1) == head.vocab_size() && w.is_contiguous() &&
              w.scalar_type() == head.dtype() && w.device() == head.device()
          ? w.narrow(0, 0, plan.chunk_rows)
          : torch::empty({plan.chunk_rows, head.vocab_size()}, head.weight().options());
  if (gradients) {
    buffers.grad = head.dtype() == LogitsDtype(head)
                       ? buffers.logits
                       : torch::empty(buffers.logits.sizes(),
                                      buffers.logits.options().dtype(LogitsDtype(head)));
  }
  return buffers;
}

// The function's per-token values of one chunk.
struct ChunkValues {
  torch::Tensor y;                              // [rows]
  std::map<std::string, torch::Tensor> extras;  // [rows] each
};

// Runs the function over one chunk's logits `z`, one block at a time; with `dy` defined, writes
// dL/dz into `dz` ([rows, V], the logits dtype).
ChunkValues RunFunctionBlocks(const Plan& plan, const ChunkTokens& tokens, const torch::Tensor& z,
                              const torch::Tensor& dy, torch::Tensor& dz,
                              const torch::TensorOptions& logits_opts) {
  const int64_t rows = z.size(0);
  ChunkValues values;
  values.y = torch::empty({rows}, logits_opts);
  for (int64_t b = 0; b < rows; b += plan.block_rows) {
    const int64_t block = std::min(plan.block_rows, rows - b);
    BlockResult r = RunFunctionBlock(plan, tokens.Slice(b, block), z.narrow(0, b, block),
                                     dy.defined() ? dy.narrow(0, b, block) : torch::Tensor(),
                                     logits_opts.dtype().toScalarType());
    values.y.narrow(0, b, block).copy_(r.y);
    for (auto& [name, extra] : r.extras) {
      auto [it, inserted] = values.extras.try_emplace(name, torch::Tensor());
      if (inserted) it->second = torch::empty({rows}, logits_opts);
      it->second.narrow(0, b, block).copy_(extra);
    }
    if (r.dz.defined()) dz.narrow(0, b, block).copy_(r.dz);
  }
  return values;
}

// A group's dX_c: this shard's partial dz_r·W_r, summed over the ranks into rank 0's rows of
// `grad_hidden` (the other ranks hold no dX). The sum is taken in the logits dtype, so the
// partials of a half-precision head are added in fp32 and rounded once.
void GroupGradHidden(const Head& head, const Plan& plan, const torch::Tensor& dz_head,
                     int64_t start, const torch::Tensor& grad_hidden) {
  const bool here = plan.holds_grad_hidden();
  torch::Tensor partial;
  if (head.dtype() == LogitsDtype(head) && here) {
    partial = grad_hidden.narrow(0, start, dz_head.size(0));
    torch::mm_out(partial, dz_head, head.weight());
  } else {
    partial = torch::mm(dz_head, head.weight()).to(LogitsDtype(head));
  }
  const absl::Status reduced = plan.shard->group->ReduceSum(partial, /*root=*/0);
  if (!reduced.ok()) throw GroupFailure(reduced);
  if (here && head.dtype() != LogitsDtype(head)) {
    grad_hidden.narrow(0, start, dz_head.size(0)).copy_(partial);
  }
}

// Whether the call stops before this chunk: its own should_stop, or on a group any rank's (one
// small collective per chunk, so that every rank stops at the same chunk).
bool StopBeforeChunk(const Plan& plan) {
  const bool mine = plan.should_stop && plan.should_stop();
  if (plan.shard == nullptr) return mine;
  absl::StatusOr<torch::Tensor> all =
      plan.shard->group->AllGather(torch::full({1}, mine ? 1 : 0, torch::kInt));
  if (!all.ok()) throw GroupFailure(std::move(all).status());
  return all->any().item<bool>();
}

// dX_c = dz·W into the pass's dX rows and dW += dzᵀ·X_c (db += Σ dz) for one chunk. `z` (the
// chunk's logits buffer, dead by now) holds dz rounded to the head's dtype when that is not
// the logits dtype.
void BackpropagateChunk(const Head& head, const Plan& plan, const torch::Tensor& x_chunk,
                        torch::Tensor& z, const torch::Tensor& dz, int64_t start,
                        const ChunkPass& pass) {
  torch::Tensor dz_head = dz;
  if (head.dtype() != LogitsDtype(head)) dz_head = z.copy_(dz);
  if (plan.shard != nullptr) {
    GroupGradHidden(head, plan, dz_head, start, pass.grad_hidden);
  } else if (pass.grad_hidden.defined()) {
    torch::Tensor dx_chunk = pass.grad_hidden.narrow(0, start, x_chunk.size(0));
    torch::mm_out(dx_chunk, dz_head, head.weight());
  }
  if (pass.grads != nullptr) {
    AccumulateWeightGrad(pass.grads->weight, dz, dz_head, x_chunk);
    if (pass.grads->bias.defined()) pass.grads->bias.add_(dz.sum(0));
  }
}

// The one chunk loop behind every mode. Two levels:
//  - a chunk of `chunk_rows` rows is what the three GEMMs see (large, so W and dW stream
//    through memory few times per step); its logits live in one [rows, V] buffer of the
//    head's dtype, allocated once per call, which each block's gradient overwrites;
//  - a block of `block_rows` rows is what the function and autograd see (small, so the fp32
//    upcast and the function's temporaries stay in cache).
ChunkOutputs RunChunks(const Head& head, const TokenBatch& batch, const Plan& plan,
                       const ChunkPass& pass) {
  torch::NoGradGuard no_grad;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(head.device());
  const auto logits_opts = f64.dtype(LogitsDtype(head));
  const bool weighted = plan.reduction == Reduction::kWeightedSum;
  ChunkOutputs out;
  out.loss_sum = torch::zeros({}, f64);
  if (pass.keep_per_token) out.per_token = torch::zeros({plan.rows}, logits_opts);
  if (plan.rows == 0) return out;

  const ChunkBuffers buffers = AllocateChunkBuffers(head, plan, pass.upstream != nullptr);
  for (int64_t start = 0; start < plan.rows; start += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, plan.rows - start);
    if (StopBeforeChunk(plan)) throw StopRequested();
    ++out.num_chunks;
    const TokenBatch chunk = batch.Slice(start, rows);
    torch::Tensor z = buffers.logits.narrow(0, 0, rows);
    ChunkLogits(head, chunk.hidden, z);
    const ChunkTokens tokens = PrepareChunkTokens(chunk, plan, logits_opts);
    torch::Tensor dy;  // [rows] dL/dy
    if (pass.upstream != nullptr) dy = (*pass.upstream)(start, rows, tokens.token_weights);
    torch::Tensor dz = dy.defined() ? buffers.grad.narrow(0, 0, rows) : torch::Tensor();

    const ChunkValues values = RunFunctionBlocks(plan, tokens, z, dy, dz, logits_opts);
    AddMaskedSum(values.y, tokens, weighted ? chunk.weights : torch::Tensor(), out.loss_sum);
    for (const auto& [name, extra] : values.extras) {
      auto [it, inserted] = out.extras.try_emplace(name, torch::zeros({}, f64));
      AddMaskedSum(extra, tokens, {}, it->second);
    }
    if (pass.keep_per_token) {
      out.per_token.narrow(0, start, rows)
          .copy_(tokens.valid.defined() ? torch::where(tokens.valid, values.y, 0.0) : values.y);
    }
    if (dy.defined()) BackpropagateChunk(head, plan, chunk.hidden, z, dz, start, pass);
  }
  return out;
}

StepStats MakeStats(const Plan& plan, const ChunkOutputs& outputs) {
  StepStats stats;
  stats.valid_tokens = plan.valid_tokens;
  stats.denominator = plan.denominator;
  stats.chunk_rows = plan.chunk_rows;
  stats.block_rows = plan.block_rows;
  stats.num_chunks = outputs.num_chunks;
  for (const auto& [name, sum] : outputs.extras) stats.extras[name] = sum.item<double>();
  return stats;
}

// The generation outputs (OutputKind): per chunk z = X_c·Wᵀ (+ b), then per block the fp32
// upcast with softcap and temperature, copied out as the rows' logits (function "logits") or
// turned into a drawn token and its log-probability ("sample", sampling.h). No autograd.
// A drawn token needs finite logits: softmax of an inf or a nan has no probabilities. The cause
// is named: the head's weights (X is checked finite) or the temperature dividing them.
absl::Status CheckSampledLogitsFinite(const torch::Tensor& z, const torch::Tensor& transformed,
                                      const Plan& plan, int64_t first_row) {
  const int64_t bad = FirstNonFiniteRow(transformed);
  if (bad < 0) return absl::OkStatus();
  const int64_t row = plan.first_row + first_row + bad;
  if (FirstNonFiniteRow(z.narrow(0, bad, 1)) >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sample: expected finite logits to draw from; got inf or nan in row ", row, ": hidden[",
        row, "] times the head's weights overflows ", DtypeName(z.scalar_type()),
        " (the head's weights are too large or not finite); no token is drawn"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "sample: expected finite logits to draw from; got inf or nan in row ", row,
      " once divided by params[\"", kTemperatureParam, "\"] = ",
      plan.params().at(kTemperatureParam), ", which overflows float32; no token is drawn"));
}

absl::StatusOr<ForwardResult> RunGenerationChunks(const Head& head, const TokenBatch& batch,
                                                  const Plan& plan,
                                                  torch::ScalarType logits_dtype) {
  torch::NoGradGuard no_grad;
  const bool logits = plan.fn().output == OutputKind::kLogits;
  const torch::TensorOptions opts = head.weight().options();
  ForwardResult result;
  const torch::ScalarType out = OutputDtype(plan.fn().output, head.dtype(), logits_dtype);
  if (logits) {
    result.output = torch::empty({plan.rows, head.vocab_size()}, opts.dtype(out));
  } else {
    result.output = torch::empty({plan.rows}, opts.dtype(out));
    result.token_ids = torch::empty({plan.rows}, opts.dtype(torch::kLong));
  }
  ChunkOutputs counts;
  if (plan.rows > 0) {
    const ChunkBuffers buffers = AllocateChunkBuffers(head, plan, /*gradients=*/false);
    for (int64_t start = 0; start < plan.rows; start += plan.chunk_rows) {
      const int64_t rows = std::min(plan.chunk_rows, plan.rows - start);
      if (StopBeforeChunk(plan)) throw StopRequested();
      ++counts.num_chunks;
      torch::Tensor z = buffers.logits.narrow(0, 0, rows);
      ChunkLogits(head, batch.hidden.narrow(0, start, rows), z);
      for (int64_t b = 0; b < rows; b += plan.block_rows) {
        const int64_t block = std::min(plan.block_rows, rows - b);
        const int64_t row = start + b;
        const torch::Tensor zb =
            TransformLogits(z.narrow(0, b, block).to(LogitsDtype(head)), plan.params());
        if (logits) {
          result.output.narrow(0, row, block).copy_(zb);
          continue;
        }
        RETURN_IF_ERROR(CheckSampledLogitsFinite(z.narrow(0, b, block), zb, plan, row));
        const SampledTokens drawn = SampleTokens(zb, plan.params(), plan.first_row + row);
        result.output.narrow(0, row, block).copy_(drawn.logprobs);
        result.token_ids.narrow(0, row, block).copy_(drawn.token_ids);
      }
    }
  }
  result.stats = MakeStats(plan, counts);
  return result;
}

absl::StatusOr<torch::Tensor> PrepareGradHidden(const Head& head, const Plan& plan,
                                                torch::Tensor grad_hidden_out) {
  RETURN_IF_ERROR(CheckGradHiddenOut(head, plan, grad_hidden_out));
  if (!plan.holds_grad_hidden()) return torch::Tensor();
  if (grad_hidden_out.defined()) return grad_hidden_out;
  return torch::empty({plan.rows, head.hidden_size()}, head.weight().options());
}

// LibTorch reports failures during compute (allocation failures above all) as exceptions; the
// engine's callers get a status instead. Out-of-memory maps to RESOURCE_EXHAUSTED.
template <typename Fn>
auto StatusFromExceptions(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const GroupFailure& e) {
    return e.status;
  } catch (const StopRequested&) {
    return absl::CancelledError(
        "cancelled: the request was cancelled or its deadline expired; stopped between chunks");
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory: ", e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch error: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
}

absl::StatusOr<FusedResult> FusedForwardBackwardImpl(const Head& head, const TokenBatch& batch,
                                                     const StepOptions& options,
                                                     GradientBuffers* grads,
                                                     torch::Tensor grad_hidden_out) {
  if (options.reduction == Reduction::kNone) {
    return absl::InvalidArgumentError(
        "reduction: fused mode needs a scalar loss (sum, mean or weighted_sum); got none — "
        "use Forward then Backward for per-token outputs");
  }
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options, CallMode::kFused));
  RETURN_IF_ERROR(CheckGradientBuffers(head, grads));
  ASSIGN_OR_RETURN(torch::Tensor grad_hidden, PrepareGradHidden(head, plan, grad_hidden_out));

  const double factor = options.upstream_scale / plan.denominator;
  const UpstreamFn upstream = [factor](int64_t, int64_t, const torch::Tensor& w) {
    return w * factor;
  };
  const ChunkOutputs outputs = RunChunks(
      head, batch, plan, {.upstream = &upstream, .grads = grads, .grad_hidden = grad_hidden});
  FusedResult result;
  result.loss = outputs.loss_sum.item<double>() / plan.denominator;
  result.grad_hidden = std::move(grad_hidden);
  result.stats = MakeStats(plan, outputs);
  return result;
}

absl::StatusOr<ForwardResult> ForwardImpl(const Head& head, const TokenBatch& batch,
                                          const StepOptions& options) {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options, CallMode::kForward));
  if (plan.fn().output != OutputKind::kPerToken) {
    return RunGenerationChunks(head, batch, plan, options.logits_dtype);
  }
  const bool per_token = options.reduction == Reduction::kNone;
  const ChunkOutputs outputs = RunChunks(head, batch, plan, {.keep_per_token = per_token});
  ForwardResult result;
  result.output =
      per_token ? outputs.per_token : (outputs.loss_sum / plan.denominator).to(LogitsDtype(head));
  result.stats = MakeStats(plan, outputs);
  return result;
}

absl::StatusOr<BackwardResult> BackwardImpl(const Head& head, const TokenBatch& batch,
                                            const StepOptions& options,
                                            const torch::Tensor& grad_output,
                                            GradientBuffers* grads, torch::Tensor grad_hidden_out) {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options, CallMode::kBackward));
  RETURN_IF_ERROR(CheckGradientBuffers(head, grads));
  UpstreamFn upstream;
  if (options.reduction == Reduction::kNone) {
    RETURN_IF_ERROR(
        CheckPerToken(grad_output, "grad_output", plan.rows, head.device(), false, plan.first_row));
    upstream = [&grad_output](int64_t start, int64_t rows, const torch::Tensor& w) {
      return w * grad_output.narrow(0, start, rows).to(w.scalar_type());
    };
  } else {
    if (!grad_output.defined() || grad_output.numel() != 1 ||
        !IsFloating(grad_output.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_output: expected one floating value (the gradient of the ",
          std::string(ReductionName(options.reduction)), " loss); got ", ShapeOf(grad_output)));
    }
    const double g = grad_output.item<double>();
    if (!std::isfinite(g)) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad_output: expected a finite value; got ", g));
    }
    const double factor = g / plan.denominator;
    upstream = [factor](int64_t, int64_t, const torch::Tensor& w) { return w * factor; };
  }
  ASSIGN_OR_RETURN(torch::Tensor grad_hidden, PrepareGradHidden(head, plan, grad_hidden_out));
  const ChunkOutputs outputs = RunChunks(
      head, batch, plan, {.upstream = &upstream, .grads = grads, .grad_hidden = grad_hidden});
  BackwardResult result;
  result.grad_hidden = std::move(grad_hidden);
  result.stats = MakeStats(plan, outputs);
  return result;
}

}  // namespace

absl::StatusOr<FusedResult> FusedForwardBackward(const Head& head, const TokenBatch& batch,
                                                 const StepOptions& options, GradientBuffers* grads,
                                                 torch::Tensor grad_hidden_out) {
  return StatusFromExceptions(
      [&] { return FusedForwardBackwardImpl(head, batch, options, grads, grad_hidden_out); });
}

absl::StatusOr<ForwardResult> Forward(const Head& head, const TokenBatch& batch,
                                      const StepOptions& options) {
  return StatusFromExceptions([&] { return ForwardImpl(head, batch, options); });
}

absl::StatusOr<BackwardResult> Backward(const Head& head, const TokenBatch& batch,
                                        const StepOptions& options,
                                        const torch::Tensor& grad_output, GradientBuffers* grads,
                                        torch::Tensor grad_hidden_out) {
  return StatusFromExceptions(
      [&] { return BackwardImpl(head, batch, options, grad_output, grads, grad_hidden_out); });
}

}  // namespace remotehead::core
