#include "remotehead/core/error_reason.h"
#include "remotehead/client/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/core/token_batch.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::client {
namespace {

using Clock = std::chrono::system_clock;
using Stub = v1::HeadService::Stub;

// absl::StatusCode and grpc::StatusCode both follow google.rpc.Code: the code maps 1:1, the
// server's message is kept as it is, and the reason it sent (a google.rpc.ErrorInfo in the
// status details) is attached, for core::ReasonOf / core::GetReason.
absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  v1::RpcStatus details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return result;
  }
  for (const google::protobuf::Any& detail : details.details()) {
    v1::ErrorInfo info;
    if (detail.type_url() != "type.googleapis.com/google.rpc.ErrorInfo" ||
        !info.ParseFromString(detail.value()) || info.domain() != core::kErrorDomain) {
      continue;
    }
    return core::WithReason(std::move(result), info.reason(),
                            {info.metadata().begin(), info.metadata().end()});
  }
  return result;
}

// The server's bytes failed the wire codec's checks: a broken response (INTERNAL), not a bad
// input of the caller's.
absl::Status BrokenResponse(const absl::Status& status) {
  return status.ok() ? status : absl::InternalError(status.message());
}
template <typename T>
absl::StatusOr<T> BrokenResponse(absl::StatusOr<T> result) {
  if (result.ok()) return result;
  return absl::InternalError(result.status().message());
}

// Reads a server stream to its end, handing each message to `handle`. The first error — a
// message `handle` refuses, or (with `finish`) the call's status — is returned; after a refused
// message the call is cancelled and drained, so the stream always ends cleanly. Without
// `finish` the caller calls Finish itself (after joining its writer).
template <typename Response, typename Reader, typename Handle>
absl::Status ReadStream(grpc::ClientContext* context, Reader& reader, Handle&& handle,
                        bool finish = true) {
  Response response;
  absl::Status received;
  while (received.ok() && reader.Read(&response)) received = handle(response);
  if (!received.ok()) {
    context->TryCancel();
    while (reader.Read(&response)) {
    }
  }
  if (!finish) return received;
  const grpc::Status finished = reader.Finish();
  RETURN_IF_ERROR(received);
  return FromGrpc(finished);
}

std::string ShapeOf(const torch::Tensor& t) { return c10::str(t.sizes()); }

// The rows of a result the server streams, assembled by the wire codec; anything it refuses is
// a broken response (INTERNAL).
class ResponseRows {
 public:
  ResponseRows(torch::Tensor dst, std::string field)
      : rows_(std::move(dst), std::move(field), /*convert_dtype=*/true) {}
  absl::Status Add(const v1::TensorChunk& chunk) { return BrokenResponse(rows_.Add(chunk)); }
  absl::Status CheckComplete() const { return BrokenResponse(rows_.CheckComplete()); }

 private:
  wire::RowAssembler rows_;
};

absl::StatusOr<HeadInfo> FromWire(const v1::HeadInfo& wire) {
  HeadInfo info;
  info.head_id = wire.head_id();
  info.vocab_size = wire.vocab_size();
  info.hidden_size = wire.hidden_size();
  ASSIGN_OR_RETURN(info.dtype, BrokenResponse(wire::FromWireDtype(wire.dtype(), "info")));
  info.has_bias = wire.has_bias();
  info.device = wire.device();
  info.weight_version = wire.weight_version();
  info.accumulated_micro_batches = wire.accumulated_micro_batches();
  info.incarnation = wire.incarnation();
  info.state_id = wire.state_id();
  info.group_size = std::max(1, wire.group_size());
  for (const v1::ShardRange& shard : wire.shards()) {
    info.shards.emplace_back(shard.offset(), shard.rows());
  }
  return info;
}

StepSummary FromWire(const v1::StepSummary& wire) {
  StepSummary summary;
  summary.loss = wire.loss();
  summary.valid_tokens = wire.valid_tokens();
  summary.denominator = wire.denominator();
  summary.extras = std::map<std::string, double>(wire.extras().begin(), wire.extras().end());
  summary.weight_version = wire.weight_version();
  summary.replayed = wire.replayed();
  summary.chunk_rows = wire.chunk_rows();
  summary.num_chunks = wire.num_chunks();
  summary.inputs_handle = wire.inputs_handle();
  summary.incarnation = wire.incarnation();
  const v1::StepTimings& t = wire.timings();
  summary.timings = {.queue_seconds = t.queue_seconds(),
                     .receive_wait_seconds = t.receive_wait_seconds(),
                     .compute_seconds = t.compute_seconds(),
                     .send_wait_seconds = t.send_wait_seconds(),
                     .total_seconds = t.total_seconds()};
  return summary;
}

v1::Reduction ToWire(Reduction reduction) {
  switch (reduction) {
    case Reduction::kNone:
      return v1::REDUCTION_NONE;
    case Reduction::kSum:
      return v1::REDUCTION_SUM;
    case Reduction::kWeightedSum:
      return v1::REDUCTION_WEIGHTED_SUM;
    case Reduction::kMean:
      break;
  }
  return v1::REDUCTION_MEAN;
}

