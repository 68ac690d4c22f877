// Transformation functions: what the head computes from one chunk of fp32 logits.
//
// Each function is plain *forward* LibTorch code mapping logits [n, V] (fp32, already
// soft-capped and divided by the temperature) and per-token inputs to per-token outputs [n].
// No derivative is ever written by hand: the engine differentiates the forward with autograd,
// chunk by chunk. Adding a function is one entry in BuiltinFunctions() in functions.cc.
//
// The rules a function follows, so that the same code runs on a whole head and on one shard of
// a head group (vocab_group.h), where `logits` holds only this rank's columns:
//  1. Every reduction over the vocabulary goes through `in.vocab` (VocabOps below): log-sum-exp,
//     sums of element-wise expressions, the value at the target, the global V. Never reduce
//     over dim 1 of the logits yourself (no .sum(1), log_softmax, gather, max, topk, sort).
//  2. Element-wise work on [n, columns] tensors and any work on per-token [n] tensors is free.
//  3. What you give a VocabOps is element-wise in the logits and the per-token inputs, never
//     built from another VocabOps result: on a group each rank's partial result is combined
//     with the others' as constants, so a partial that depended on a combined value would lose
//     the other ranks' share of its gradient. (Hence SoftmaxMean, not Sum(exp(z − lse)·e).)
//  4. Call the VocabOps in an order that depends only on the params and which aux inputs are
//     present, never on values: on a group each call is a collective that every rank makes.
//  5. Means over the vocabulary divide by in.vocab->vocab_size(), never by logits.size(1).
//  6. A function that cannot follow rule 1 (it needs an argmax or a sort over the whole
//     vocabulary; the largest values alone are VocabOps::LargestValues) sets
//     vocab_decomposable = false: it runs on one server and a head group
//     refuses it with INVALID_ARGUMENT naming it.
//
// Two built-in entries are not transformation functions but generation outputs (OutputKind
// below): "logits" returns the rows' logits and "sample" draws a token from each row. They have
// no forward, no loss and no gradient: only a Forward with reduction none computes them, in the
// engine's own chunk loop (engine_generation.cc), never holding more than one chunk's logits. On a
// head group that loop all-gathers each chunk's rows over the whole vocabulary, so both run on
// groups too.
#pragma once

#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/fused_kind.h"
#include "remotehead/core/token_batch.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// Scalar options of a function, by name (e.g. {"label_smoothing", 0.1}). Defaults are filled
// in and ranges checked by FunctionRegistry::ResolveParams before a function ever runs.
using FunctionParams = std::map<std::string, double>;

// +∞: the limit of a parameter unbounded on that side (and -kInf the log-probability of a token
// that cannot be drawn).
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// The vocabulary-wide operations a function may use (rule 1 above). On a whole head they reduce
// over the chunk's V columns. On a shard of a group they reduce over this rank's columns,
// gather the ranks' per-token partial results (a collective of a few floats per token), and
// combine them with this rank's own partial in place of its gathered copy, so that autograd
// flows into this rank's columns with the exact gradient of the whole-vocabulary expression.
// Results are [n] and differentiable.
class VocabOps {
 public:
  virtual ~VocabOps() = default;
  // V of the whole head (a shard's logits have fewer columns).
  virtual int64_t vocab_size() const = 0;
  // log Σ_j exp(z_ij) over the whole vocabulary.
  virtual torch::Tensor LogSumExp(const torch::Tensor& z) const = 0;
  // Σ_j e_ij over the whole vocabulary of an element-wise expression e [n, columns].
  virtual torch::Tensor Sum(const torch::Tensor& e) const = 0;
  // e_{i, t_i}: each token's value of e [n, columns] at its target (global token ids [n]).
  virtual torch::Tensor AtTarget(const torch::Tensor& e, const torch::Tensor& targets) const = 0;
  // log softmax(z)_{i, t_i} = z_t − lse: the target's log-probability (global token ids [n]).
  // The same as AtTarget(z, t) − LogSumExp(z), in one fused pass over a whole head and one
  // collective on a group.
  virtual torch::Tensor LogSoftmaxAtTarget(const torch::Tensor& z,
                                           const torch::Tensor& targets) const = 0;
  // Σ_j softmax(z)_ij · e_ij: the softmax-weighted mean of e.
  virtual torch::Tensor SoftmaxMean(const torch::Tensor& e, const torch::Tensor& z) const = 0;
  // Σ_j f(log softmax(a)_ij, log softmax(b)_ij) for element-wise terms f of two
  // log-probability rows (a divergence between two distributions over the vocabulary, e.g. a
  // JSD's mixture), one [n] result per term, from one pair of log-softmaxes. The first term is
  // differentiable; the others are diagnostics (detached, e.g. an entropy). The one operation
  // whose terms depend on a combined value (both log-sum-exps): on a group it also gathers each
  // rank's dΣ/dlse so that the gradient through the other ranks' terms is exact (rule 3 holds
  // for what a function gives it: a and b are element-wise in the logits).
  using PairTerm =
      std::function<torch::Tensor(const torch::Tensor& log_p, const torch::Tensor& log_q)>;
  virtual std::vector<torch::Tensor> SumsOfLogSoftmaxPair(const std::vector<PairTerm>& terms,
                                                          const torch::Tensor& a,
                                                          const torch::Tensor& b) const = 0;
  // Each row's k largest values of z over the whole vocabulary ([n, k], descending, detached;
  // 1 <= k <= vocab_size()): the values only, for a sampler's thresholds (sampler_kept_set.h).
  // On a group: each rank's local top-k (at most its columns), all-gathered, and the top-k of
  // the union, which holds the global top-k; identical on every rank.
  virtual torch::Tensor LargestValues(const torch::Tensor& z, int64_t k) const = 0;
};

