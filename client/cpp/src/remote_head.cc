#include "remotehead/client/remote_head.h"

#include <cmath>
#include <mutex>
#include <random>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "replay_journal.h"

namespace remotehead::client {

StatusError::StatusError(absl::Status status)
    : std::runtime_error(status.ToString()), status_(std::move(status)) {}

bool UpstreamMatchesDeclared(double declared, double got) {
  if (got == declared) return true;
  // False for a NaN `got`: every comparison with NaN is.
  return std::abs(got - declared) <= 1e-6 * std::abs(declared);
}

namespace {

template <typename T>
T ValueOrThrow(absl::StatusOr<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return *std::move(result);
}

}  // namespace

struct RemoteHead::State {
  std::shared_ptr<Client> client;
  StepSpec spec;
  HeadInfo info;
  std::string trainer;
  DataParallel data_parallel;
  std::mutex mu;  // guards the counters and the last summary
  int64_t step = 0;
  int64_t micro_batch = 0;
  int64_t embedding_micro_batch = 0;  // embed() calls within the step
  StepSummary last_summary;
  // What the trainer resends after a move to another replica's front, and the front it dials.
  std::unique_ptr<internal::ReplayJournal> journal;

  // `call(spec)`, `spec` pinned to the front dialled now, asked again after a move (its failure
  // thrown).
  template <typename R, typename Call>
  R Resilient(const StepSpec& spec, Call&& call) {
    return ValueOrThrow(journal->PinnedStep<R>(spec, info.weight_version, call));
  }

  GradientId NextGradientId(const HeadCall& call) {
    if (call.gradient_id.has_value()) return *call.gradient_id;
    std::lock_guard<std::mutex> lock(mu);
    return GradientId{.trainer = trainer, .step = step, .micro_batch = micro_batch++};
  }

  GradientId NextEmbeddingId(const EmbedCall& call) {
    if (call.gradient_id.has_value()) return *call.gradient_id;
    std::lock_guard<std::mutex> lock(mu);
    return GradientId{.trainer = trainer, .step = step, .micro_batch = embedding_micro_batch++};
  }