absl::Status CheckOptions(const ClientOptions& o) {
  if (o.target.empty()) {
    return absl::InvalidArgumentError("target: expected host:port (or any gRPC target); got \"\"");
  }
  if (!o.bearer_token.empty() && !o.tls.has_value()) {
    return absl::InvalidArgumentError(
        "bearer_token: expected a TLS channel (options.tls) to send a token over; got an "
        "insecure channel");
  }
  if (o.tls.has_value() && o.tls->client_cert_pem.empty() != o.tls->client_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "tls.client_cert_pem, tls.client_key_pem: expected both (mutual TLS) or neither; got "
        "only one");
  }
  const RetryPolicy& r = o.retry;
  if (r.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.max_attempts: expected >= 1; got ", r.max_attempts));
  }
  if (r.initial_backoff.count() < 0 || r.max_backoff < r.initial_backoff) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.initial_backoff, retry.max_backoff: expected 0 <= initial <= max; got ",
                     r.initial_backoff.count(), " ms and ", r.max_backoff.count(), " ms"));
  }
  if (!(r.backoff_multiplier >= 1.0) || !std::isfinite(r.backoff_multiplier)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retry.backoff_multiplier: expected a finite value >= 1; got ", r.backoff_multiplier));
  }
  if (!(r.jitter >= 0.0 && r.jitter < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.jitter: expected a value in [0, 1); got ", r.jitter));
  }
  if (o.deadline.has_value() && o.deadline->count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("deadline: expected > 0 ms when set; got ", o.deadline->count()));
  }
  if (o.chunk_bytes < 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: expected >= 1024; got ", o.chunk_bytes));
  }
  if (o.max_receive_message_bytes <= 0 && o.max_receive_message_bytes != -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_receive_message_bytes: expected > 0 or -1 (no limit); got ",
                     o.max_receive_message_bytes));
  }
  return absl::OkStatus();
}

// A step's inputs in wire layout (CPU, contiguous, wire dtypes), its header and its row plan:
// built once, sent by every attempt.
struct PreparedStep {
  core::CallMode mode = core::CallMode::kFused;
  std::string inputs_handle;  // a Backward by a Forward's retained inputs
  bool by_handle() const { return !inputs_handle.empty(); }
  v1::StepRequest header;
  int64_t rows = 0;
  int64_t hidden_size = 0;
  torch::ScalarType result_dtype = torch::kFloat;  // the caller's hidden dtype: dX comes back in it
  // What travels with the rows; all undefined but grad_output for a Backward by inputs handle.
  torch::Tensor hidden, targets, weights, grad_output;
  std::vector<std::pair<std::string, torch::Tensor>> aux;
  std::vector<wire::RowRange> chunks;

  v1::StepRequest RowsMessage(int64_t offset, int64_t count) const {
    v1::StepRequest message;
    v1::StepRows* r = message.mutable_rows();
    r->set_row_offset(offset);
    if (hidden.defined()) wire::EncodeRows(hidden, offset, count, r->mutable_hidden());
    if (targets.defined()) wire::EncodeRows(targets, offset, count, r->mutable_targets());
    if (weights.defined()) wire::EncodeRows(weights, offset, count, r->mutable_weights());
    if (grad_output.defined()) {
      wire::EncodeRows(grad_output, offset, count, r->mutable_grad_output());
    }
    for (const auto& [name, t] : aux)
      wire::EncodeRows(t, offset, count, &(*r->mutable_aux())[name]);
    return message;
  }
};

// A per-token [N] input: checked, converted to a wire dtype (integers to int64/int32 for
// targets, anything floating kept as it is) and laid out for the wire.
absl::StatusOr<torch::Tensor> PreparePerToken(const torch::Tensor& t, int64_t rows,
                                              const std::string& field, bool integral) {
  if (t.dim() != 1 || t.size(0) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected shape [", rows, "]; got ", ShapeOf(t)));
  }
  const torch::ScalarType dtype = t.scalar_type();
  if (integral) {
    if (!c10::isIntegralType(dtype, /*includeBool=*/false)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": expected integer token ids; got ",
                                                     std::string(c10::toString(dtype))));
    }
    const bool on_wire = dtype == torch::kLong || dtype == torch::kInt;
    return wire::ToWireLayout(t, on_wire ? dtype : torch::kLong);
  }
  if (!c10::isFloatingType(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected a floating tensor; got ",
                                                   std::string(c10::toString(dtype))));
  }
  RETURN_IF_ERROR(wire::ToWireDtype(dtype, field).status());
  return wire::ToWireLayout(t);
}