struct ChunkInputs {
  torch::Tensor logits;   // [n, columns] fp32 (all V columns, or a shard's), requires grad
                          // when gradients are wanted
  torch::Tensor targets;  // [n] int64 global token ids in [0, V): ignored positions hold 0
                          // (the engine masks them out afterwards); undefined if the batch
                          // carries no targets
  AuxTensors aux;         // [n] fp32 slices of the per-token inputs ([n, k] for topk_aux;
                          // int64 for integral aux)
  // Two-head functions: the teacher's logits [n, columns] in the logits dtype, with its own
  // logit scale, softcap and bias and the shared temperature applied; a constant (no grad).
  torch::Tensor teacher_logits;
  const FunctionParams* params = nullptr;
  const VocabOps* vocab = nullptr;  // every reduction over the vocabulary goes through this

  double param(const std::string& name) const { return params->at(name); }
};

struct FunctionOutput {
  torch::Tensor per_token;  // [n] fp32, differentiable w.r.t. logits: what is reduced to the loss
  // Per-token diagnostics (detached), reported as sums over valid tokens, e.g. "z_loss".
  std::map<std::string, torch::Tensor> extras;
};

struct ParamSpec {
  std::string name;
  double default_value;
  double min_value;  // inclusive
  double max_value;  // inclusive
  std::string help;
};

// What a Forward with reduction none returns per row.
enum class OutputKind {
  kPerToken,  // one value per token (every transformation function)
  kLogits,    // "logits": the row's logits [V] (softcap and temperature applied), in
              // StepOptions::output_dtype
  kSample,    // "sample": a token id drawn from the row's distribution (greedy, temperature,
              // top-k, top-p; seeded) and its log-probability (sampling.h)
};

// The dtype of a Forward's outputs with reduction none: the head's compute dtype (float64 on a
// float64 head, else float32); for kLogits the requested one (StepOptions::output_dtype).
torch::ScalarType OutputDtype(OutputKind kind, torch::ScalarType head_dtype,
                              torch::ScalarType logits_dtype);

// The shape of an aux input: one value per token, or k per token (a sparse teacher's top-k).
enum class AuxKind {
  kPerToken,     // [N] floating
  kPerTokenIds,  // [N] int64 / int32, e.g. the sequence each token belongs to
  kTopkIds,     // [N, k] int64 / int32 token ids in [0, V), distinct within a row
  kTopkValues,  // [N, k] floating, the same k as the ids
};

// A per-token diagnostic a function reports beside its output (FunctionOutput::extras): summed
// over the valid tokens into StepStats::extras, and returned row by row when a call asks for it
// (StepOptions::token_extras). Some are reported only under a condition of the call.
struct ExtraSpec {
  std::string name;
  std::string help;
  std::string when_param;  // reported only when this param is > 0 (e.g. "z_loss"); empty: always
  std::string when_aux;    // reported only when this aux input is sent; empty: always

