// What a step call (Client::ForwardBackward, Forward, Backward) takes and returns: its spec and
// per-token inputs, the gradient identity that makes its dW exactly-once, its results and the
// server's summary; and the server's functions as ListFunctions describes them.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "remotehead/core/torch_api.h"

namespace remotehead::client {

enum class Reduction { kNone, kSum, kMean, kWeightedSum };

// Identity of one gradient contribution: the server adds a given identity's dW at most once
// between two zeroings of the head's gradients.
struct GradientId {
  std::string trainer;  // e.g. "run-7/rank-3"
  int64_t step = 0;
  int64_t micro_batch = 0;
};

// What a step computes (the StepHeader of the wire contract).
struct StepSpec {
  std::string head_id;
  std::string function = "cross_entropy";  // cross_entropy, token_logprobs, entropy, grpo, …
  std::map<std::string, double> params;    // e.g. {{"label_smoothing", 0.1}}
  Reduction reduction = Reduction::kMean;
  int64_t ignore_index = -100;
  // Divides the reduced sum, e.g. the valid tokens of a whole accumulated batch.
  std::optional<double> normalizer;
  // For a MEAN without normalizer the server needs the count of targets != ignore_index over
  // all rows up front; unset, the client counts it from the targets.
  std::optional<int64_t> valid_tokens;
  int64_t chunk_rows = 0;  // server-side chunking; both 0: the server's default budget
  int64_t memory_budget_bytes = 0;
  double upstream_scale = 1.0;            // fused: dL/d(loss), e.g. a loss scale
  bool accumulate_weight_grad = true;     // false: dX only (frozen head)
  std::optional<GradientId> gradient_id;  // required when accumulating dW
  // Fails with FAILED_PRECONDITION unless the head is at this version.
  std::optional<int64_t> expected_weight_version;
  // hidden is converted to this dtype before it is sent (the head's dtype: the server computes
  // in it). Unset: sent as it is.
  std::optional<torch::ScalarType> wire_dtype;
  // Forward only: the server keeps the rows (hidden, targets, weights, aux) for at most this
  // many seconds, so that the two-phase Backward can name them by StepSummary::inputs_handle
  // instead of sending X again. 0: keep nothing.
  double retain_inputs_seconds = 0;
  // Backward only: a Forward's inputs_handle. Then only grad_output travels (nothing at all for
  // a scalar reduction); inputs.hidden still gives N, D and the dtype of dX, and inputs.targets
  // (or valid_tokens) the count a MEAN without normalizer needs. The server refuses the handle
  // once the head's weights moved on, and forgets it after a successful Backward (NOT_FOUND).
  std::string inputs_handle;
  // Forward of a function whose outputs are logits rows (FunctionInfo::output_kind kLogits):
  // their dtype. Unset: the function's listed default (float32).
  std::optional<torch::ScalarType> output_dtype;
  // The dtype the server's GEMM forms the logits z = X·Wᵀ in, for any function (a two-head
  // function's teacher alike). Unset: the head's dtype (a bf16 head's logits are rounded to
  // bf16 before the function upcasts them). torch::kFloat: fp32 logits from the head's bf16 /
  // fp16 weights, with no half-precision rounding of the logits or their gradient (RL log-probs
  // that must agree with a trainer's fp32 logits; a distillation loss matching TRL's); nothing
  // changes on a float32 / float64 head. Any other dtype: INVALID_ARGUMENT from the server.
  std::optional<torch::ScalarType> logits_dtype;
  // HeadInfo::incarnation seen by the trainer: FAILED_PRECONDITION once the server restarted,
  // instead of adding dW to a window it no longer has. Empty: unchecked.
  std::string expected_incarnation;
  // A two-head (distillation) function (FunctionInfo::needs_teacher): the frozen teacher head
  // whose logits, from StepInputs::teacher_hidden, the student's (head_id) are compared with.
  // It gets no gradient. Empty: none (refused for a function that needs one).
  std::string teacher_head_id;
  // Names of the function's extras (FunctionInfo::extras, e.g. a distillation's "entropy") to
  // return per token as well as summed, in any call: the result's token_extras. Only extras the
  // call reports (their condition met) may be named; the server refuses any other.
  std::vector<std::string> token_extras;
  // Leave out the rows whose target is ignore_index when the function's listing says they
  // contribute nothing (FunctionInfo::ignored_rows_contribute_nothing): only the other rows
  // travel, and dX, per-token outputs and token extras come back with zeros in the rows left
  // out — the same bits as sending every row (the server drops those rows itself before it
  // computes). false: every row travels (e.g. to measure the difference). A Backward by
  // inputs_handle leaves out of its grad_output what its Forward left out (the client remembers
  // it by handle, targets given or not).
  bool compact_rows = true;
};

// StepSpec::token_extras by name: [N] each (float32; float64 for float64 hidden), 0 at ignored
// rows, on the CPU.
using TokenExtras = std::map<std::string, torch::Tensor>;

// The per-token inputs of a step. hidden is [N, D]; every other tensor is [N] (or as noted).
// Tensors may live on any device: they are copied to the CPU for the wire.
struct StepInputs {
  torch::Tensor hidden;
  torch::Tensor targets;  // int64 / int32 token ids or ignore_index; optional for some functions
  torch::Tensor weights;  // weighted_sum only
  // Extra per-token inputs by name, e.g. GRPO's "advantages", "old_logprobs", "ref_logprobs":
  // floating [N]; [N, k] for the function's FunctionInfo::topk_aux (e.g. a sparse teacher's
  // "teacher_topk_logprobs"), integer for its integral_aux ("teacher_topk_ids").
  std::map<std::string, torch::Tensor> aux;
  // With StepSpec::teacher_head_id: the teacher's hidden states [N, D_teacher] (D_teacher may
  // differ from D), floating, sent as they are (the teacher head's dtype: the server computes in
  // it), in the same row messages as hidden.
  torch::Tensor teacher_hidden;
};

// Where a step's time went on the server (seconds). The phases overlap — rows arrive while
// earlier rows are computed and their results sent — so they need not add up to total.
struct StepTimings {
  double queue_seconds = 0;         // waiting for admission
  double receive_wait_seconds = 0;  // compute idle, waiting for rows from the client
  double compute_seconds = 0;       // engine time
  double send_wait_seconds = 0;     // compute paused: the client had not taken the results
  double total_seconds = 0;         // first message to summary, on the server
};

struct StepSummary {
  double loss = 0;  // the reduced loss (fused, scalar Forward); not multiplied by upstream_scale
  int64_t valid_tokens = 0;
  double denominator = 1;
  std::map<std::string, double> extras;  // sums over valid tokens, e.g. "nll", "kl"
  int64_t weight_version = 0;            // the head version the result was computed against
  bool replayed = false;  // the gradient id had already been applied: nothing was added
  int64_t chunk_rows = 0;
  int64_t num_chunks = 0;
  std::string inputs_handle;  // Forward with retain_inputs_seconds: pass to Backward
  std::string incarnation;    // the server process that computed it (HeadInfo::incarnation)
  StepTimings timings;
};

struct ForwardBackwardResult {
  double loss = 0;
  torch::Tensor grad_hidden;  // dX [N, D] in hidden's dtype, on the CPU; × upstream_scale
  StepSummary summary;
  TokenExtras token_extras;
};

struct ForwardResult {
  // reduction NONE: what the function's listing says it returns (FunctionInfo::output_kind):
  // per-token outputs [N] (0 at ignored positions), logits rows [N, V], or a drawn token's
  // log-probability [N]; in the listed dtype. Otherwise the 0-d reduced loss (float64).
  torch::Tensor outputs;
  torch::Tensor token_ids;  // kSample: the drawn tokens [N] (int64); otherwise undefined
  StepSummary summary;
  TokenExtras token_extras;
};

struct BackwardResult {
  torch::Tensor grad_hidden;  // dX [N, D] in hidden's dtype, on the CPU
  StepSummary summary;
  TokenExtras token_extras;
};

// What a Forward with reduction NONE returns per row.
enum class OutputKind { kPerToken, kLogits, kSample };

// A scalar option of a function (StepSpec::params).
struct FunctionParameter {
  std::string name;
  double default_value = 0;
  double min_value = 0;  // inclusive
  double max_value = 0;  // inclusive (may be +inf)
  std::string help;
  bool common = false;  // accepted by every function (temperature, softcap)
};

// A per-token diagnostic a function reports: summed in StepSummary::extras, and returned per
// token when a step names it (StepSpec::token_extras).
struct FunctionExtra {
  std::string name;
  std::string help;
  std::string when_param;  // reported only when this param is > 0 (empty: always)
  std::string when_aux;    // reported only when this aux input is sent (empty: always)
};

// A function the server computes, as ListFunctions describes it.
struct FunctionInfo {
  std::string name;
  std::string help;
  bool needs_targets = false;
  std::vector<std::string> required_aux;  // StepInputs::aux names
  std::vector<std::string> optional_aux;
  std::vector<FunctionParameter> params;  // its own, then the common ones
  OutputKind output_kind = OutputKind::kPerToken;
  // The dtype of its outputs on a head of any dtype but float64 (kLogits: the default of
  // StepSpec::output_dtype), and whether a float64 head gives float64 outputs.
  torch::ScalarType output_dtype = torch::kFloat;
  bool output_float64_on_float64_heads = false;
  bool differentiable = false;      // false: a generation output (Forward, reduction NONE only)
  bool vocab_decomposable = false;  // runs on a head group
  // A two-head (distillation) function: StepSpec::teacher_head_id and
  // StepInputs::teacher_hidden are required.
  bool needs_teacher = false;
  std::vector<std::string> topk_aux;      // aux inputs of [N, k] (the same k for all of them)
  std::vector<std::string> integral_aux;  // aux inputs of an integer dtype (int64 / int32)
  std::vector<FunctionExtra> extras;      // its per-token diagnostics
  // A row whose target is ignore_index contributes nothing (no output, dX, dW, nor a place in a
  // mean's count): the client leaves such rows out (StepSpec::compact_rows).
  bool ignored_rows_contribute_nothing = false;
};

}  // namespace remotehead::client