// Checks the caller's inputs and lays out what travels with the rows. A Backward by inputs
// handle sends none of them (they are not even copied), but its targets still count the valid
// tokens of a MEAN.
absl::Status PrepareInputs(const StepSpec& spec, const StepInputs& inputs, PreparedStep& p) {
  const torch::Tensor& x = inputs.hidden;
  if (!x.defined() || x.dim() != 2 || !c10::isFloatingType(x.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs.hidden: expected a floating [N, D] tensor; got ",
        x.defined() ? absl::StrCat(std::string(c10::toString(x.scalar_type())), " ", ShapeOf(x))
                    : "none"));
  }
  p.rows = x.size(0);
  p.hidden_size = x.size(1);
  p.result_dtype = x.scalar_type();
  const torch::ScalarType send_dtype = spec.wire_dtype.value_or(x.scalar_type());
  RETURN_IF_ERROR(wire::ToWireDtype(send_dtype, "spec.wire_dtype").status());
  RETURN_IF_ERROR(wire::ToWireDtype(p.result_dtype, "inputs.hidden").status());
  if (inputs.targets.defined()) {
    ASSIGN_OR_RETURN(p.targets, PreparePerToken(inputs.targets, p.rows, "inputs.targets", true));
  }
  if (p.by_handle()) return absl::OkStatus();
  p.hidden = wire::ToWireLayout(x, send_dtype);
  if (inputs.weights.defined()) {
    ASSIGN_OR_RETURN(p.weights, PreparePerToken(inputs.weights, p.rows, "inputs.weights", false));
  }
  for (const auto& [name, t] : inputs.aux) {
    ASSIGN_OR_RETURN(torch::Tensor prepared,
                     PreparePerToken(t, p.rows, absl::StrCat("inputs.aux[\"", name, "\"]"), false));
    p.aux.emplace_back(name, std::move(prepared));
  }
  return absl::OkStatus();
}

// The header fields every step call sends: what to compute, how many rows, and the count of
// valid tokens a MEAN without normalizer divides by — the server scales each chunk's dX by it
// before the later rows arrive, so it needs the count up front.
absl::Status WriteHeader(const StepSpec& spec, const PreparedStep& p, v1::StepHeader* h) {
  h->set_head_id(spec.head_id);
  v1::FunctionSpec* fn = h->mutable_function();
  fn->set_name(spec.function);
  for (const auto& [name, value] : spec.params) (*fn->mutable_params())[name] = value;
  fn->set_reduction(ToWire(spec.reduction));
  fn->set_ignore_index(spec.ignore_index);
  if (spec.normalizer.has_value()) fn->set_normalizer(*spec.normalizer);
  h->mutable_chunking()->set_chunk_rows(spec.chunk_rows);
  h->mutable_chunking()->set_memory_budget_bytes(spec.memory_budget_bytes);
  h->set_rows(p.rows);
  if (spec.expected_weight_version.has_value()) {
    h->set_expected_weight_version(*spec.expected_weight_version);
  }
  if (!spec.expected_incarnation.empty()) h->set_expected_incarnation(spec.expected_incarnation);
  if (spec.reduction == Reduction::kMean && !spec.normalizer.has_value()) {
    if (p.by_handle() && !spec.valid_tokens.has_value() && !p.targets.defined()) {
      return absl::InvalidArgumentError(
          "inputs.targets: a Backward by inputs_handle with reduction MEAN and no normalizer "
          "needs the targets (or spec.valid_tokens) to count the valid tokens; got neither");
    }
    h->set_valid_tokens(spec.valid_tokens.has_value()
                            ? *spec.valid_tokens
                            : core::CountValidTokens(p.targets, spec.ignore_index, p.rows));
  }
  if (p.mode == core::CallMode::kForward && spec.retain_inputs_seconds > 0) {
    h->set_retain_inputs_seconds(spec.retain_inputs_seconds);
  }
  if (p.by_handle()) h->set_inputs_handle(spec.inputs_handle);
  return absl::OkStatus();
}

// What a gradient call adds to the header: whether and under which identity dW accumulates,
// dX's dtype, and the upstream gradient — up front for ForwardBackward (upstream_scale); for a
// Backward, dL/dy per row (reduction NONE) or dL/d(loss) as the header's upstream_scale.
absl::Status PrepareGradient(const StepSpec& spec, const torch::Tensor& grad_output,
                             PreparedStep& p, v1::StepHeader* h) {
  if (p.mode == core::CallMode::kForward) return absl::OkStatus();
  h->set_accumulate_weight_grad(spec.accumulate_weight_grad);
  ASSIGN_OR_RETURN(const v1::DType dx_dtype, wire::ToWireDtype(p.result_dtype, "inputs.hidden"));
  h->set_grad_hidden_dtype(dx_dtype);
  if (spec.gradient_id.has_value()) {
    h->mutable_gradient_id()->set_trainer(spec.gradient_id->trainer);
    h->mutable_gradient_id()->set_step(spec.gradient_id->step);
    h->mutable_gradient_id()->set_micro_batch(spec.gradient_id->micro_batch);
  }
  if (p.mode == core::CallMode::kFused) {
    h->set_upstream_scale(spec.upstream_scale);
    return absl::OkStatus();
  }
  if (spec.reduction == Reduction::kNone) {
    if (!grad_output.defined()) {
      return absl::InvalidArgumentError(
          "grad_output: Backward with reduction NONE needs dL/dy for every row; got none");
    }
    ASSIGN_OR_RETURN(p.grad_output,
                     PreparePerToken(grad_output, p.rows, "grad_output", /*integral=*/false));
    return absl::OkStatus();
  }
  if (!grad_output.defined() || grad_output.numel() != 1 ||
      !c10::isFloatingType(grad_output.scalar_type())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_output: expected one floating value (dL/d(loss)) for a scalar reduction; got ",
        grad_output.defined() ? ShapeOf(grad_output) : "none"));
  }
  h->set_upstream_scale(grad_output.item<double>());
  return absl::OkStatus();
}