  // Whether a call with these (resolved) params and aux inputs reports it.
  bool ReportedWith(const FunctionParams& params, const AuxTensors& aux) const;
};

// What a row-coupled function (TransformFunction::coupled_forward) sees: the whole call's rows.
struct CoupledInputs {
  torch::Tensor values;  // [N] the per-token values of the first pass (per_token_value), 0 at
                         // ignored rows; requires grad when gradients are wanted
  torch::Tensor valid;   // [N] bool: the rows whose target is not ignore_index (all without targets)
  AuxTensors aux;        // [N] each: floating aux in values' dtype, integral aux (kPerTokenIds) int64
  const FunctionParams* params = nullptr;

  double param(const std::string& name) const { return params->at(name); }
};

struct TransformFunction {
  std::string name;
  std::string help;
  bool needs_targets = true;
  // A two-head (distillation) function: StepOptions::teacher and TokenBatch::teacher_hidden are
  // required (and refused for every other function); ChunkInputs::teacher_logits is set.
  bool needs_teacher = false;
  std::vector<std::string> required_aux;
  std::vector<std::string> optional_aux;
  // Aux inputs that are not kPerToken (absent: kPerToken).
  std::map<std::string, AuxKind> aux_kinds;
  std::vector<ParamSpec> params;
  // Every per-token diagnostic the forward may report, and when (ExtraSpec). The forward reports
  // exactly those whose condition the call meets: the engine checks it on every block.
  std::vector<ExtraSpec> extras;
  // How many fp32 [n, V] buffers the forward plus its autograd backward keep alive at the peak
  // (logits and their gradient not included); used to derive chunk rows from a memory budget.
  // Measured, not guessed: tests/core/memory_budget_test.cc fails if the real peak exceeds it.
  double workspace_logit_buffers = 2.0;
  // False for a function that reduces over the vocabulary other than through VocabOps (rule 5
  // above): a head group refuses it.
  bool vocab_decomposable = true;
  // True for a surrogate objective whose gradient is by definition not the derivative of its
  // value: a weight held constant (CISPO's capped ratio, VESPO's gamma weight, detached as the
  // papers and TRL write them). tests/core/finite_difference_test.cc checks every other
  // function's gradient against differences of its value.
  bool surrogate_gradient = false;
  // Not kPerToken: a generation output (no forward; Forward with reduction none only).
  OutputKind output = OutputKind::kPerToken;
  // True: a row whose target is ignore_index contributes nothing to any call of this function —
  // its per-token output and token extras are 0 in every reduction, its dX is 0, it adds
  // nothing to dW and is not counted in a mean's denominator — because the function is per-row
  // (nothing in one row's forward reads another row) and the engine masks the row out. Then the
  // server drops such rows before it batches them for the engine and puts zeros in their place
  // (server/src/step/row_compaction.h), and a client may leave them out of the call altogether
  // (ListFunctions' FunctionDescription.ignored_rows_contribute_nothing): the results are the
  // same bits either way. The fill value of every per-token result of a dropped row is 0.
  // False for a function without targets (the generation outputs): no row is ignored there.
  // tests/core/row_compaction_test.cc holds every function that says true to it.
  bool ignored_rows_contribute_nothing = false;
  std::function<FunctionOutput(const ChunkInputs&)> forward;
  // The fused kernel that computes this function's blocks when StepOptions::fused_blocks asks
  // for it (core/src/fused/fused_block.h): its value, extras and gradient must be `forward`'s
  // and its autograd derivative, which tests/core/fused_block_test.cc checks.
  FusedKind fused = FusedKind::kNone;
  // Optional cross-field check run before any compute (e.g. GRPO's beta > 0 needs ref_logprobs;
  // a distillation's alpha > 0 needs targets). A row it names ("aux[\"x\"][i]: …") is row i of
  // the aux it is given; the engine renames it to the row's index in the caller's request.
  std::function<absl::Status(const FunctionParams&, const AuxTensors&, bool has_targets)> validate;
  // Row coupling: a loss in which a token's value depends on other tokens of the call (GSPO's
  // sequence-level importance ratio, VESPO's per-sequence weight, an off-policy sequence mask),
  // so that no block of rows can be computed alone. When `couples_rows` is set and says so for a
  // call's params, the engine runs the call in two passes over all of its rows (engine.h):
  // `per_token_value` on each block's logits — the only part that reads the vocabulary, e.g. the
  // target's log-probability — then `coupled_forward` once on the whole call's [N] values under
  // autograd (plain LibTorch on [N] tensors: sums over a sequence are allowed there), whose
  // gradient the second pass backpropagates into dX and dW. `forward` still serves the calls
  // this returns false for. A server gives such a call to the engine in one batch.
  std::function<bool(const FunctionParams&)> couples_rows;
  std::function<torch::Tensor(const ChunkInputs&)> per_token_value;
  std::function<FunctionOutput(const CoupledInputs&)> coupled_forward;
  bool CouplesRows(const FunctionParams& resolved) const {
    return couples_rows && couples_rows(resolved);
  }
  AuxKind aux_kind(const std::string& aux_name) const {
    const auto it = aux_kinds.find(aux_name);
    return it == aux_kinds.end() ? AuxKind::kPerToken : it->second;
  }
  // The names of the extras a call with these params and aux inputs reports, sorted.
  std::vector<std::string> ReportedExtras(const FunctionParams& params,
                                          const AuxTensors& aux) const;
};