  void Record(const StepSummary& summary) {
    std::lock_guard<std::mutex> lock(mu);
    last_summary = summary;
  }
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using State = RemoteHead::State;

torch::ScalarType ResultDtype(const torch::Tensor& hidden) {
  return hidden.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

// Everything one call needs besides hidden: the resolved spec (function, params, normalizer,
// gradient identity) and the per-token inputs flattened to rows. Shared with its autograd node.
struct Call {
  std::shared_ptr<State> state;
  StepSpec spec;
  StepInputs inputs;                 // hidden filled in by each phase
  std::vector<int64_t> token_shape;  // hidden.shape[:-1]: the shape of per-token outputs
  // Two-phase: what the Forward reported, for its Backward.
  std::string inputs_handle;  // the server kept the rows (spec.retain_inputs_seconds > 0)
  int64_t forward_version = 0;
};

std::shared_ptr<Call> MakeCall(const std::shared_ptr<State>& state, const torch::Tensor& hidden,
                               const torch::Tensor& targets, const HeadCall& extra,
                               const std::string& default_function, bool gradients,
                               bool two_phase) {
  const int64_t d = state->info.hidden_size;
  if (!hidden.defined() || hidden.dim() < 1 || hidden.size(-1) != d) {
    throw StatusError(absl::InvalidArgumentError(
        absl::StrCat("hidden: expected shape [..., ", d, "] (the head's hidden size); got ",
                     hidden.defined() ? c10::str(hidden.sizes()) : "none")));
  }
  auto call = std::make_shared<Call>();
  call->state = state;
  call->spec = state->spec;
  call->spec.function = extra.function.value_or(default_function);
  for (const auto& [name, value] : extra.params) call->spec.params[name] = value;
  if (extra.normalizer.has_value()) call->spec.normalizer = extra.normalizer;
  call->spec.valid_tokens.reset();  // counted per call by the client
  call->spec.accumulate_weight_grad = state->spec.accumulate_weight_grad && gradients;
  if (call->spec.accumulate_weight_grad) call->spec.gradient_id = state->NextGradientId(extra);
  // Only a two-phase Forward with a Backward to come keeps its inputs on the server.
  if (!(two_phase && gradients)) call->spec.retain_inputs_seconds = 0;
  call->spec.inputs_handle.clear();
  call->token_shape = hidden.sizes().slice(0, hidden.dim() - 1).vec();
  int64_t rows = 1;
  for (const int64_t s : call->token_shape) rows *= s;
  const auto flat = [&](const torch::Tensor& t, const std::string& field) {
    if (!t.defined()) return t;
    if (t.numel() != rows) {
      throw StatusError(absl::InvalidArgumentError(
          absl::StrCat(field, ": expected ", c10::str(c10::IntArrayRef(call->token_shape)),
                       " (hidden's leading dimensions); got ", c10::str(t.sizes()))));
    }
    return t.reshape({rows});
  };
  call->inputs.targets = flat(targets, "targets");
  call->inputs.weights = flat(extra.weights, "weights");
  for (const auto& [name, t] : extra.aux) {
    call->inputs.aux[name] = flat(t, absl::StrCat("aux[\"", name, "\"]"));
  }
  return call;
}

// How a Call rides in an autograd node's saved_data (an IValue capsule).
struct CallHolder : torch::CustomClassHolder {
  explicit CallHolder(std::shared_ptr<Call> c) : call(std::move(c)) {}
  std::shared_ptr<Call> call;
};

torch::Tensor Rows(const torch::Tensor& hidden) { return hidden.reshape({-1, hidden.size(-1)}); }

// Fused: forward = one ForwardBackward (loss, dX, dW on the server); backward hands back dX.
struct FusedLossFunction : public torch::autograd::Function<FusedLossFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const std::shared_ptr<Call>& call) {
    call->inputs.hidden = Rows(hidden);
    State& state = *call->state;
    ForwardBackwardResult r = state.Resilient<ForwardBackwardResult>(
        call->spec,
        [&](const StepSpec& s) { return state.client->ForwardBackward(s, call->inputs); });
    state.journal->RecordStep(call->spec, call->inputs);  // host copies, for a move
    call->inputs = {};  // nothing of the batch is kept past the round trip but dX (and the journal)
    call->state->Record(r.summary);
    ctx->saved_data["grad_hidden"] = r.grad_hidden.reshape(hidden.sizes()).to(hidden.device());
    ctx->saved_data["upstream_scale"] = call->spec.upstream_scale;
    ctx->saved_data["accumulates"] = call->spec.accumulate_weight_grad;
    return torch::tensor(r.loss, torch::TensorOptions(ResultDtype(hidden)).device(hidden.device()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor& g = grad_outputs[0];
    if (!g.defined()) return {torch::Tensor(), torch::Tensor()};
    const torch::Tensor dx = ctx->saved_data["grad_hidden"].toTensor();
    const double scale = ctx->saved_data["upstream_scale"].toDouble();
    const double upstream = g.item<double>();
    if (ctx->saved_data["accumulates"].toBool() && !UpstreamMatchesDeclared(scale, upstream)) {
      throw StatusError(absl::FailedPreconditionError(absl::StrCat(
          "RemoteHead::loss: backward got dL/dloss = ", upstream,
          ", but the server accumulated dW for upstream_scale = ", scale,
          " in the forward; declare the factor up front (StepSpec::upstream_scale, or the "
          "normalizer for gradient accumulation), or turn accumulate_weight_grad off")));
    }
    if (upstream == scale)
      return {dx, torch::Tensor()};  // the usual case: dX as the server sent it
    return {dx * (upstream / scale), torch::Tensor()};
  }
};

// Two-phase: forward = Forward with reduction NONE; backward = Backward with dL/dy per token.
struct TokenOutputsFunction : public torch::autograd::Function<TokenOutputsFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const std::shared_ptr<Call>& call) {
    call->inputs.hidden = Rows(hidden);
    State& state = *call->state;
    ForwardResult r = state.Resilient<ForwardResult>(
        call->spec, [&](const StepSpec& s) { return state.client->Forward(s, call->inputs); });
    call->inputs.hidden = torch::Tensor();  // the saved input below is sent again by backward
    call->inputs_handle = r.summary.inputs_handle;
    call->forward_version = r.summary.weight_version;
    call->state->Record(r.summary);
    ctx->save_for_backward({hidden});
    ctx->saved_data["call"] = c10::IValue::make_capsule(c10::make_intrusive<CallHolder>(call));
    return r.outputs.reshape(call->token_shape).to(hidden.device());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor& g = grad_outputs[0];
    if (!g.defined()) return {torch::Tensor(), torch::Tensor()};
    const torch::Tensor hidden = ctx->get_saved_variables()[0];
    const std::shared_ptr<Call> call =
        static_cast<CallHolder*>(ctx->saved_data["call"].toCapsule().get())->call;
    StepInputs inputs = call->inputs;
    inputs.hidden = Rows(hidden);
    StepSpec spec = call->spec;
    spec.retain_inputs_seconds = 0;
    // The gradient belongs to the weights the outputs were computed with: a Backward after an
    // optimizer step fails (FAILED_PRECONDITION) rather than mixing two versions.
    if (!spec.expected_weight_version.has_value()) {
      spec.expected_weight_version = call->forward_version;
    }
    State& state = *call->state;
    const torch::Tensor grad_output = g.reshape({-1});
    const auto backward = [&](const StepSpec& pinned) -> absl::StatusOr<BackwardResult> {
      if (call->inputs_handle.empty()) return state.client->Backward(pinned, inputs, grad_output);
      StepSpec by_handle = pinned;
      by_handle.inputs_handle = call->inputs_handle;
      absl::StatusOr<BackwardResult> result =
          state.client->Backward(by_handle, inputs, grad_output);
      // The server no longer has the rows (they expired, a Backward whose answer was lost
      // released them, the trainer moved to another replica): send them again, under the same
      // gradient identity.
      if (result.status().code() == absl::StatusCode::kNotFound) {
        result = state.client->Backward(pinned, inputs, grad_output);
      }
      return result;
    };
    BackwardResult r = state.Resilient<BackwardResult>(spec, backward);
    state.journal->RecordStep(spec, inputs, grad_output);
    state.Record(r.summary);
    return {r.grad_hidden.reshape(hidden.sizes()).to(hidden.device()), torch::Tensor()};
  }
};

// One embed() call, shared with its autograd node.
struct EmbedState {
  std::shared_ptr<State> state;
  torch::Tensor distinct;  // the distinct ids looked up, int64 [m] on the CPU
  torch::Tensor inverse;   // each id's place among them, shaped like the ids
  GradientId gradient_id;
  int64_t version = 0;  // of the rows read
  std::optional<int64_t> padding_idx;
  double scale = 1.0;
};

struct EmbedHolder : torch::CustomClassHolder {
  explicit EmbedHolder(std::shared_ptr<EmbedState> e) : embed(std::move(e)) {}
  std::shared_ptr<EmbedState> embed;
};

// forward = the rows W[ids] * scale (already looked up); backward = dW[ids] sent to the server.
// `anchor` is an empty tensor that requires grad: the only input autograd can track (ids are
// integers, W is on the server), so that the result gets a backward at all.
struct EmbedFunction : public torch::autograd::Function<EmbedFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& /*anchor*/,
                               const torch::Tensor& rows, const std::shared_ptr<EmbedState>& e) {
    ctx->saved_data["embed"] = c10::IValue::make_capsule(c10::make_intrusive<EmbedHolder>(e));
    return rows;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor& g = grad_outputs[0];
    if (!g.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const std::shared_ptr<EmbedState> e =
        static_cast<EmbedHolder*>(ctx->saved_data["embed"].toCapsule().get())->embed;
    const int64_t d = g.size(-1);
    // Summed per distinct id in float32, as autograd's embedding backward sums repeats.
    torch::Tensor grad = torch::zeros({e->distinct.size(0), d}, torch::kFloat)
                             .index_add_(0, e->inverse.reshape({-1}).cpu(),
                                         g.reshape({-1, d}).to(torch::kCPU, torch::kFloat));
    if (e->scale != 1.0) grad.mul_(e->scale);
    torch::Tensor ids = e->distinct;
    if (e->padding_idx.has_value()) {
      const torch::Tensor keep = (ids != *e->padding_idx).nonzero().reshape({-1});
      ids = ids.index_select(0, keep);
      grad = grad.index_select(0, keep);
    }
    // Only padding ids: nothing to add (the server refuses a gradient for no ids, which would
    // otherwise count a micro-batch), as the Python client skips it.
    if (ids.size(0) == 0) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    State& state = *e->state;
    state.Resilient<EmbeddingGradientResult>(state.spec, [&](const StepSpec& s) {
      return state.client->EmbeddingGradient(
          s.head_id, ids, grad, e->gradient_id,
          {.expected_incarnation = s.expected_incarnation, .expected_weight_version = e->version});
    });
    state.journal->RecordEmbedding(ids, grad, e->gradient_id, e->version);
    return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

absl::StatusOr<RemoteHead> RemoteHead::Attach(std::shared_ptr<Client> client, StepSpec spec,
                                              DataParallel data_parallel, MoveOptions moves) {
  if (client == nullptr) return absl::InvalidArgumentError("client: expected a Client; got null");
  if (spec.head_id.empty())
    return absl::InvalidArgumentError("spec.head_id: expected an id; got \"\"");
  if (!(std::isfinite(spec.upstream_scale) && spec.upstream_scale != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.upstream_scale: expected a finite non-zero value; got ", spec.upstream_scale));
  }
  if (data_parallel.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_parallel.world_size: expected >= 1; got ", data_parallel.world_size));
  }
  if (data_parallel.rank < 0 || data_parallel.rank >= data_parallel.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("data_parallel.rank: expected in [0, ",
                                                   data_parallel.world_size, "); got ",
                                                   data_parallel.rank));
  }
  ASSIGN_OR_RETURN(HeadInfo info, client->DescribeHead(spec.head_id));
  auto state = std::make_shared<State>();
  if (!spec.wire_dtype.has_value()) spec.wire_dtype = info.dtype;  // the server computes in it
  state->trainer = spec.gradient_id.has_value() && !spec.gradient_id->trainer.empty()
                       ? spec.gradient_id->trainer
                       : absl::StrCat("cpp-", std::random_device{}(), "-", std::random_device{}());
  if (data_parallel.world_size > 1) {
    // The ranks' dW go to one accumulator: under a shared identity the server would take a
    // second rank's micro-batch for a replay of the first's and drop it.
    const std::string suffix = absl::StrCat("/rank-", data_parallel.rank);
    if (!absl::EndsWith(state->trainer, suffix)) absl::StrAppend(&state->trainer, suffix);
  }
  state->data_parallel = data_parallel;
  if (spec.gradient_id.has_value()) {
    state->step = spec.gradient_id->step;
    state->micro_batch = spec.gradient_id->micro_batch;
  }
  spec.gradient_id.reset();  // identities are handed out per call
  // Every call is pinned to the server process described here (unless the spec names one): a
  // server that restarted lost the dW of the micro-batches sent before, so a step or an
  // embedding gradient is refused (SERVER_RESTARTED) rather than added to a window it lacks.
  if (spec.expected_incarnation.empty()) spec.expected_incarnation = info.incarnation;
  state->journal = std::make_unique<internal::ReplayJournal>(
      *client, spec.head_id, spec.expected_incarnation, moves.journal);
  state->client = std::move(client);
  state->spec = std::move(spec);
  state->info = std::move(info);
  return RemoteHead(std::move(state));
}

torch::Tensor RemoteHead::loss(const torch::Tensor& hidden, const torch::Tensor& labels,
                               const HeadCall& call) {
  if (state_->spec.reduction == Reduction::kNone) {
    throw StatusError(absl::InvalidArgumentError(
        "spec.reduction: loss() needs a scalar reduction (SUM, MEAN or WEIGHTED_SUM); got NONE — "
        "use token_outputs() for per-token outputs"));
  }
  const bool gradients = torch::GradMode::is_enabled() && hidden.requires_grad();
  auto c = MakeCall(state_, hidden, labels, call, state_->spec.function, gradients,
                    /*two_phase=*/false);
  if (!gradients) {
    // Evaluation: outputs only, nothing accumulated on the server.
    c->inputs.hidden = Rows(hidden);
    ForwardResult r = state_->Resilient<ForwardResult>(
        c->spec, [&](const StepSpec& s) { return state_->client->Forward(s, c->inputs); });
    state_->Record(r.summary);
    return r.outputs.to(torch::TensorOptions(ResultDtype(hidden)).device(hidden.device()));
  }
  return FusedLossFunction::apply(hidden, c);
}

torch::Tensor RemoteHead::token_outputs(const torch::Tensor& hidden, const torch::Tensor& targets,
                                        const HeadCall& call) {
  const bool gradients = torch::GradMode::is_enabled() && hidden.requires_grad();
  auto c = MakeCall(state_, hidden, targets, call, "token_logprobs", gradients,
                    /*two_phase=*/true);
  c->spec.reduction = Reduction::kNone;
  if (!gradients) {
    c->inputs.hidden = Rows(hidden);
    ForwardResult r = state_->Resilient<ForwardResult>(
        c->spec, [&](const StepSpec& s) { return state_->client->Forward(s, c->inputs); });
    state_->Record(r.summary);
    return r.outputs.reshape(c->token_shape).to(hidden.device());
  }
  return TokenOutputsFunction::apply(hidden, c);
}

torch::Tensor RemoteHead::embed(const torch::Tensor& ids, const EmbedCall& call) {
  if (!ids.defined() || ids.scalar_type() != torch::kLong) {
    throw StatusError(absl::InvalidArgumentError(
        absl::StrCat("ids: expected int64 token ids; got ",
                     ids.defined() ? c10::str(ids.scalar_type()) : "none")));
  }
  auto e = std::make_shared<EmbedState>();
  e->state = state_;
  std::tie(e->distinct, e->inverse, std::ignore) =
      torch::_unique2(ids.reshape({-1}).cpu(), /*sorted=*/true, /*return_inverse=*/true);
  e->inverse = e->inverse.reshape(ids.sizes());
  e->padding_idx = call.padding_idx;
  e->scale = call.scale;
  const EmbeddingRows looked_up =
      state_->Resilient<EmbeddingRows>(state_->spec, [&](const StepSpec& s) {
        return state_->client->EmbeddingLookup(s.head_id, e->distinct, call.dtype,
                                               {.expected_incarnation = s.expected_incarnation});
      });
  e->version = looked_up.weight_version;
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(looked_up.rows.size(1));
  torch::Tensor rows = looked_up.rows.index_select(0, e->inverse.reshape({-1})).reshape(shape);
  if (call.scale != 1.0) rows = rows * call.scale;
  rows = rows.to(ids.device());
  if (!(torch::GradMode::is_enabled() && state_->spec.accumulate_weight_grad)) return rows;
  e->gradient_id = state_->NextEmbeddingId(call);
  const torch::Tensor anchor = torch::empty({0}, torch::requires_grad());
  return EmbedFunction::apply(anchor, rows, e);
}

void RemoteHead::BeginStep(int64_t step) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->step = step;
  state_->micro_batch = 0;
  state_->embedding_micro_batch = 0;
}

absl::StatusOr<HeadInfo> RemoteHead::OptimizerStep(const OptimizerStepOptions& options) {
  OptimizerStepOptions resolved = options;
  const DataParallel& dp = state_->data_parallel;
  if (dp.world_size > 1) {
    // Pinned to the version this rank holds: a rank that missed a step (or attached to a head
    // that moved on) makes the ranks disagree, and the server refuses the step rather than
    // apply it to weights some rank's dW was not computed against.
    if (!resolved.expected_weight_version.has_value()) {
      resolved.expected_weight_version = state_->info.weight_version;
    }
    if (!resolved.synchronous.has_value()) {
      resolved.synchronous =
          SynchronousStep{.step = step(), .rank = dp.rank, .world_size = dp.world_size};
    }
  }
  if (resolved.expected_incarnation.empty()) {
    resolved.expected_incarnation = state_->spec.expected_incarnation;
  }
  ASSIGN_OR_RETURN(HeadInfo info, state_->journal->Pinned<HeadInfo>(
                                      resolved.expected_incarnation, state_->info.weight_version,
                                      [&](const std::string& incarnation) {
                                        OptimizerStepOptions pinned = resolved;
                                        pinned.expected_incarnation = incarnation;
                                        return state_->client->OptimizerStep(state_->spec.head_id,
                                                                             pinned);
                                      }));
  state_->journal->Clear();  // applied: nothing of it is resent
  state_->info = info;
  BeginStep(step() + 1);
  return info;
}

StepSummary RemoteHead::last_summary() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->last_summary;
}

int64_t RemoteHead::step() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->step;
}

const HeadInfo& RemoteHead::info() const { return state_->info; }
const StepSpec& RemoteHead::spec() const { return state_->spec; }
const DataParallel& RemoteHead::data_parallel() const { return state_->data_parallel; }
const std::string& RemoteHead::trainer() const { return state_->trainer; }
Client& RemoteHead::client() const { return *state_->client; }
int64_t RemoteHead::journal_calls() const { return state_->journal->calls(); }
int64_t RemoteHead::journal_bytes() const { return state_->journal->bytes(); }

}  // namespace remotehead::client