// Row messages sized on all the bytes of a row — hidden, targets, weights, grad_output, aux —
// plus their framing, so that no message exceeds chunk_bytes.
absl::Status PlanRows(int64_t chunk_bytes, PreparedStep& p) {
  int64_t bytes_per_row =
      p.hidden.defined() ? p.hidden_size * static_cast<int64_t>(p.hidden.element_size()) : 0;
  int64_t tensors = p.hidden.defined() ? 1 : 0, name_bytes = 0;
  for (const torch::Tensor* t : {&p.targets, &p.weights, &p.grad_output}) {
    if (!t->defined()) continue;
    bytes_per_row += t->element_size();
    ++tensors;
  }
  for (const auto& [name, t] : p.aux) {
    bytes_per_row += t.element_size();
    ++tensors;
    name_bytes += static_cast<int64_t>(name.size());
  }
  ASSIGN_OR_RETURN(p.chunks,
                   wire::PlanRequestChunks(p.rows, bytes_per_row,
                                           wire::FramingBytes(tensors, name_bytes), chunk_bytes));
  return absl::OkStatus();
}

absl::StatusOr<PreparedStep> PrepareStep(const StepSpec& spec, const StepInputs& inputs,
                                         core::CallMode mode, const torch::Tensor& grad_output,
                                         int64_t chunk_bytes) {
  PreparedStep p;
  p.mode = mode;
  p.inputs_handle = mode == core::CallMode::kBackward ? spec.inputs_handle : "";
  RETURN_IF_ERROR(PrepareInputs(spec, inputs, p));
  v1::StepHeader* h = p.header.mutable_header();
  RETURN_IF_ERROR(WriteHeader(spec, p, h));
  RETURN_IF_ERROR(PrepareGradient(spec, grad_output, p, h));
  if (p.by_handle()) {
    // The server has the inputs: only dL/dy goes with the rows, and a scalar reduction sends no
    // rows at all.
    p.targets = torch::Tensor();  // read for the valid-token count only
    if (!p.grad_output.defined()) return p;
  }
  RETURN_IF_ERROR(PlanRows(chunk_bytes, p));
  return p;
}

}  // namespace

struct Client::Impl {
  const ClientOptions& options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<Stub> stub;
  std::atomic<int64_t> calls{0}, attempts{0}, retries{0};
  std::mutex rng_mu;
  std::mt19937_64 rng{std::random_device{}()};

  explicit Impl(const ClientOptions& o) : options(o) {}

  std::chrono::milliseconds Jittered(double ms) {
    double factor = 1.0;
    if (options.retry.jitter > 0) {
      std::lock_guard<std::mutex> lock(rng_mu);
      factor = std::uniform_real_distribution<double>(1.0 - options.retry.jitter,
                                                      1.0 + options.retry.jitter)(rng);
    }
    return std::chrono::milliseconds(static_cast<int64_t>(std::llround(ms * factor)));
  }