// Checks a call's StepOptions::token_extras against the function: distinct names, each one of
// its extras and reported under `params` and, when known (not null), the `aux` inputs sent.
// INVALID_ARGUMENT naming token_extras[i], the extras the call reports and the name given.
absl::Status CheckTokenExtras(const TransformFunction& fn, const FunctionParams& params,
                              const AuxTensors* aux, const std::vector<std::string>& token_extras);

// Options every function accepts; the engine applies them to the logits before the function,
// in this order (TRL's and transformers' order): z ← z · logit_scale (Cohere, Granite),
// softcap > 0 gives z ← softcap·tanh(z / softcap) (Gemma-style), then z ← z / temperature.
inline constexpr char kTemperatureParam[] = "temperature";
inline constexpr char kSoftcapParam[] = "softcap";
inline constexpr char kLogitScaleParam[] = "logit_scale";
// A two-head function's teacher side: its own scale and softcap (the temperature is shared).
inline constexpr char kTeacherSoftcapParam[] = "teacher_softcap";
inline constexpr char kTeacherLogitScaleParam[] = "teacher_logit_scale";

// The generation output "sample" as a registry entry: defined with the sampling it runs
// (sampling.cc, its params and checks in sampling.h) and appended by Builtin().
TransformFunction SampleFunction();
// The distillation functions (distillation.cc): two-head divergences between the student (this
// head) and a frozen teacher head, and the sparse ones against a teacher's top-k log-probs.
std::vector<TransformFunction> DistillationFunctions();
// The policy-gradient losses of RL trainers (policy_losses.cc): TRL's GRPOTrainer loss types —
// "grpo" (the clipped objective of grpo, bnpo, dr_grpo, dapo and luspo, which differ only in
// their normalisation: per-token weights and a normalizer), "cispo", "sapo" and "vespo" — with
// token- or sequence-level importance sampling, a KL to a reference, an importance-sampling
// correction, a per-token policy mask and the off-policy sequence mask.
std::vector<TransformFunction> PolicyLossFunctions();

class FunctionRegistry {
 public:
  // The built-in functions: cross_entropy, token_logprobs, entropy, mse_onehot, sigmoid_sum;
  // the policy losses (grpo, cispo, sapo, vespo); the distillation functions; and the
  // generation outputs logits and sample.
  static const FunctionRegistry& Builtin();
  // A registry of the given functions (tests and embedders; StepOptions::registry).
  explicit FunctionRegistry(std::vector<TransformFunction> functions);

  absl::StatusOr<const TransformFunction*> Find(const std::string& name) const;
  std::vector<std::string> Names() const;
  // Every function, by name (ListFunctions).
  std::vector<const TransformFunction*> Functions() const;
  // The options every function accepts besides its own (temperature, softcap).
  static const std::vector<ParamSpec>& CommonParams();

  // Checks every given param is known, finite and in range; returns the complete set with
  // defaults filled in (the common temperature / softcap included).
  absl::StatusOr<FunctionParams> ResolveParams(const TransformFunction& fn,
                                               const FunctionParams& given) const;

 private:
  std::map<std::string, TransformFunction> functions_;
};

}  // namespace remotehead::core
