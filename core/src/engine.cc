#include "remotehead/core/engine.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {
namespace {

// Everything a call needs, decided and validated before the first chunk is computed.
struct Plan {
  const TransformFunction* fn = nullptr;
  FunctionParams params;
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
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", first_row + bad, "]: expected a finite value; got ",
                       t[bad].item<double>()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTargets(const Head& head, const TokenBatch& batch, const Plan& plan) {
  RETURN_IF_ERROR(CheckPerToken(batch.targets, "targets", plan.rows, head.device(), true,
                                plan.first_row));
  const torch::Tensor t = batch.targets;
  const torch::Tensor bad =
      (t != plan.ignore_index).logical_and((t < 0).logical_or(t >= head.vocab_size()));
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero()[0][0].item<int64_t>();
    return absl::InvalidArgumentError(
        absl::StrCat("targets[", plan.first_row + i, "]: expected a token id in [0, ",
                     head.vocab_size(),
                     ") or ignore_index (", plan.ignore_index, "); got ", t[i].item<int64_t>()));
  }
  return absl::OkStatus();
}

absl::Status CheckAux(const Head& head, const TokenBatch& batch, const Plan& plan) {
  const TransformFunction& fn = *plan.fn;
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
                                  head.device(), false,
                                  plan.first_row));
  }
  for (const std::string& name : fn.required_aux) {
    if (!batch.aux.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("aux[\"", name, "\"]: function ", fn.name,
                                                     " needs this per-token input; got none"));
    }
  }
  if (fn.validate) RETURN_IF_ERROR(fn.validate(plan.params, batch.aux));
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
      return absl::InvalidArgumentError(
          absl::StrCat("hidden[", first_row + start + bad,
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

// Validates every input and fixes the chunk size and the reduction's denominator.
absl::StatusOr<Plan> MakePlan(const Head& head, const TokenBatch& batch,
                              const StepOptions& options) {
  Plan plan;
  ASSIGN_OR_RETURN(plan.fn, FunctionRegistry::Builtin().Find(options.function));
  ASSIGN_OR_RETURN(plan.params,
                   FunctionRegistry::Builtin().ResolveParams(*plan.fn, options.params));
  plan.reduction = options.reduction;
  plan.should_stop = options.should_stop;
  plan.logits_workspace = options.logits_workspace;
  plan.first_row = options.first_row;
  plan.ignore_index = options.ignore_index;
  RETURN_IF_ERROR(CheckHidden(head, batch));
  plan.rows = batch.hidden.size(0);

  torch::NoGradGuard no_grad;
  if (batch.targets.defined()) {
    RETURN_IF_ERROR(CheckTargets(head, batch, plan));
  } else if (plan.fn->needs_targets) {
    return absl::InvalidArgumentError(absl::StrCat("targets: function ", plan.fn->name,
                                                   " needs per-token targets [", plan.rows,
                                                   "]; got none"));
  }
  if (options.reduction == Reduction::kWeightedSum) {
    if (!batch.weights.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weights: reduction weighted_sum needs per-token weights [", plan.rows, "]; got none"));
    }
    RETURN_IF_ERROR(CheckPerToken(batch.weights, "weights", plan.rows, head.device(), false,
                                  plan.first_row));
  } else if (batch.weights.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights: only used by reduction weighted_sum; got weights with reduction ",
                     std::string(ReductionName(options.reduction))));
  }
  RETURN_IF_ERROR(CheckAux(head, batch, plan));
  if (options.normalizer.has_value() &&
      (!std::isfinite(*options.normalizer) || *options.normalizer <= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalizer: expected a finite value > 0; got ", *options.normalizer));
  }
  if (!std::isfinite(options.upstream_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("upstream_scale: expected a finite value; got ", options.upstream_scale));
  }
  ASSIGN_OR_RETURN(const ChunkSizes sizes, ResolveChunkSizes(head, *plan.fn, plan.params, options));
  plan.chunk_rows = std::min(sizes.chunk_rows, std::max<int64_t>(plan.rows, 1));
  plan.block_rows = std::min(sizes.block_rows, plan.chunk_rows);
  RETURN_IF_ERROR(CheckHiddenFinite(batch.hidden, plan.chunk_rows, plan.first_row));

  plan.valid_tokens = batch.targets.defined()
                          ? (batch.targets != options.ignore_index).sum().item<int64_t>()
                          : plan.rows;
  if (options.normalizer.has_value()) {
    plan.denominator = *options.normalizer;
  } else if (options.reduction == Reduction::kMean) {
    plan.denominator = std::max<int64_t>(plan.valid_tokens, 1);  // Σ over 0 tokens is 0
  }
  return plan;
}

// The dtype the function sees: fp32, or fp64 for a float64 (verification) head.
torch::ScalarType LogitsDtype(const Head& head) {
  return head.dtype() == torch::kDouble ? torch::kDouble : torch::kFloat;
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

// dW += dzᵀ·X_c into the accumulator's dtype.
void AccumulateWeightGrad(torch::Tensor& dw, const torch::Tensor& dz_logits,
                          const torch::Tensor& dz_head, const torch::Tensor& x_chunk) {
  if (dw.scalar_type() == x_chunk.scalar_type()) {
    dw.addmm_(dz_head.t(), x_chunk);
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

ChunkTokens PrepareChunkTokens(const TokenBatch& batch, const Plan& plan, int64_t start,
                               int64_t rows, const torch::TensorOptions& logits_opts) {
  ChunkTokens tokens;
  if (batch.targets.defined()) {
    const torch::Tensor t = batch.targets.narrow(0, start, rows).to(torch::kLong);
    tokens.valid = t != plan.ignore_index;
    tokens.targets = t.masked_fill(tokens.valid.logical_not(), 0);
    tokens.token_weights = tokens.valid.to(logits_opts.dtype());
  } else {
    tokens.token_weights = torch::ones({rows}, logits_opts);
  }
  if (plan.reduction == Reduction::kWeightedSum) {
    tokens.token_weights.mul_(batch.weights.narrow(0, start, rows));
  }
  for (const auto& [name, tensor] : batch.aux) {
    tokens.aux[name] = tensor.narrow(0, start, rows).to(logits_opts.dtype());
  }
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
  in.params = &plan.params;
  in.targets = tokens.targets;
  in.aux = tokens.aux;
  // A leaf of its own (for an fp32 head, a view of the chunk buffer: no copy).
  torch::Tensor z = z_head.to(logits_dtype).detach();
  if (want_grad) z.requires_grad_(true);
  BlockResult result;
  torch::Tensor y;
  {
    torch::AutoGradMode grad_mode(want_grad);
    in.logits = TransformLogits(z, plan.params);
    FunctionOutput fo = plan.fn->forward(in);
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

// The one chunk loop behind every mode. Two levels:
//  - a chunk of `chunk_rows` rows is what the three GEMMs see (large, so W and dW stream
//    through memory few times per step); its logits live in one [rows, V] buffer of the
//    head's dtype, allocated once per call, which each block's gradient overwrites;
//  - a block of `block_rows` rows is what the function and autograd see (small, so the fp32
//    upcast and the function's temporaries stay in cache).
// With `upstream` set it writes dX into `grad_hidden` (if defined) and adds into `grads` (if
// not null).
ChunkOutputs RunChunks(const Head& head, const TokenBatch& batch, const Plan& plan,
                       const UpstreamFn* upstream, GradientBuffers* grads,
                       const torch::Tensor& grad_hidden, bool keep_per_token, int64_t* num_chunks) {
  torch::NoGradGuard no_grad;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(head.device());
  const torch::ScalarType logits_dtype = LogitsDtype(head);
  const auto logits_opts = f64.dtype(logits_dtype);
  const bool weighted = plan.reduction == Reduction::kWeightedSum;
  ChunkOutputs out;
  out.loss_sum = torch::zeros({}, f64);
  if (keep_per_token) out.per_token = torch::zeros({plan.rows}, logits_opts);
  *num_chunks = 0;
  if (plan.rows == 0) return out;

  // Allocated once per call (or reused across calls): a fresh [rows, V] buffer per chunk would
  // cost page faults.
  const torch::Tensor& w = plan.logits_workspace;
  const torch::Tensor logits_buffer =
      w.defined() && w.dim() == 2 && w.size(0) >= plan.chunk_rows &&
              w.size(1) == head.vocab_size() && w.is_contiguous() &&
              w.scalar_type() == head.dtype() && w.device() == head.device()
          ? w.narrow(0, 0, plan.chunk_rows)
          : torch::empty({plan.chunk_rows, head.vocab_size()}, head.weight().options());
  // dL/dz: for an fp32 head the logits buffer itself (each block's logits are dead once its
  // gradient exists); otherwise a separate fp32 buffer, so dW accumulates the unrounded
  // gradient.
  torch::Tensor grad_buffer;
  if (upstream != nullptr) {
    grad_buffer = head.dtype() == logits_dtype ? logits_buffer
                                               : torch::empty(logits_buffer.sizes(), logits_opts);
  }
  for (int64_t start = 0; start < plan.rows; start += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, plan.rows - start);
    if (plan.should_stop && plan.should_stop()) throw StopRequested();
    ++*num_chunks;
    const torch::Tensor x_chunk = batch.hidden.narrow(0, start, rows);
    torch::Tensor z = logits_buffer.narrow(0, 0, rows);
    ChunkLogits(head, x_chunk, z);
    const ChunkTokens tokens = PrepareChunkTokens(batch, plan, start, rows, logits_opts);
    torch::Tensor dy;  // [rows] dL/dy
    if (upstream != nullptr) dy = (*upstream)(start, rows, tokens.token_weights);

    torch::Tensor y = torch::empty({rows}, logits_opts);
    std::map<std::string, torch::Tensor> extras;
    torch::Tensor dz = upstream != nullptr ? grad_buffer.narrow(0, 0, rows) : torch::Tensor();
    for (int64_t b = 0; b < rows; b += plan.block_rows) {
      const int64_t block = std::min(plan.block_rows, rows - b);
      BlockResult r =
          RunFunctionBlock(plan, tokens.Slice(b, block), z.narrow(0, b, block),
                           dy.defined() ? dy.narrow(0, b, block) : torch::Tensor(), logits_dtype);
      y.narrow(0, b, block).copy_(r.y);
      for (auto& [name, values] : r.extras) {
        auto [it, inserted] = extras.try_emplace(name, torch::Tensor());
        if (inserted) it->second = torch::empty({rows}, logits_opts);
        it->second.narrow(0, b, block).copy_(values);
      }
      if (r.dz.defined()) dz.narrow(0, b, block).copy_(r.dz);
    }
    AddMaskedSum(y, tokens, weighted ? batch.weights.narrow(0, start, rows) : torch::Tensor(),
                 out.loss_sum);
    for (const auto& [name, values] : extras) {
      auto [it, inserted] = out.extras.try_emplace(name, torch::zeros({}, f64));
      AddMaskedSum(values, tokens, {}, it->second);
    }
    if (keep_per_token) {
      out.per_token.narrow(0, start, rows)
          .copy_(tokens.valid.defined() ? torch::where(tokens.valid, y, 0.0) : y);
    }
    if (upstream == nullptr) continue;

    torch::Tensor dz_head = dz;
    if (head.dtype() != logits_dtype) dz_head = z.copy_(dz);  // reuse the logits buffer
    if (grad_hidden.defined()) {
      torch::Tensor dx_chunk = grad_hidden.narrow(0, start, rows);
      torch::mm_out(dx_chunk, dz_head, head.weight());
    }
    if (grads != nullptr) {
      AccumulateWeightGrad(grads->weight, dz, dz_head, x_chunk);
      if (grads->bias.defined()) grads->bias.add_(dz.sum(0));
    }
  }
  return out;
}

StepStats MakeStats(const Plan& plan, const ChunkOutputs& outputs, int64_t num_chunks) {
  StepStats stats;
  stats.valid_tokens = plan.valid_tokens;
  stats.denominator = plan.denominator;
  stats.chunk_rows = plan.chunk_rows;
  stats.block_rows = plan.block_rows;
  stats.num_chunks = num_chunks;
  for (const auto& [name, sum] : outputs.extras) stats.extras[name] = sum.item<double>();
  return stats;
}

absl::StatusOr<torch::Tensor> PrepareGradHidden(const Head& head, const Plan& plan,
                                                torch::Tensor grad_hidden_out) {
  RETURN_IF_ERROR(CheckGradHiddenOut(head, plan, grad_hidden_out));
  if (grad_hidden_out.defined()) return grad_hidden_out;
  return torch::empty({plan.rows, head.hidden_size()}, head.weight().options());
}

}  // namespace

absl::StatusOr<Reduction> ParseReduction(std::string_view name) {
  if (name == "none") return Reduction::kNone;
  if (name == "sum") return Reduction::kSum;
  if (name == "mean") return Reduction::kMean;
  if (name == "weighted_sum") return Reduction::kWeightedSum;
  return absl::InvalidArgumentError(absl::StrCat(
      "reduction: expected one of none, sum, mean, weighted_sum; got \"", std::string(name), "\""));
}

std::string_view ReductionName(Reduction reduction) {
  switch (reduction) {
    case Reduction::kNone:
      return "none";
    case Reduction::kSum:
      return "sum";
    case Reduction::kMean:
      return "mean";
    case Reduction::kWeightedSum:
      return "weighted_sum";
  }
  return "unknown";
}

absl::StatusOr<ChunkSizes> ResolveChunkSizes(const Head& head, const TransformFunction& fn,
                                             const FunctionParams& params,
                                             const StepOptions& options) {
  if (options.chunk_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_rows: expected >= 1 (or 0 to derive it from memory_budget_bytes); got ",
                     options.chunk_rows));
  }
  if (options.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_budget_bytes: expected >= 1 (or 0 for the default ",
                     kDefaultMemoryBudgetBytes, "); got ", options.memory_budget_bytes));
  }
  if (options.block_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_rows: expected >= 1 (or 0 for cache-sized blocks); got ", options.block_rows));
  }
  const double vocab = static_cast<double>(head.vocab_size());
  const double elem = static_cast<double>(c10::elementSize(head.dtype()));
  const double logits_elem = static_cast<double>(c10::elementSize(LogitsDtype(head)));
  // Per block row: the upcast logits (when the head is not fp32), their gradient, what the
  // logit transforms save for autograd, and the function's own workspace — all in fp32.
  double block_buffers = 1.0 + fn.workspace_logit_buffers;
  if (head.dtype() != LogitsDtype(head)) block_buffers += 1;
  if (params.at(kSoftcapParam) > 0) block_buffers += 2;
  if (params.at(kTemperatureParam) != 1.0) block_buffers += 1;
  const double block_bytes_per_row = vocab * logits_elem * block_buffers;
  // Per chunk row: the logits buffer in the head's dtype (which the gradient overwrites) plus
  // a separate fp32 gradient when the head is not fp32, and the X / dX rows.
  double chunk_bytes_per_row = vocab * elem + 2.0 * static_cast<double>(head.hidden_size()) * elem;
  if (head.dtype() != LogitsDtype(head)) {
    // …plus, for a half-precision head, the fp32 copy of X_c for the dW GEMM and the
    // half-precision GEMMs' fp32 scratch for dX.
    chunk_bytes_per_row +=
        vocab * logits_elem + 2.0 * static_cast<double>(head.hidden_size()) * logits_elem;
  }

  const auto cache_block_rows =
      options.block_rows > 0
          ? options.block_rows
          : std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(kFunctionBlockBytes) /
                                                      (vocab * logits_elem)));
  ChunkSizes sizes;
  if (options.chunk_rows > 0) {
    sizes.chunk_rows = options.chunk_rows;
    sizes.block_rows = std::min(cache_block_rows, options.chunk_rows);
    return sizes;
  }
  const int64_t budget =
      options.memory_budget_bytes > 0 ? options.memory_budget_bytes : kDefaultMemoryBudgetBytes;
  // Blocks take at most a quarter of the budget; chunks get the rest.
  sizes.block_rows = std::min<int64_t>(
      cache_block_rows,
      static_cast<int64_t>(0.25 * static_cast<double>(budget) / block_bytes_per_row));
  const double rest =
      static_cast<double>(budget) -
      static_cast<double>(std::max<int64_t>(sizes.block_rows, 1)) * block_bytes_per_row;
  sizes.chunk_rows = static_cast<int64_t>(rest / chunk_bytes_per_row);
  if (sizes.block_rows < 1 || sizes.chunk_rows < 1) {
    const double one_row = 4.0 * block_bytes_per_row + chunk_bytes_per_row;
    return absl::InvalidArgumentError(absl::StrCat(
        "memory_budget_bytes: expected at least ", static_cast<int64_t>(std::ceil(one_row)),
        " (one row of ", fn.name, " at V=", head.vocab_size(), "); got ", budget));
  }
  sizes.block_rows = std::min(sizes.block_rows, sizes.chunk_rows);
  return sizes;
}