  // Runs `attempt` until it returns anything but UNAVAILABLE, or the attempts or the deadline
  // run out. `already_done` (optional) is asked before every retry whether the failed attempt
  // took effect after all (for calls that are not idempotent): true ends the call with OK;
  // UNAVAILABLE counts as that attempt's failure.
  using Attempt = std::function<absl::Status(grpc::ClientContext*)>;
  using AlreadyDone = std::function<absl::StatusOr<bool>(grpc::ClientContext*)>;
  absl::Status WithRetries(const char* rpc, const Attempt& attempt,
                           const AlreadyDone& already_done = nullptr) {
    ++calls;
    std::optional<Clock::time_point> deadline;
    if (options.deadline.has_value()) deadline = Clock::now() + *options.deadline;
    double backoff_ms = static_cast<double>(options.retry.initial_backoff.count());
    for (int n = 1;; ++n) {
      ++attempts;
      absl::Status status;
      bool run = true;
      if (n > 1 && already_done) {
        grpc::ClientContext context;
        if (deadline) context.set_deadline(*deadline);
        absl::StatusOr<bool> done = already_done(&context);
        if (done.ok() && *done) return absl::OkStatus();
        if (!done.ok()) {
          status = done.status();
          run = false;
        }
      }
      if (run) {
        grpc::ClientContext context;
        if (deadline) context.set_deadline(*deadline);
        status = attempt(&context);
      }
      if (status.code() != absl::StatusCode::kUnavailable) return status;
      if (n >= options.retry.max_attempts) {
        return absl::UnavailableError(
            absl::StrCat(status.message(), " (", rpc, ": gave up after ", n, " attempts)"));
      }
      const std::chrono::milliseconds wait = Jittered(backoff_ms);
      if (deadline && Clock::now() + wait >= *deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            rpc, ": the deadline of ", options.deadline->count(), " ms leaves no time for attempt ",
            n + 1, "; attempt ", n, " failed with: ", status.message()));
      }
      ++retries;
      if (options.on_retry) options.on_retry({rpc, n, status, wait});
      std::this_thread::sleep_for(wait);
      backoff_ms = std::min(backoff_ms * options.retry.backoff_multiplier,
                            static_cast<double>(options.retry.max_backoff.count()));
    }
  }

  template <typename Request, typename Response>
  absl::Status Unary(const char* rpc,
                     grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                     const Request& request, Response* response) {
    return WithRetries(rpc, [&](grpc::ClientContext* context) {
      response->Clear();
      return FromGrpc((stub.get()->*method)(context, request, response));
    });
  }

  using StepStream = grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>;

  std::unique_ptr<StepStream> OpenStep(grpc::ClientContext* context, core::CallMode mode) {
    switch (mode) {
      case core::CallMode::kFused:
        return stub->ForwardBackward(context);
      case core::CallMode::kForward:
        return stub->Forward(context);
      case core::CallMode::kBackward:
        break;
    }
    return stub->Backward(context);
  }

  // What a step call streams back, assembled as it arrives.
  struct StepReceiver {
    core::CallMode mode;
    std::optional<ResponseRows> dx, out;
    v1::StepSummary* summary;
    bool have_summary = false;

    absl::Status Add(const v1::StepResponse& response) {
      switch (response.part_case()) {
        case v1::StepResponse::kGradHidden:
          if (dx) return dx->Add(response.grad_hidden());
          return absl::InternalError(
              absl::StrCat("grad_hidden: not expected from ", core::CallModeName(mode)));
        case v1::StepResponse::kOutputs:
          if (out) return out->Add(response.outputs());
          return absl::InternalError(absl::StrCat(
              "outputs: not expected from ", core::CallModeName(mode), " with a scalar reduction"));
        case v1::StepResponse::kSummary:
          *summary = response.summary();
          have_summary = true;
          return absl::OkStatus();
        default:
          return absl::InternalError("response: the server sent an empty message");
      }
    }

    absl::Status CheckComplete() const {
      if (!have_summary) return absl::InternalError("summary: the stream ended without one");
      if (dx) RETURN_IF_ERROR(dx->CheckComplete());
      if (out) RETURN_IF_ERROR(out->CheckComplete());
      return absl::OkStatus();
    }
  };

  // One attempt of a step call: a writer thread sends the header and the row chunks while this
  // thread assembles the streamed dX / outputs; then the summary. `grad_hidden` / `outputs`
  // (preallocated, or undefined when the call returns none) are overwritten by every attempt.
  absl::Status StepAttempt(grpc::ClientContext* context, const PreparedStep& p,
                           const torch::Tensor& grad_hidden, const torch::Tensor& outputs,
                           v1::StepSummary* summary) {
    const std::unique_ptr<StepStream> stream = OpenStep(context, p.mode);
    StepReceiver receiver{.mode = p.mode, .summary = summary};
    if (grad_hidden.defined()) receiver.dx.emplace(grad_hidden, "grad_hidden");
    if (outputs.defined()) receiver.out.emplace(outputs, "outputs");

    // A failed Write means the call is over (the server finished it, or it was cancelled):
    // Finish below reports why.
    std::thread writer([&] {
      try {
        if (!stream->Write(p.header)) return;
        for (const auto& [offset, count] : p.chunks) {
          if (!stream->Write(p.RowsMessage(offset, count))) return;
        }
        stream->WritesDone();
      } catch (...) {
        context->TryCancel();  // e.g. out of memory building a message: the reader sees CANCELLED
      }
    });
    // A response the receiver refuses cancels the call; the stream is then drained.
    const absl::Status received = ReadStream<v1::StepResponse>(
        context, *stream, [&](const v1::StepResponse& r) { return receiver.Add(r); },
        /*finish=*/false);
    writer.join();
    const grpc::Status finished = stream->Finish();
    RETURN_IF_ERROR(received);
    RETURN_IF_ERROR(FromGrpc(finished));
    return receiver.CheckComplete();
  }

  // The shape and dtype of a head, read inside an attempt (with that attempt's deadline) before
  // its weights or gradients are streamed into preallocated tensors.
  absl::StatusOr<v1::HeadInfo> DescribeForStream(const grpc::ClientContext& attempt_context,
                                                 const std::string& head_id) {
    grpc::ClientContext context;
    context.set_deadline(attempt_context.deadline());
    v1::HeadRef ref;
    ref.set_head_id(head_id);
    v1::HeadInfo info;
    RETURN_IF_ERROR(FromGrpc(stub->DescribeHead(&context, ref, &info)));
    return info;
  }
};

Client::Client(ClientOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}

Client::~Client() = default;

absl::StatusOr<std::shared_ptr<Client>> Client::Create(ClientOptions options) {
  RETURN_IF_ERROR(CheckOptions(options));
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  grpc::ChannelArguments args;
  if (options.tls.has_value()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls->root_certs_pem;
    ssl.pem_private_key = options.tls->client_key_pem;
    ssl.pem_cert_chain = options.tls->client_cert_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.bearer_token.empty()) {
      credentials = grpc::CompositeChannelCredentials(
          credentials, grpc::AccessTokenCredentials(options.bearer_token));
    }
    if (!options.tls->server_name_override.empty()) {
      args.SetSslTargetNameOverride(options.tls->server_name_override);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  // While the server is unreachable, calls fail at once with UNAVAILABLE until the channel's
  // next reconnection attempt; gRPC's default first reconnection comes after 1 s. Pacing the
  // channel like our retries lets a retry find a server that came back in between.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::max<int64_t>(options.retry.initial_backoff.count(), 1)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::max<int64_t>(options.retry.max_backoff.count(), 1)));
  std::shared_ptr<Client> client(new Client(std::move(options), nullptr));
  client->impl_ = std::make_unique<Impl>(client->options_);
  client->impl_->channel = grpc::CreateCustomChannel(client->options_.target, credentials, args);
  client->impl_->stub = v1::HeadService::NewStub(client->impl_->channel);
  return client;
}

ClientStats Client::stats() const {
  return {.calls = impl_->calls.load(),
          .attempts = impl_->attempts.load(),
          .retries = impl_->retries.load()};
}

absl::StatusOr<HeadInfo> Client::CreateHead(const std::string& head_id, const InitSpec& init) {
  v1::CreateHeadRequest request;
  request.set_head_id(head_id);
  ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(init.dtype, "init.dtype"));
  request.set_dtype(dtype);
  v1::CreateHeadRequest::FromInit* wire_init = request.mutable_init();
  wire_init->set_vocab_size(init.vocab_size);
  wire_init->set_hidden_size(init.hidden_size);
  wire_init->set_bias(init.bias);
  wire_init->set_seed(init.seed);
  wire_init->set_init_std(init.init_std);
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->Unary("CreateHead", &Stub::CreateHead, request, &info));
  return FromWire(info);
}

