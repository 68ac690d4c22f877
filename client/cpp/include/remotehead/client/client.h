// The C++ client of a remotehead server: one typed call per RPC of
// remotehead/v1/head_service.proto, taking and returning torch::Tensor.
//
// - Every fallible call returns absl::Status / absl::StatusOr; a server error comes back with
//   its gRPC code mapped 1:1 (absl and gRPC share google.rpc.Code) and the server's message.
// - A call that fails with UNAVAILABLE (no server yet, a restart, a dropped connection) is
//   retried as a whole with exponential backoff; no other code is ever retried. Step calls keep
//   their gradient identity across attempts, so the server's exactly-once ledger turns a replay
//   of work that did reach it into a no-op (StepSummary::replayed).
// - Step calls stream: a writer thread sends the header and then the rows of X (with the same
//   rows of targets, weights and aux inputs) while the calling thread receives dX / per-token
//   outputs as the server produces them, so upload, compute and download overlap.
//
// A Client is thread-safe: many threads may issue calls at once (each call has its own gRPC
// context and stream on a shared channel).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/wire/http2_settings.h"

namespace remotehead::client {

// TLS towards the server. An empty root_certs_pem uses gRPC's default roots; client_cert_pem
// with client_key_pem presents a client certificate (mutual TLS).
struct TlsOptions {
  std::string root_certs_pem;
  std::string client_cert_pem;
  std::string client_key_pem;
  // Host name the server's certificate is checked against, when it differs from the target's
  // (e.g. connecting to 127.0.0.1 with a certificate issued for "localhost").
  std::string server_name_override;
};

// Exponential backoff between attempts of a call that failed with UNAVAILABLE.
struct RetryPolicy {
  int max_attempts = 5;  // attempts in all, the first included; 1 = never retry
  std::chrono::milliseconds initial_backoff{50};
  double backoff_multiplier = 2.0;
  std::chrono::milliseconds max_backoff{2000};
  // Each wait is scaled by a random factor in [1 − jitter, 1 + jitter], so that many trainers
  // cut off by one server restart do not all reconnect in the same millisecond.
  double jitter = 0.1;
};

// Reported to ClientOptions::on_retry before each backoff wait.
struct RetryEvent {
  std::string rpc;                    // e.g. "ForwardBackward"
  int failed_attempt;                 // 1-based number of the attempt that just failed
  absl::Status status;                // its status (always UNAVAILABLE)
  std::chrono::milliseconds backoff;  // the wait before the next attempt
};

struct ClientOptions {
  std::string target = "127.0.0.1:50051";  // anything grpc::CreateChannel accepts
  // A mesh's replica fronts [replica 0's, replica 1's, …] (head-groups.md): when set, the client
  // dials fronts[rank mod R] (`target` is set to it) for its calls, and sends the operations
  // that change every replica (CreateHead, UploadHead, DropHead, ZeroGradients, an
  // unsynchronized OptimizerStep) to the leader, fronts[0]. A front that is not the leader
  // names the leader (reason NOT_THE_LEADER), and the client follows it once by itself.
  std::vector<std::string> fronts;
  int rank = -1;  // this trainer's rank for `fronts`; -1: RANK from the environment, else 0
  std::optional<TlsOptions> tls;  // unset: an insecure (plaintext) channel
  // Sent as `authorization: Bearer <token>` on every call. Only over TLS: Client::Create
  // refuses a token on an insecure channel rather than send it in clear text.
  std::string bearer_token;
  RetryPolicy retry;
  // Wall-clock limit of one call, all of its attempts and backoff waits included. Unset: none.
  std::optional<std::chrono::milliseconds> deadline;
  // Largest request message: rows of X (with their targets, weights, aux, grad_output) and
  // uploaded weight rows are split so that no message exceeds it. Far below gRPC's 4 MiB
  // default receive limit of a server.
  int64_t chunk_bytes = int64_t{1} << 20;
  // Largest response message accepted (the server's streamed chunks are 1 MiB by default).
  int max_receive_message_bytes = 16 << 20;
  // The connections' HTTP/2 frame size and windows (wire/http2_settings.h); 0s: gRPC's own.
  wire::Http2Settings http2;
  // Parallel streams each step call is striped over (StepHeader.stripe), 1 to 64: row message
  // i goes on stream i mod `streams`, and results come back on all of them, so one step is not
  // bound to what one HTTP/2 stream moves. Streams after the first each have a connection of
  // their own. Results are exactly those of one stream; a failed or cancelled stream fails the
  // whole attempt, which is retried as a whole.
  int streams = 1;
  // Called before each retry wait (logging, metrics, tests). May be called from any thread
  // that issues calls.
  std::function<void(const RetryEvent&)> on_retry;
};

// What one Client has done so far (all calls, all threads).
struct ClientStats {
  int64_t calls = 0;     // typed calls started
  int64_t attempts = 0;  // RPC attempts, retries included
  int64_t retries = 0;   // attempts after an UNAVAILABLE
};

// ----- heads -----

struct HeadInfo {
  std::string head_id;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  torch::ScalarType dtype = torch::kFloat;
  bool has_bias = false;
  std::string device;                     // "cpu", "cuda:0"
  int64_t weight_version = 0;             // bumped by every optimizer step
  int64_t accumulated_micro_batches = 0;  // gradient contributions since the last zeroing
  std::string incarnation;                // the server process: a new one after every restart
  std::string state_id;                   // the durable state last saved or restored ("" if none)
  // A head group's processes and each one's rows [offset, offset + rows) of the vocabulary, by
  // rank (1 and empty for a head on one server).
  int group_size = 1;
  std::vector<std::pair<int64_t, int64_t>> shards;
  // A frozen head takes no dW and no optimizer step (a distillation teacher, a reference model);
  // teacher_of: the heads whose steps named it as their teacher (StepSpec::teacher_head_id) on
  // this server, sorted.
  bool frozen = false;
  std::vector<std::string> teacher_of;
  // The dW (and db) accumulators' dtype: float32 (float64 for a float64 head), or the head's own
  // half-precision dtype (the memory mode, InitSpec::grad_dtype).
  torch::ScalarType grad_dtype = torch::kFloat;
};

// A head initialised on the server: W ~ N(0, init_std²), bias 0.
struct InitSpec {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  bool bias = false;
  uint64_t seed = 0;
  double init_std = 0.02;
  torch::ScalarType dtype = torch::kFloat;
  bool frozen = false;  // HeadInfo::frozen: read only, may serve as a teacher
  // The dW (and db) accumulators' dtype. Unset: float32 (float64 for a float64 head), exact over
  // many micro-batches. The head's own bf16 / fp16: the memory mode — half the gradient memory;
  // each chunk's dW GEMM computes in fp32 and rounds once as it adds (docs/engine.md).
  std::optional<torch::ScalarType> grad_dtype;
};

// A head read from a safetensors file on the server (single file or a sharded checkpoint's
// *.safetensors.index.json).
struct SafetensorsSource {
  std::string path;                             // relative to the server's --checkpoint_dir
  std::string weight_name = "lm_head.weight";   // "model.embed_tokens.weight" for tied models
  std::string bias_name;                        // empty: no bias
  std::optional<torch::ScalarType> dtype;       // unset: the file's dtype
  bool frozen = false;                          // HeadInfo::frozen: read only, may be a teacher
  std::optional<torch::ScalarType> grad_dtype;  // as InitSpec::grad_dtype
};

// How UploadHead stores the uploaded weights.
struct UploadOptions {
  bool frozen = false;  // HeadInfo::frozen; with replace, must equal the existing head's
  // As InitSpec::grad_dtype; with replace, unset or the existing head's.
  std::optional<torch::ScalarType> grad_dtype;
  // New weights for the existing head (same shape, dtype and bias; no accumulated dW): its
  // optimizer state is reset and its weight_version goes up by one. Creates it if it is absent.
  bool replace = false;
};

struct HeadWeights {
  torch::Tensor weight;  // [V, D]
  torch::Tensor bias;    // [V], undefined when the head has none
};

struct HeadGradients {
  torch::Tensor weight_grad;  // [V, D]
  torch::Tensor bias_grad;    // [V], undefined when the head has no bias
  HeadInfo info;              // the head state these gradients belong to
};

// ----- optimizer -----

struct Sgd {
  double lr = 0;
  double momentum = 0;
  double weight_decay = 0;
};

struct AdamW {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// One rank's part of the optimizer step of `world_size` data-parallel trainer processes, each
// of which added its own micro-batches' dW under its own GradientId::trainer. The server holds
// the call until every rank in [0, world_size) asked for `step`, checks that they all asked
// for the same step (INVALID_ARGUMENT naming the field otherwise, nothing applied), applies it
// once with the summed dW scaled by grad_scale / world_size (as DDP averages gradients) and
// answers every rank with the same HeadInfo. A rank that does not come within the server's
// --sync_step_timeout_seconds fails every waiting rank with ABORTED naming the missing ranks.
struct SynchronousStep {
  int64_t step = 0;    // the trainers' global step, >= 0
  int rank = 0;        // this trainer's rank, in [0, world_size)
  int world_size = 1;  // the trainers that step together, >= 1
};

struct OptimizerStepOptions {
  std::variant<Sgd, AdamW> optimizer;
  // Multiplies the accumulated gradient. A synchronous step divides it by world_size on top.
  std::optional<double> grad_scale;
  bool zero_gradients = false;  // zero the accumulators (and the ledger) after the step
  // HeadInfo::incarnation seen by the trainer: FAILED_PRECONDITION once the server restarted
  // (its dW is gone). Empty: unchecked.
  std::string expected_incarnation;
  // HeadInfo::weight_version the trainer holds: FAILED_PRECONDITION, nothing applied, if the
  // head is at another. Unset: unchecked.
  std::optional<int64_t> expected_weight_version;
  // Set: this call is one rank's part of a synchronous step (SynchronousStep).
  std::optional<SynchronousStep> synchronous;
};

// What an export must be of (ExportWeights): unset / empty fields are unchecked.
struct ExportPin {
  std::string expected_incarnation;                // HeadInfo::incarnation seen by the caller
  std::optional<int64_t> expected_weight_version;  // HeadInfo::weight_version seen by the caller
};

// ----- steps -----

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

// A tied embedding's rows W[ids] (Client::EmbeddingLookup), on the CPU.
struct EmbeddingRows {
  torch::Tensor rows;          // [n, D]
  int64_t weight_version = 0;  // the version they are of: the gradient's expected version
};

struct EmbeddingGradientResult {
  bool replayed = false;  // the gradient id had been applied already: nothing was added
  HeadInfo info;
};

struct BackwardResult {
  torch::Tensor grad_hidden;  // dX [N, D] in hidden's dtype, on the CPU
  StepSummary summary;
  TokenExtras token_extras;
};

class Client {
 public:
  // Validates the options (INVALID_ARGUMENT naming the field) and opens the channel; does not
  // wait for a connection (the first call does, retrying while the server is UNAVAILABLE).
  static absl::StatusOr<std::shared_ptr<Client>> Create(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Head lifecycle. CreateHead / UploadHead / DropHead are retried on UNAVAILABLE like every
  // call: if an attempt took effect but its answer was lost, the retry reports ALREADY_EXISTS
  // (create, upload) or NOT_FOUND (drop).
  absl::StatusOr<HeadInfo> CreateHead(const std::string& head_id, const InitSpec& init);
  absl::StatusOr<HeadInfo> CreateHead(const std::string& head_id, const SafetensorsSource& source);
  // Streams weight [V, D] (then bias [V]) rows; the head takes weight's dtype.
  absl::StatusOr<HeadInfo> UploadHead(const std::string& head_id, const torch::Tensor& weight,
                                      const torch::Tensor& bias = {},
                                      const UploadOptions& options = {});
  absl::StatusOr<HeadInfo> DescribeHead(const std::string& head_id);
  absl::StatusOr<std::vector<HeadInfo>> ListHeads();
  absl::Status DropHead(const std::string& head_id);
  // dtype unset: the head's own. `pin`: the export is refused (FAILED_PRECONDITION, nothing
  // streamed) unless the server process and the weight version are the ones the caller holds,
  // so a checkpoint never pairs a body with another version's head.
  absl::StatusOr<HeadWeights> ExportWeights(const std::string& head_id,
                                            std::optional<torch::ScalarType> dtype = {},
                                            const ExportPin& pin = {});
  // Writes a safetensors file on the server (`path` relative to its --checkpoint_dir; atomic,
  // replacing only a checkpoint remotehead wrote); returns the bytes written. Empty names: the
  // server's defaults (lm_head.weight, lm_head.bias).
  absl::StatusOr<int64_t> SaveWeights(const std::string& head_id, const std::string& path,
                                      const std::string& weight_name = "",
                                      const std::string& bias_name = "");

  // Gradients and the server-side optimizer. dtype unset: the accumulators' (HeadInfo::grad_dtype:
  // float32 unless the head is in the memory mode).
  absl::StatusOr<HeadGradients> FetchGradients(const std::string& head_id,
                                               std::optional<torch::ScalarType> dtype = {});
  absl::StatusOr<HeadInfo> ZeroGradients(const std::string& head_id);
  // A single caller's optimizer step is not idempotent, so before retrying one the client asks
  // the server whether the failed attempt took effect (the head's weight_version moved past the
  // version read before the first attempt) and, if it did, returns that state instead of
  // stepping twice. This costs one DescribeHead round trip per call.
  // A synchronous step (options.synchronous) is retried as it is: the server answers a retry of
  // a step it applied with that step's HeadInfo. It returns once every rank came, so
  // ClientOptions::deadline, when set, must leave room for the slowest rank (up to the server's
  // --sync_step_timeout_seconds); a step whose call ran out of time may still be applied when
  // the last rank comes, and calling it again returns its answer.
  absl::StatusOr<HeadInfo> OptimizerStep(const std::string& head_id,
                                         const OptimizerStepOptions& options);

  // Durable training state (a server started with --state_dir; FAILED_PRECONDITION without one).
  // SaveHeadState writes the head's whole training state — weights, bias, optimizer state and
  // version — on the server now (on a head group or a mesh: every rank its shard, under one
  // state id) and returns the head's info, whose state_id names the state for RestoreHeadState.
  // RestoreHeadState puts the head back to that state (weights, optimizer state, version) and
  // zeroes its gradients (a new accumulation window); NOT_FOUND for an unknown state id or head,
  // INVALID_ARGUMENT for a state of another head's shape. Both go to a mesh's leader, like every
  // change to all replicas, and are retried on UNAVAILABLE (saving again writes a new state;
  // restoring again gives the same head).
  absl::StatusOr<HeadInfo> SaveHeadState(const std::string& head_id);
  absl::StatusOr<HeadInfo> RestoreHeadState(const std::string& head_id,
                                            const std::string& state_id);

  // Tied embeddings (a model whose input embedding is this head; RemoteHead::embed is the
  // differentiable form). The rows W[ids] (ids int64 [n], each in [0, V); repeats allowed) in
  // `dtype` (unset: the head's); `pin` as ExportWeights'. On a group every rank reads its rows.
  absl::StatusOr<EmbeddingRows> EmbeddingLookup(const std::string& head_id,
                                                const torch::Tensor& ids,
                                                std::optional<torch::ScalarType> dtype = {},
                                                const ExportPin& pin = {});
  // dW[ids] += grad ([n, D], any float dtype; repeated ids add up) on the server, exactly once
  // per `gradient_id` (kept apart from the head steps' contributions under the same id, so one
  // micro-batch's head step and embedding gradient share it). `pin`: what the lookup read —
  // its weight version (EmbeddingRows::weight_version) and the server process (FAILED_PRECONDITION,
  // nothing added, once the head moved on or the server restarted). Retried like a step.
  absl::StatusOr<EmbeddingGradientResult> EmbeddingGradient(const std::string& head_id,
                                                            const torch::Tensor& ids,
                                                            const torch::Tensor& grad,
                                                            const GradientId& gradient_id,
                                                            const ExportPin& pin = {});

  // Every function the server computes (read once per Client and kept: a Forward with
  // reduction NONE shapes its outputs from it).
  absl::StatusOr<std::vector<FunctionInfo>> ListFunctions();

  // Fused: loss, dX and (spec.accumulate_weight_grad) dW on the server in one pass.
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const StepSpec& spec,
                                                        const StepInputs& inputs);
  // Outputs only, nothing accumulated (spec.accumulate_weight_grad is ignored).
  absl::StatusOr<ForwardResult> Forward(const StepSpec& spec, const StepInputs& inputs);
  // Two-phase backward: the rows again with dL/d(output) — grad_output [N] for reduction NONE,
  // a single value (dL/d(loss), sent as the header's upstream scale) otherwise. The server
  // recomputes the logits, returns dX and adds dW (exactly once per gradient id).
  absl::StatusOr<BackwardResult> Backward(const StepSpec& spec, const StepInputs& inputs,
                                          const torch::Tensor& grad_output);

  const ClientOptions& options() const { return options_; }
  ClientStats stats() const;

 private:
  struct Impl;
  Client(ClientOptions options, std::unique_ptr<Impl> impl);

  ClientOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remotehead::client