namespace {

// LibTorch reports failures during compute (allocation failures above all) as exceptions; the
// engine's callers get a status instead. Out-of-memory maps to RESOURCE_EXHAUSTED.
template <typename Fn>
auto StatusFromExceptions(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
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
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options));
  RETURN_IF_ERROR(CheckGradientBuffers(head, grads));
  ASSIGN_OR_RETURN(torch::Tensor grad_hidden, PrepareGradHidden(head, plan, grad_hidden_out));

  const double factor = options.upstream_scale / plan.denominator;
  const UpstreamFn upstream = [factor](int64_t, int64_t, const torch::Tensor& w) {
    return w * factor;
  };
  int64_t num_chunks = 0;
  ChunkOutputs outputs =
      RunChunks(head, batch, plan, &upstream, grads, grad_hidden, false, &num_chunks);
  FusedResult result;
  result.loss = outputs.loss_sum.item<double>() / plan.denominator;
  result.grad_hidden = std::move(grad_hidden);
  result.stats = MakeStats(plan, outputs, num_chunks);
  return result;
}

absl::StatusOr<ForwardResult> ForwardImpl(const Head& head, const TokenBatch& batch,
                                          const StepOptions& options) {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options));
  const bool per_token = options.reduction == Reduction::kNone;
  int64_t num_chunks = 0;
  ChunkOutputs outputs = RunChunks(head, batch, plan, nullptr, nullptr, {}, per_token, &num_chunks);
  ForwardResult result;
  result.output =
      per_token ? outputs.per_token : (outputs.loss_sum / plan.denominator).to(LogitsDtype(head));
  result.stats = MakeStats(plan, outputs, num_chunks);
  return result;
}

absl::StatusOr<torch::Tensor> BackwardImpl(const Head& head, const TokenBatch& batch,
                                           const StepOptions& options,
                                           const torch::Tensor& grad_output, GradientBuffers* grads,
                                           torch::Tensor grad_hidden_out) {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(head, batch, options));
  RETURN_IF_ERROR(CheckGradientBuffers(head, grads));
  UpstreamFn upstream;
  if (options.reduction == Reduction::kNone) {
    RETURN_IF_ERROR(CheckPerToken(grad_output, "grad_output", plan.rows, head.device(), false,
                                  plan.first_row));
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
  int64_t num_chunks = 0;
  RunChunks(head, batch, plan, &upstream, grads, grad_hidden, false, &num_chunks);
  return grad_hidden;
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

absl::StatusOr<torch::Tensor> Backward(const Head& head, const TokenBatch& batch,
                                       const StepOptions& options, const torch::Tensor& grad_output,
                                       GradientBuffers* grads, torch::Tensor grad_hidden_out) {
  return StatusFromExceptions(
      [&] { return BackwardImpl(head, batch, options, grad_output, grads, grad_hidden_out); });
}

}  // namespace remotehead::core