absl::StatusOr<HeadInfo> Client::CreateHead(const std::string& head_id,
                                            const SafetensorsSource& source) {
  v1::CreateHeadRequest request;
  request.set_head_id(head_id);
  if (source.dtype.has_value()) {
    ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(*source.dtype, "source.dtype"));
    request.set_dtype(dtype);
  }
  request.mutable_safetensors()->set_path(source.path);
  request.mutable_safetensors()->set_weight_name(source.weight_name);
  request.mutable_safetensors()->set_bias_name(source.bias_name);
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->Unary("CreateHead", &Stub::CreateHead, request, &info));
  return FromWire(info);
}

absl::StatusOr<HeadInfo> Client::UploadHead(const std::string& head_id, const torch::Tensor& weight,
                                            const torch::Tensor& bias) {
  if (!weight.defined() || weight.dim() != 2 || !c10::isFloatingType(weight.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight: expected a floating [V, D] tensor; got ",
                     weight.defined() ? ShapeOf(weight) : "none"));
  }
  ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(weight.scalar_type(), "weight"));
  const int64_t vocab = weight.size(0);
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != vocab)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bias: expected shape [", vocab, "]; got ", ShapeOf(bias)));
  }
  const torch::Tensor w = wire::ToWireLayout(weight);
  // The server stores the bias in the head's (weight's) dtype.
  const torch::Tensor b = bias.defined() ? wire::ToWireLayout(bias, w.scalar_type()) : bias;
  ASSIGN_OR_RETURN(const auto weight_chunks,
                   wire::PlanRequestChunks(vocab, w.size(1) * w.element_size(),
                                           wire::FramingBytes(1, 0), options_.chunk_bytes));
  std::vector<wire::RowRange> bias_chunks;
  if (b.defined()) {
    ASSIGN_OR_RETURN(bias_chunks,
                     wire::PlanRequestChunks(vocab, b.element_size(), wire::FramingBytes(1, 0),
                                             options_.chunk_bytes));
  }
  v1::UploadHeadRequest header;
  header.mutable_header()->set_head_id(head_id);
  header.mutable_header()->set_vocab_size(vocab);
  header.mutable_header()->set_hidden_size(w.size(1));
  header.mutable_header()->set_dtype(dtype);
  header.mutable_header()->set_has_bias(b.defined());
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->WithRetries("UploadHead", [&](grpc::ClientContext* context) {
    info.Clear();
    auto writer = impl_->stub->UploadHead(context, &info);
    bool ok = writer->Write(header);
    for (const auto& [offset, count] : weight_chunks) {
      if (!ok) break;
      v1::UploadHeadRequest m;
      m.mutable_weight_rows()->set_row_offset(offset);
      wire::EncodeRows(w, offset, count, m.mutable_weight_rows()->mutable_values());
      ok = writer->Write(m);
    }
    for (const auto& [offset, count] : bias_chunks) {
      if (!ok) break;
      v1::UploadHeadRequest m;
      m.mutable_bias_rows()->set_row_offset(offset);
      wire::EncodeRows(b, offset, count, m.mutable_bias_rows()->mutable_values());
      ok = writer->Write(m);
    }
    if (ok) writer->WritesDone();
    return FromGrpc(writer->Finish());
  }));
  return FromWire(info);
}

absl::StatusOr<HeadInfo> Client::DescribeHead(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::HeadInfo info;
  RETURN_IF_ERROR(impl_->Unary("DescribeHead", &Stub::DescribeHead, ref, &info));
  return FromWire(info);
}

absl::StatusOr<std::vector<HeadInfo>> Client::ListHeads() {
  v1::ListHeadsResponse response;
  RETURN_IF_ERROR(impl_->Unary("ListHeads", &Stub::ListHeads, v1::ListHeadsRequest(), &response));
  std::vector<HeadInfo> heads;
  for (const v1::HeadInfo& wire_info : response.heads()) {
    ASSIGN_OR_RETURN(HeadInfo info, FromWire(wire_info));
    heads.push_back(std::move(info));
  }
  return heads;
}

absl::Status Client::DropHead(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::DropHeadResponse response;
  return impl_->Unary("DropHead", &Stub::DropHead, ref, &response);
}

