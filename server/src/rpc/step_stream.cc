#include "rpc/step_stream.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/frames.h"
#include "remotehead/wire/tensor_codec.h"
#include "replication/group_steps.h"
#include "translate/step_header.h"

namespace remotehead::server {
namespace {

// Decodes a tensor field if present (an absent message field stays undefined): a view of the
// message's bytes.
absl::Status DecodeOptional(bool present, const v1::Tensor& wire, const std::string& field,
                            torch::Tensor* out) {
  if (!present) return absl::OkStatus();
  ASSIGN_OR_RETURN(*out, wire::DecodeTensorView(wire, field));
  return absl::OkStatus();
}

// The rows of a message, as views of its bytes (which the result keeps alive) — hidden where it
// was staged, if it was.
absl::StatusOr<StepRowsIn> ReadRows(std::shared_ptr<const v1::StepRequest> message,
                                    bool hidden_staged) {
  const v1::StepRows& rows = message->rows();
  StepRowsIn in{.row_offset = rows.row_offset()};
  core::TokenBatch& batch = in.batch;
  RETURN_IF_ERROR(DecodeOptional(rows.has_hidden() && !hidden_staged, rows.hidden(), "rows.hidden",
                                 &batch.hidden));
  RETURN_IF_ERROR(
      DecodeOptional(rows.has_targets(), rows.targets(), "rows.targets", &batch.targets));
  RETURN_IF_ERROR(
      DecodeOptional(rows.has_weights(), rows.weights(), "rows.weights", &batch.weights));
  for (const auto& [name, wire_tensor] : rows.aux()) {
    ASSIGN_OR_RETURN(batch.aux[name],
                     wire::DecodeTensorView(wire_tensor, absl::StrCat("rows.aux[\"", name, "\"]")));
  }
  RETURN_IF_ERROR(DecodeOptional(rows.has_grad_output(), rows.grad_output(), "rows.grad_output",
                                 &in.grad_output));
  RETURN_IF_ERROR(DecodeOptional(rows.has_teacher_hidden(), rows.teacher_hidden(),
                                 "rows.teacher_hidden", &batch.teacher_hidden));
  in.owner = std::move(message);
  return in;
}

// A message's rows as the session takes them: one part per staged piece of hidden (a message
// whose rows fall in two batches was staged in two buffers), its other tensors sliced alike.
absl::StatusOr<std::vector<StepRowsIn>> RowsOf(InboundRequest request) {
  const bool staged = !request.staged.empty();
  ASSIGN_OR_RETURN(
      StepRowsIn rows,
      ReadRows(std::make_shared<const v1::StepRequest>(std::move(request.message)), staged));
  if (!staged) return std::vector<StepRowsIn>{std::move(rows)};
  int64_t staged_rows = 0;
  for (const StagedHidden& piece : request.staged) staged_rows += piece.hidden.size(0);
  // Another tensor of the message with other rows than hidden's: hidden put together again, so
  // that the session names the mismatch.
  bool sized_alike = true;
  auto check = [&](const torch::Tensor& t) {
    sized_alike &= !t.defined() || (t.dim() >= 1 && t.size(0) == staged_rows);
  };
  for (const torch::Tensor* t :
       {&rows.batch.targets, &rows.batch.weights, &rows.batch.teacher_hidden, &rows.grad_output}) {
    check(*t);
  }
  for (const auto& [name, t] : rows.batch.aux) check(t);
  if (request.staged.size() == 1 || !sized_alike) {
    std::vector<torch::Tensor> pieces;
    for (const StagedHidden& piece : request.staged) pieces.push_back(piece.hidden);
    rows.batch.hidden = pieces.size() == 1 ? pieces.front() : torch::cat(pieces);
    return std::vector<StepRowsIn>{std::move(rows)};
  }
  std::vector<StepRowsIn> parts;
  for (StagedHidden& piece : request.staged) {
    const int64_t at = piece.first_row - rows.row_offset, n = piece.hidden.size(0);
    StepRowsIn part{.row_offset = piece.first_row, .owner = rows.owner};
    part.batch = rows.batch.Slice(at, n);
    part.batch.hidden = std::move(piece.hidden);
    if (rows.grad_output.defined()) part.grad_output = rows.grad_output.narrow(0, at, n);
    parts.push_back(std::move(part));
  }
  return parts;
}

// The rows of `t` (if defined) as chunk responses of at most `chunk_bytes`, numbered from
// `first_row`, each made by `chunk` (which sets its offset and names) around its values: the
// values' dtype and shape in the message, their bytes left where they lie in `t` (on the host:
// a device's result comes over once, whole, not chunk by chunk, on the device's outbound copy
// stream — core/device_transfer.h — which the compute thread does not wait for).
template <typename Chunk>
absl::Status AppendRowChunks(const torch::Tensor& t, int64_t first_row, int64_t chunk_bytes,
                             Chunk&& chunk, std::vector<StepResponseOut>* responses) {
  if (!t.defined()) return absl::OkStatus();
  RETURN_IF_ERROR(wire::ToWireDtype(t.scalar_type(), "result").status());
  const core::HostCopy copy = core::HostCopy::Start(t);
  const torch::Tensor& host = copy.host();
  const int64_t bytes_per_row = host.numel() == 0 ? 1 : host.nbytes() / host.size(0);
  for (const auto& [offset, count] :
       wire::PlanRowChunks(host.size(0), bytes_per_row, chunk_bytes)) {
    StepResponseOut out;
    v1::Tensor* values = chunk(&out.message, first_row + offset);
    out.bytes = wire::EncodeRowsHead(host, offset, count, values);
    out.rows = host;
    out.landing = copy;
    responses->push_back(std::move(out));
  }
  return absl::OkStatus();
}

// A rows chunk of the response field `field` (grad_hidden, outputs or token_ids).
auto TensorChunkOf(v1::TensorChunk* (v1::StepResponse::*field)()) {
  return [field](v1::StepResponse* response, int64_t row_offset) {
    v1::TensorChunk* chunk = (response->*field)();
    chunk->set_row_offset(row_offset);
    return chunk->mutable_values();
  };
}

// A chunk of one per-token diagnostic (StepHeader.token_extras).
auto TokenExtraOf(const std::string& name) {
  return [&name](v1::StepResponse* response, int64_t row_offset) {
    v1::TokenExtraChunk* chunk = response->mutable_token_extra();
    chunk->set_name(name);
    chunk->set_row_offset(row_offset);
    return chunk->mutable_values();
  };
}

// The pipeline's timings as the summary reports them.
v1::StepTimings TimingsToWire(const CallTimings& timings) {
  v1::StepTimings t;
  t.set_queue_seconds(timings.phases.queue);
  t.set_receive_wait_seconds(timings.phases.receive);
  t.set_compute_seconds(timings.phases.compute);
  t.set_send_wait_seconds(timings.phases.send);
  t.set_total_seconds(timings.total_seconds);
  return t;
}

}  // namespace

StepStream::StepStream(ServiceContext* service, core::CallMode mode, CallHooks hooks)
    : StepStream(service->registry, &service->retained, mode, service->options.response_chunk_bytes,
                 service->options.group) {
  metrics_ = service->options.metrics;
  session_.set_reserve_more(std::move(hooks.reserve_more));
  session_.set_should_stop(std::move(hooks.should_stop));
  session_.set_fused_blocks(service->options.fused_blocks);
}

absl::Status StepStream::OnRequest(InboundRequest request,
                                   std::vector<StepResponseOut>* responses) {
  switch (request.message.part_case()) {
    case v1::StepRequest::kHeader:
      return OnHeader(request.message.header());
    case v1::StepRequest::kRows: {
      if (!session_.has_begun()) {
        return absl::InvalidArgumentError(
            "header: expected the first message to be the header; got rows");
      }
      ASSIGN_OR_RETURN(std::vector<StepRowsIn> parts, RowsOf(std::move(request)));
      for (StepRowsIn& rows : parts) {
        RETURN_IF_ERROR(session_.AddRows(std::move(rows), SinkInto(responses)));
      }
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("part: ForwardBackward expects a header then rows; got message part ",
                       static_cast<int>(request.message.part_case())));
  }
}

absl::Status StepStream::OnHeader(const v1::StepHeader& header) {
  if (session_.has_begun()) {
    return absl::InvalidArgumentError("header: expected exactly one header; got a second");
  }
  // The options the header states: the same conversion every rank of a group makes.
  ASSIGN_OR_RETURN(StepCall call, ReadStepHeader(header, mode_));
  std::unique_ptr<StepFanout> fanout;
  if (group_ != nullptr) fanout = std::make_unique<GroupStepFront>(group_, header);
  return session_.Begin(std::move(call), std::move(fanout));
}

absl::Status StepStream::OnClientDone(std::vector<StepResponseOut>* responses) {
  if (!session_.has_begun()) {
    return absl::InvalidArgumentError("header: expected a header; the stream ended without one");
  }
  ASSIGN_OR_RETURN(const StepOutcome outcome, session_.Finish(SinkInto(responses)));
  StepResponseOut response;
  ToWire(outcome, response.message.mutable_summary());
  *response.message.mutable_summary()->mutable_timings() = TimingsToWire(timings_);
  responses->push_back(std::move(response));
  return absl::OkStatus();
}

StepResultSink StepStream::SinkInto(std::vector<StepResponseOut>* responses) const {
  return [this, responses](StepRowResults r) -> absl::Status {
    RETURN_IF_ERROR(AppendRowChunks(r.grad_hidden, r.first_row, response_chunk_bytes_,
                                    TensorChunkOf(&v1::StepResponse::mutable_grad_hidden),
                                    responses));
    RETURN_IF_ERROR(AppendRowChunks(r.outputs, r.first_row, response_chunk_bytes_,
                                    TensorChunkOf(&v1::StepResponse::mutable_outputs), responses));
    RETURN_IF_ERROR(AppendRowChunks(r.token_ids, r.first_row, response_chunk_bytes_,
                                    TensorChunkOf(&v1::StepResponse::mutable_token_ids),
                                    responses));
    for (const auto& [name, values] : r.token_extras) {
      RETURN_IF_ERROR(AppendRowChunks(values, r.first_row, response_chunk_bytes_,
                                      TokenExtraOf(name), responses));
    }
    return absl::OkStatus();
  };
}

absl::Status StepStream::Decode(grpc::ByteBuffer* bytes, InboundRequest* into) {
  std::vector<grpc::Slice> slices;
  std::vector<wire::BytePiece> pieces;
  if (wire::ReceivedPieces(*bytes, &slices, &pieces)) {
    try {
      if (staging_.Decode(pieces, &into->message, &into->staged)) return absl::OkStatus();
    } catch (const std::exception&) {
      // A staging buffer not had (memory): the request is parsed whole, as without staging.
    }
  }
  into->staged.clear();
  into->message.Clear();
  return ParseFirst(bytes, &into->message);
}

void StepStream::Complete(const CallTimings& timings) const {
  if (metrics_ == nullptr) return;
  metrics_->ObserveStep(std::string(core::CallModeName(mode_)), session_.head_id(),
                        session_.function(), session_.valid_tokens(), timings.phases,
                        session_.logits_chunk_bytes());
}

absl::Status StepStream::ParseFirst(grpc::ByteBuffer* bytes, v1::StepRequest* into) {
  const grpc::Status parsed = grpc::SerializationTraits<v1::StepRequest>::Deserialize(bytes, into);
  if (parsed.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "request: expected a serialized remotehead.v1.StepRequest; got bytes that do not parse (",
      parsed.error_message(), ")"));
}

