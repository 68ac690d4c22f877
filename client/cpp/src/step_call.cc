// The step calls (ForwardBackward, Forward, Backward): each prepared once (prepare_step.h), then
// every attempt streams it — a writer thread sends the header and the rows while the calling
// thread assembles dX / per-token outputs as they arrive, then the summary.
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client_impl.h"
#include "prepare_step.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/core/status_macros.h"
#include "stream.h"

namespace remotehead::client {
namespace {

using internal::FromGrpc;
using internal::PreparedStep;
using internal::PrepareStep;
using internal::ReadStream;
using internal::ResponseRows;

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

using StepStream = grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>;

std::unique_ptr<StepStream> OpenStep(internal::Stub& stub, grpc::ClientContext* context,
                                     core::CallMode mode) {
  switch (mode) {
    case core::CallMode::kFused:
      return stub.ForwardBackward(context);
    case core::CallMode::kForward:
      return stub.Forward(context);
    case core::CallMode::kBackward:
      break;
  }
  return stub.Backward(context);
}

// What a step call streams back, assembled as it arrives.
struct StepReceiver {
  core::CallMode mode;
  std::optional<ResponseRows> dx, out, ids;
  std::map<std::string, ResponseRows> extras;  // StepSpec::token_extras by name
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
      case v1::StepResponse::kTokenIds:
        if (ids) return ids->Add(response.token_ids());
        return absl::InternalError(absl::StrCat(
            "token_ids: not expected from ", core::CallModeName(mode), " of this function"));
      case v1::StepResponse::kTokenExtra: {
        const auto it = extras.find(response.token_extra().name());
        if (it != extras.end()) return it->second.Add(response.token_extra());
        return absl::InternalError(
            absl::StrCat("token_extra: \"", response.token_extra().name(), "\" was not asked for"));
      }
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
    if (ids) RETURN_IF_ERROR(ids->CheckComplete());
    for (const auto& [name, rows] : extras) RETURN_IF_ERROR(rows.CheckComplete());
    return absl::OkStatus();
  }
};

// Buffers for the token extras a step asks for: [N] each, float64 for float64 hidden.
TokenExtras AllocateTokenExtras(const StepSpec& spec, const PreparedStep& p) {
  TokenExtras extras;
  const torch::ScalarType dtype = p.result_dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  for (const std::string& name : spec.token_extras) extras[name] = torch::empty({p.rows}, dtype);
  return extras;
}

}  // namespace

absl::Status Client::Impl::StepAttempt(grpc::ClientContext* context, const PreparedStep& p,
                                       const torch::Tensor& grad_hidden,
                                       const torch::Tensor& outputs, v1::StepSummary* summary,
                                       const torch::Tensor& token_ids,
                                       const TokenExtras& token_extras) {
  const std::unique_ptr<StepStream> stream = OpenStep(*stub, context, p.mode);
  StepReceiver receiver{.mode = p.mode, .summary = summary};
  if (grad_hidden.defined()) receiver.dx.emplace(grad_hidden, "grad_hidden");
  if (outputs.defined()) receiver.out.emplace(outputs, "outputs");
  if (token_ids.defined()) receiver.ids.emplace(token_ids, "token_ids");
  for (const auto& [name, dst] : token_extras) {
    receiver.extras.emplace(name, ResponseRows(dst, absl::StrCat("token_extras[\"", name, "\"]")));
  }

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

absl::StatusOr<ForwardBackwardResult> Client::ForwardBackward(const StepSpec& spec,
                                                              const StepInputs& inputs) {
  ASSIGN_OR_RETURN(const PreparedStep p,
                   PrepareStep(spec, inputs, core::CallMode::kFused, {}, options_.chunk_bytes));
  ForwardBackwardResult result;
  result.grad_hidden = torch::empty({p.rows, p.hidden_size}, p.result_dtype);
  result.token_extras = AllocateTokenExtras(spec, p);
  v1::StepSummary summary;
  RETURN_IF_ERROR(impl_->WithRetries("ForwardBackward", [&](grpc::ClientContext* context) {
    return impl_->StepAttempt(context, p, result.grad_hidden, {}, &summary, {},
                              result.token_extras);
  }));
  result.summary = FromWire(summary);
  result.loss = summary.loss();
  return result;
}

// A per-row Forward's outputs, preallocated as the function's listing says: per-token values
// [N], logits rows [N, V] or a drawn token's log-probability [N] (with token ids [N]), in the
// listed dtype — float64 on a float64 head where the listing says so. A function the server does
// not list gets per-token float32 buffers: the server's refusal of its name is what the caller
// sees.
absl::Status Client::Impl::AllocateForwardOutputs(const StepSpec& spec, const PreparedStep& p,
                                                  ForwardResult* result) {
  ASSIGN_OR_RETURN(const std::optional<FunctionInfo> fn, Function(spec.function));
  const bool float64_head = p.result_dtype == torch::kDouble;
  torch::ScalarType dtype = torch::kFloat;
  if (fn.has_value()) {
    dtype = fn->output_float64_on_float64_heads && float64_head ? torch::kDouble
                                                                : fn->output_dtype;
  }
  if (!fn.has_value() || fn->output_kind == OutputKind::kPerToken) {
    result->outputs = torch::empty({p.rows}, dtype);
    return absl::OkStatus();
  }
  if (fn->output_kind == OutputKind::kSample) {
    result->outputs = torch::empty({p.rows}, dtype);
    result->token_ids = torch::empty({p.rows}, torch::kLong);
    return absl::OkStatus();
  }
  v1::HeadRef ref;
  ref.set_head_id(spec.head_id);
  v1::HeadInfo head;
  RETURN_IF_ERROR(Unary("DescribeHead", &Stub::DescribeHead, ref, &head));
  result->outputs = torch::empty({p.rows, head.vocab_size()}, spec.output_dtype.value_or(dtype));
  return absl::OkStatus();
}

absl::StatusOr<ForwardResult> Client::Forward(const StepSpec& spec, const StepInputs& inputs) {
  ASSIGN_OR_RETURN(const PreparedStep p,
                   PrepareStep(spec, inputs, core::CallMode::kForward, {}, options_.chunk_bytes));
  ForwardResult result;
  const bool per_token = spec.reduction == Reduction::kNone;
  if (per_token) RETURN_IF_ERROR(impl_->AllocateForwardOutputs(spec, p, &result));
  result.token_extras = AllocateTokenExtras(spec, p);
  v1::StepSummary summary;
  RETURN_IF_ERROR(impl_->WithRetries("Forward", [&](grpc::ClientContext* context) {
    return impl_->StepAttempt(context, p, {}, result.outputs, &summary, result.token_ids,
                              result.token_extras);
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
  result.token_extras = AllocateTokenExtras(spec, p);
  v1::StepSummary summary;
  RETURN_IF_ERROR(impl_->WithRetries("Backward", [&](grpc::ClientContext* context) {
    return impl_->StepAttempt(context, p, result.grad_hidden, {}, &summary, {},
                              result.token_extras);
  }));
  result.summary = FromWire(summary);
  return result;
}

}  // namespace remotehead::client