absl::StatusOr<HeadWeights> Client::ExportWeights(const std::string& head_id,
                                                  std::optional<torch::ScalarType> dtype,
                                                  const ExportPin& pin) {
  v1::ExportWeightsRequest request;
  request.set_head_id(head_id);
  request.set_expected_incarnation(pin.expected_incarnation);
  if (pin.expected_weight_version.has_value()) {
    request.set_expected_weight_version(*pin.expected_weight_version);
  }
  if (dtype.has_value()) {
    ASSIGN_OR_RETURN(const v1::DType wire_dtype, wire::ToWireDtype(*dtype, "dtype"));
    request.set_dtype(wire_dtype);
  }
  HeadWeights weights;
  RETURN_IF_ERROR(
      impl_->WithRetries("ExportWeights", [&](grpc::ClientContext* context) -> absl::Status {
        ASSIGN_OR_RETURN(const v1::HeadInfo wire_info, impl_->DescribeForStream(*context, head_id));
        ASSIGN_OR_RETURN(const HeadInfo info, FromWire(wire_info));
        const torch::ScalarType out = dtype.value_or(info.dtype);
        weights.weight = torch::empty({info.vocab_size, info.hidden_size}, out);
        weights.bias = info.has_bias ? torch::empty({info.vocab_size}, out) : torch::Tensor();
        ResponseRows w(weights.weight, "weight_rows"), b(weights.bias, "bias_rows");
        auto reader = impl_->stub->ExportWeights(context, request);
        RETURN_IF_ERROR(ReadStream<v1::ExportWeightsResponse>(
            context, *reader, [&](const v1::ExportWeightsResponse& response) {
              if (response.has_weight_rows()) return w.Add(response.weight_rows());
              if (response.has_bias_rows() && info.has_bias) return b.Add(response.bias_rows());
              return absl::InternalError("response: expected weight_rows or bias_rows");
            }));
        RETURN_IF_ERROR(w.CheckComplete());
        if (info.has_bias) RETURN_IF_ERROR(b.CheckComplete());
        return absl::OkStatus();
      }));
  return weights;
}

absl::StatusOr<int64_t> Client::SaveWeights(const std::string& head_id, const std::string& path,
                                            const std::string& weight_name,
                                            const std::string& bias_name) {
  v1::SaveWeightsRequest request;
  request.set_head_id(head_id);
  request.set_path(path);
  request.set_weight_name(weight_name);
  request.set_bias_name(bias_name);
  v1::SaveWeightsResponse response;
  RETURN_IF_ERROR(impl_->Unary("SaveWeights", &Stub::SaveWeights, request, &response));
  return response.bytes_written();
}

absl::StatusOr<HeadGradients> Client::FetchGradients(const std::string& head_id,
                                                     std::optional<torch::ScalarType> dtype) {
  v1::FetchGradientsRequest request;
  request.set_head_id(head_id);
  if (dtype.has_value()) {
    ASSIGN_OR_RETURN(const v1::DType wire_dtype, wire::ToWireDtype(*dtype, "dtype"));
    request.set_dtype(wire_dtype);
  }
  HeadGradients grads;
  RETURN_IF_ERROR(
      impl_->WithRetries("FetchGradients", [&](grpc::ClientContext* context) -> absl::Status {
        ASSIGN_OR_RETURN(const v1::HeadInfo wire_info, impl_->DescribeForStream(*context, head_id));
        ASSIGN_OR_RETURN(const HeadInfo described, FromWire(wire_info));
        // The server accumulates in float32 unless asked for another dtype.
        const torch::ScalarType out = dtype.value_or(torch::kFloat);
        grads.weight_grad = torch::empty({described.vocab_size, described.hidden_size}, out);
        grads.bias_grad =
            described.has_bias ? torch::empty({described.vocab_size}, out) : torch::Tensor();
        ResponseRows w(grads.weight_grad, "weight_grad_rows"), b(grads.bias_grad, "bias_grad_rows");
        auto reader = impl_->stub->FetchGradients(context, request);
        bool have_info = false;
        RETURN_IF_ERROR(ReadStream<v1::FetchGradientsResponse>(
            context, *reader, [&](const v1::FetchGradientsResponse& response) -> absl::Status {
              if (response.has_weight_grad_rows()) return w.Add(response.weight_grad_rows());
              if (response.has_bias_grad_rows() && described.has_bias) {
                return b.Add(response.bias_grad_rows());
              }
              if (!response.has_info()) {
                return absl::InternalError(
                    "response: expected weight_grad_rows, bias_grad_rows or info");
              }
              ASSIGN_OR_RETURN(grads.info, FromWire(response.info()));
              have_info = true;
              return absl::OkStatus();
            }));
        RETURN_IF_ERROR(w.CheckComplete());
        if (described.has_bias) RETURN_IF_ERROR(b.CheckComplete());
        if (!have_info) return absl::InternalError("info: the stream ended without one");
        return absl::OkStatus();
      }));
  return grads;
}

absl::StatusOr<HeadInfo> Client::ZeroGradients(const std::string& head_id) {
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::ZeroGradientsResponse response;
  RETURN_IF_ERROR(impl_->Unary("ZeroGradients", &Stub::ZeroGradients, ref, &response));
  return FromWire(response.info());
}