StripeOf StepStream::StripeAsSent(const v1::StepRequest& first) {
  const v1::StripeSpec& stripe = first.header().stripe();
  return StripeOf{.key = stripe.key(), .count = stripe.count(), .index = stripe.index()};
}

absl::StatusOr<StripeOf> StepStream::ReadStripe(const v1::StepRequest& first) {
  if (!first.has_header() || !first.header().has_stripe()) return StripeOf{};
  const v1::StripeSpec& stripe = first.header().stripe();
  if (stripe.count() < 0 || stripe.count() > kMaxStripes) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripe.count: expected 0 to ", kMaxStripes, "; got ", stripe.count()));
  }
  const int count = std::max(stripe.count(), 1);
  if (stripe.index() < 0 || stripe.index() >= count) {
    return absl::InvalidArgumentError(absl::StrCat("header.stripe.index: expected 0 to ", count - 1,
                                                   " (stripe.count ", stripe.count(), "); got ",
                                                   stripe.index()));
  }
  if (count == 1) return StripeOf{};
  if (stripe.key().empty() || stripe.key().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripe.key: expected 1 to 128 bytes naming the step's streams; got ",
                     stripe.key().size()));
  }
  if (stripe.index() > 0) {
    v1::StepHeader rest = first.header();
    rest.clear_stripe();
    if (rest.ByteSizeLong() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header: stream ", stripe.index(), " of a striped step states only its stripe (stream ",
          "0 carries the header); got ", rest.ShortDebugString()));
    }
  }
  if (stripe.has_messages() && stripe.messages() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripe.messages: expected >= 0 (the rows messages of stream ",
                     stripe.index(), "); got ", stripe.messages()));
  }
  StripeOf of{.key = stripe.key(), .count = count, .index = stripe.index()};
  if (stripe.has_messages()) of.messages = stripe.messages();
  return of;
}

absl::StatusOr<int64_t> StepStream::StripedRowOffset(const InboundRequest& request,
                                                     const std::string& stream) {
  const v1::StepRequest& message = request.message;
  if (message.part_case() != v1::StepRequest::kRows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "part: ", stream, " of a striped step carries rows after its header; got ",
        message.part_case() == v1::StepRequest::kHeader ? "a second header" : "an empty message"));
  }
  return message.rows().row_offset();
}

grpc::ByteBuffer StepStream::Serialize(const StepResponseOut& response) {
  return wire::ToByteBuffer(response.Frames());
}

}  // namespace remotehead::server