absl::StatusOr<HeadInfo> Client::OptimizerStep(const std::string& head_id,
                                               const OptimizerStepOptions& options) {
  v1::OptimizerStepRequest request;
  request.set_head_id(head_id);
  if (const Sgd* sgd = std::get_if<Sgd>(&options.optimizer)) {
    request.mutable_sgd()->set_lr(sgd->lr);
    request.mutable_sgd()->set_momentum(sgd->momentum);
    request.mutable_sgd()->set_weight_decay(sgd->weight_decay);
  } else {
    const AdamW& adamw = std::get<AdamW>(options.optimizer);
    request.mutable_adamw()->set_lr(adamw.lr);
    request.mutable_adamw()->set_beta1(adamw.beta1);
    request.mutable_adamw()->set_beta2(adamw.beta2);
    request.mutable_adamw()->set_eps(adamw.eps);
    request.mutable_adamw()->set_weight_decay(adamw.weight_decay);
  }
  if (options.grad_scale.has_value()) request.set_grad_scale(*options.grad_scale);
  request.set_zero_gradients(options.zero_gradients);
  request.set_expected_incarnation(options.expected_incarnation);
  if (options.expected_weight_version.has_value()) {
    request.set_expected_weight_version(*options.expected_weight_version);
  }
  if (options.synchronous.has_value()) {
    v1::SynchronousStep* sync = request.mutable_synchronous();
    sync->set_step(options.synchronous->step);
    sync->set_rank(options.synchronous->rank);
    sync->set_world_size(options.synchronous->world_size);
  }

  v1::OptimizerStepResponse response;
  Impl::AlreadyDone already_done;
  int64_t version_before = 0;
  // A synchronous step needs no check before a retry: the server answers a retry of a step it
  // applied with that step's own HeadInfo, the same as every rank got — which a DescribeHead
  // after the fact is not (the other ranks may have added the next step's dW meanwhile).
  if (options_.retry.max_attempts > 1 && !options.synchronous.has_value()) {
    ASSIGN_OR_RETURN(const HeadInfo before, DescribeHead(head_id));
    version_before = before.weight_version;
    already_done = [&](grpc::ClientContext* context) -> absl::StatusOr<bool> {
      v1::HeadRef ref;
      ref.set_head_id(head_id);
      v1::HeadInfo now;
      RETURN_IF_ERROR(FromGrpc(impl_->stub->DescribeHead(context, ref, &now)));
      if (now.weight_version() <= version_before) return false;
      *response.mutable_info() = now;
      return true;
    };
  }
  RETURN_IF_ERROR(impl_->WithRetries(
      "OptimizerStep",
      [&](grpc::ClientContext* context) {
        response.Clear();
        return FromGrpc(impl_->stub->OptimizerStep(context, request, &response));
      },
      already_done));
  return FromWire(response.info());
}

absl::StatusOr<ForwardBackwardResult> Client::ForwardBackward(const StepSpec& spec,
                                                              const StepInputs& inputs) {
  ASSIGN_OR_RETURN(const PreparedStep p,
                   PrepareStep(spec, inputs, core::CallMode::kFused, {}, options_.chunk_bytes));
  ForwardBackwardResult result;
  result.grad_hidden = torch::empty({p.rows, p.hidden_size}, p.result_dtype);
  v1::StepSummary summary;
  RETURN_IF_ERROR(impl_->WithRetries("ForwardBackward", [&](grpc::ClientContext* context) {
    return impl_->StepAttempt(context, p, result.grad_hidden, {}, &summary);
  }));
  result.summary = FromWire(summary);
  result.loss = summary.loss();
  return result;
}

absl::StatusOr<ForwardResult> Client::Forward(const StepSpec& spec, const StepInputs& inputs) {
  ASSIGN_OR_RETURN(const PreparedStep p,
                   PrepareStep(spec, inputs, core::CallMode::kForward, {}, options_.chunk_bytes));
  ForwardResult result;
  const bool per_token = spec.reduction == Reduction::kNone;
  // The server computes per-token outputs in float32 (float64 for a float64 head).
  const torch::ScalarType out = p.result_dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  if (per_token) result.outputs = torch::empty({p.rows}, out);
  v1::StepSummary summary;
  RETURN_IF_ERROR(impl_->WithRetries("Forward", [&](grpc::ClientContext* context) {
    return impl_->StepAttempt(context, p, {}, result.outputs, &summary);
  }));
  result.summary = FromWire(summary);
  if (!per_token) result.outputs = torch::tensor(summary.loss(), torch::kDouble);
  return result;
}

absl::StatusOr<BackwardResult> Client::Backward(const StepSpec& spec, const StepInputs& inputs,
                                                const torch::Tensor& grad_output) {
  ASSIGN_OR_RETURN(const PreparedStep p, PrepareStep(spec, inputs, core::CallMode::kBackward,
                                                     grad_output, options_.chunk_bytes));
  BackwardResult result;
  result.grad_hidden = torch::empty({p.rows, p.hidden_size}, p.result_dtype);
  v1::StepSummary summary;
  RETURN_IF_ERROR(impl_->WithRetries("Backward", [&](grpc::ClientContext* context) {
    return impl_->StepAttempt(context, p, result.grad_hidden, {}, &summary);
  }));
  result.summary = FromWire(summary);
  return result;
}

}  // namespace remotehead::client
