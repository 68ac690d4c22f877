// The step calls (ForwardBackward, Forward, Backward; step_caller.h): each prepared once
// (prepare_step.h), then every attempt streams it — a writer thread sends the header and the rows
// while the calling thread assembles dX / per-token outputs as they arrive, then the summary.
#include "step_caller.h"

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prepare_step.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/row_buffer.h"
#include "remotehead/wire/split_rows.h"
#include "step_frames.h"
#include "stream.h"

namespace remotehead::client::internal {
namespace {

StepSummary SummaryFromWire(const v1::StepSummary& wire) {
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
        return absl::InternalError(absl::StrCat("token_ids: not expected from ",
                                                core::CallModeName(mode), " of this function"));
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

  // A response as it arrived, taken by one of the call's readers: a dX chunk's rows copied from
  // the bytes received straight into dX (split_rows.h), only the bookkeeping under `mu` (the
  // readers copy their rows side by side); anything else parsed whole and added under `mu`.
  absl::Status AddRaw(grpc::ByteBuffer& bytes, std::mutex& mu) {
    std::vector<grpc::Slice> slices;
    std::vector<wire::BytePiece> pieces;
    if (dx && wire::ReceivedPieces(bytes, &slices, &pieces)) {
      ASSIGN_OR_RETURN(const bool taken, TakeDxRows(pieces, mu));
      if (taken) return absl::OkStatus();
    }
    v1::StepResponse response;
    if (!grpc::SerializationTraits<v1::StepResponse>::Deserialize(&bytes, &response).ok()) {
      return absl::InternalError("response: the server sent bytes that do not parse");
    }
    std::lock_guard<std::mutex> lock(mu);
    return Add(response);
  }

  // A dX chunk's rows from `pieces` straight into dX: false where the response is not one this
  // takes so (another part; values of another dtype than dX's, or bytes other than their shape's)
  // and is parsed whole instead.
  absl::StatusOr<bool> TakeDxRows(const std::vector<wire::BytePiece>& pieces, std::mutex& mu) {
    const std::optional<wire::SplitTensor> split = wire::SplitTensorData(
        pieces, {v1::StepResponse::kGradHiddenFieldNumber, v1::TensorChunk::kValuesFieldNumber},
        v1::Tensor::kDataFieldNumber);
    v1::StepResponse head;
    if (!split.has_value() || !head.ParseFromString(split->rest) ||
        head.part_case() != v1::StepResponse::kGradHidden) {
      return false;
    }
    const absl::StatusOr<torch::ScalarType> dtype =
        wire::CheckTensor(head.grad_hidden().values(), split->data_size, "grad_hidden.values");
    if (!dtype.ok() || *dtype != dx->tensor().scalar_type()) return false;
    torch::Tensor rows;
    {
      std::lock_guard<std::mutex> lock(mu);
      ASSIGN_OR_RETURN(rows, dx->Claim(head.grad_hidden(), *dtype));
    }
    wire::CopyBytes(pieces, split->data_offset, split->data_size,
                    static_cast<char*>(rows.data_ptr()));
    return true;
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

// The dX buffer of a ForwardBackward or a Backward: [N, D] in the caller's hidden dtype.
absl::Status AllocateGradHidden(const PreparedStep& p, StepBuffers* buffers) {
  buffers->grad_hidden = wire::EmptyRows({p.rows, p.hidden_size}, p.result_dtype);
  return absl::OkStatus();
}

// Buffers for the token extras a step asks for: [N] each, float64 for float64 hidden.
TokenExtras AllocateTokenExtras(const StepSpec& spec, const PreparedStep& p) {
  TokenExtras extras;
  const torch::ScalarType dtype = p.result_dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  for (const std::string& name : spec.token_extras) extras[name] = torch::empty({p.rows}, dtype);
  return extras;
}

// Each stream's first message: stream 0's is the step's header, the others' state only their
// stripe (StepHeader.stripe) — with the number of the `messages` rows messages (dealt j mod
// count) each carries, so that the server knows a complete stream from a cancelled one; one
// stream sends the header as it is.
std::vector<v1::StepRequest> StripeHeaders(const v1::StepRequest& header, int count,
                                           const std::string& key, int64_t messages) {
  std::vector<v1::StepRequest> headers(count);
  headers[0] = header;
  if (count == 1) return headers;
  for (int i = 0; i < count; ++i) {
    v1::StripeSpec* stripe = headers[i].mutable_header()->mutable_stripe();
    stripe->set_key(key);
    stripe->set_count(count);
    stripe->set_index(i);
    stripe->set_messages(messages > i ? (messages - i + count - 1) / count : 0);
  }
  return headers;
}

// The failure a striped attempt reports: the first that is not the CANCELLED of a stream the
// failure of another ended, else the first.
absl::Status FirstFailure(const std::vector<absl::Status>& statuses) {
  const absl::Status* first = nullptr;
  for (const absl::Status& s : statuses) {
    if (s.ok()) continue;
    if (s.code() != absl::StatusCode::kCancelled) return s;
    if (first == nullptr) first = &s;
  }
  return first == nullptr ? absl::OkStatus() : *first;
}

}  // namespace

std::string StepCaller::StripeKey() {
  if (channel_.options().streams == 1) return "";
  std::lock_guard<std::mutex> lock(rng_mu_);
  return absl::StrCat(absl::Hex(rng_(), absl::kZeroPad16), absl::Hex(rng_(), absl::kZeroPad16));
}

absl::Status StepCaller::Attempt(grpc::ClientContext* context, const PreparedStep& p,
                                 const StepBuffers& buffers, v1::StepSummary* summary) {
  const int count = channel_.options().streams;
  const auto order =
      count == 1 ? wire::RowAssembler::Order::kInOrder : wire::RowAssembler::Order::kAnyOrder;
  StepReceiver receiver{.mode = p.mode, .summary = summary};
  if (buffers.grad_hidden.defined()) receiver.dx.emplace(buffers.grad_hidden, "grad_hidden", order);
  if (buffers.outputs.defined()) receiver.out.emplace(buffers.outputs, "outputs", order);
  if (buffers.token_ids.defined()) receiver.ids.emplace(buffers.token_ids, "token_ids", order);
  for (const auto& [name, dst] : buffers.token_extras) {
    receiver.extras.emplace(name,
                            ResponseRows(dst, absl::StrCat("token_extras[\"", name, "\"]"), order));
  }

  // Stream i's context: the attempt's, or one with its deadline.
  std::vector<std::unique_ptr<grpc::ClientContext>> own(count);
  std::vector<grpc::ClientContext*> contexts(count, context);
  for (int i = 1; i < count; ++i) {
    own[i] = std::make_unique<grpc::ClientContext>();
    if (context->deadline() != std::chrono::system_clock::time_point::max()) {
      own[i]->set_deadline(context->deadline());
    }
    contexts[i] = own[i].get();
  }
  // The front this trainer dials now, kept for the attempt (another call may move the client).
  const std::shared_ptr<const Front> front = channel_.front();
  std::vector<std::unique_ptr<StepStream>> streams;
  for (int i = 0; i < count; ++i) {
    streams.push_back(OpenStep(front->stream(i), contexts[i], p.mode));
  }
  const std::vector<v1::StepRequest> headers =
      StripeHeaders(p.header, count, StripeKey(), std::ssize(p.chunks));
  auto cancel_all = [&] {
    for (grpc::ClientContext* c : contexts) c->TryCancel();
  };

  // A failed Write means the call is over (the server finished it, or it was cancelled):
  // Finish below reports why. Row message j goes on stream j mod count.
  std::vector<std::thread> writers;
  for (int i = 0; i < count; ++i) {
    writers.emplace_back([&, i] {
      try {
        if (!streams[i]->Write(Framed(headers[i]))) return;
        for (size_t j = static_cast<size_t>(i); j < p.chunks.size(); j += count) {
          if (!streams[i]->Write(Framed(p.RowsFrames(p.chunks[j].offset, p.chunks[j].count)))) {
            return;
          }
        }
        streams[i]->WritesDone();
      } catch (...) {
        cancel_all();  // e.g. out of memory building a message: the readers see CANCELLED
      }
    });
  }
  // A response the receiver refuses cancels every stream; each is then drained.
  std::mutex receiver_mu;
  std::vector<absl::Status> received(count);
  auto read = [&](int i) {
    received[i] = ReadStream<RawResponse>(
        contexts[i], *streams[i],
        [&](RawResponse& r) { return receiver.AddRaw(r.bytes, receiver_mu); },
        /*finish=*/false);
    if (!received[i].ok()) cancel_all();
  };
  std::vector<std::thread> readers;
  for (int i = 1; i < count; ++i) readers.emplace_back(read, i);
  read(0);
  for (std::thread& t : readers) t.join();
  for (std::thread& t : writers) t.join();
  std::vector<absl::Status> finished;
  for (int i = 0; i < count; ++i) finished.push_back(FromGrpc(streams[i]->Finish()));
  for (const absl::Status& s : received) RETURN_IF_ERROR(s);
  RETURN_IF_ERROR(FirstFailure(finished));
  return receiver.CheckComplete();
}

absl::StatusOr<StepResults> StepCaller::Run(core::CallMode mode, const StepSpec& spec,
                                            const StepInputs& inputs,
                                            const torch::Tensor& grad_output,
                                            const AllocateStepBuffers& allocate) {
  // Whether the rows that contribute nothing stay here is the function's, as the server lists
  // it (read only when some row could be left out).
  bool compact = false;
  if (spec.compact_rows && inputs.targets.defined()) {
    ASSIGN_OR_RETURN(const std::optional<FunctionInfo> fn, functions_.Find(spec.function));
    compact = fn.has_value() && fn->ignored_rows_contribute_nothing;
  }
  // A Backward by a handle leaves out what its Forward left out (nothing when that Forward left
  // out nothing or was not this client's).
  const std::string by_handle = mode == core::CallMode::kBackward ? spec.inputs_handle : "";
  std::optional<HandleRows> keep;
  if (!by_handle.empty()) {
    compact = false;
    keep = RowsOfHandle(by_handle);
  }
  ASSIGN_OR_RETURN(
      const PreparedStep p,
      PrepareStep(spec, inputs, mode, grad_output, channel_.options().chunk_bytes, compact,
                  keep ? keep->kept : torch::Tensor(), keep ? keep->rows : 0));
  StepBuffers buffers;
  RETURN_IF_ERROR(allocate(p, &buffers));
  buffers.token_extras = AllocateTokenExtras(spec, p);
  v1::StepSummary summary;
  // The server names a row among the rows sent; the caller knows its own rows. At this trainer's
  // own front, which the call follows when the mesh moves the trainer (REPLICA_MOVED).
  RETURN_IF_ERROR(p.CallerError(channel_.AtOwnFront(
      core::CallModeName(mode), spec.head_id,
      [&](grpc::ClientContext* context) { return Attempt(context, p, buffers, &summary); })));
  // The rows left out: zeros in the caller's rows.
  for (torch::Tensor* t : {&buffers.grad_hidden, &buffers.outputs, &buffers.token_ids}) {
    *t = p.Expand(*t);
  }
  for (auto& [name, t] : buffers.token_extras) t = p.Expand(t);
  AfterStep(p, summary.inputs_handle(), by_handle);
  return StepResults{.buffers = std::move(buffers), .summary = SummaryFromWire(summary)};
}

std::optional<StepCaller::HandleRows> StepCaller::RowsOfHandle(const std::string& handle) {
  std::lock_guard<std::mutex> lock(handle_rows_mu_);
  const auto it = handle_rows_.find(handle);
  if (it == handle_rows_.end()) return std::nullopt;
  return it->second;
}

void StepCaller::AfterStep(const PreparedStep& p, const std::string& handle,
                           const std::string& backward_by_handle) {
  std::lock_guard<std::mutex> lock(handle_rows_mu_);
  if (!backward_by_handle.empty()) handle_rows_.erase(backward_by_handle);
  if (handle.empty() || !p.kept.defined()) return;
  handle_rows_[handle] = {.kept = p.kept, .rows = p.caller_rows};
  handle_order_.push_back(handle);
  while (handle_order_.size() > kMaxHandleRows) {
    handle_rows_.erase(handle_order_.front());
    handle_order_.pop_front();
  }
}

// A per-row Forward's outputs, preallocated as the function's listing says: per-token values
// [N], logits rows [N, V] or a drawn token's log-probability [N] (with token ids [N]), in the
// listed dtype — float64 on a float64 head where the listing says so. A function the server does
// not list gets per-token float32 buffers: the server's refusal of its name is what the caller
// sees.
absl::Status StepCaller::AllocateForwardOutputs(const StepSpec& spec, const PreparedStep& p,
                                                StepBuffers* buffers) {
  ASSIGN_OR_RETURN(const std::optional<FunctionInfo> fn, functions_.Find(spec.function));
  const bool float64_head = p.result_dtype == torch::kDouble;
  torch::ScalarType dtype = torch::kFloat;
  if (fn.has_value()) {
    dtype = fn->output_float64_on_float64_heads && float64_head ? torch::kDouble : fn->output_dtype;
  }
  if (!fn.has_value() || fn->output_kind == OutputKind::kPerToken) {
    buffers->outputs = torch::empty({p.rows}, dtype);
    return absl::OkStatus();
  }
  if (fn->output_kind == OutputKind::kSample) {
    buffers->outputs = torch::empty({p.rows}, dtype);
    buffers->token_ids = torch::empty({p.rows}, torch::kLong);
    return absl::OkStatus();
  }
  v1::HeadRef ref;
  ref.set_head_id(spec.head_id);
  v1::HeadInfo head;
  RETURN_IF_ERROR(channel_.Unary("DescribeHead", &Stub::DescribeHead, ref, &head));
  buffers->outputs = torch::empty({p.rows, head.vocab_size()}, spec.output_dtype.value_or(dtype));
  return absl::OkStatus();
}

absl::StatusOr<ForwardBackwardResult> StepCaller::ForwardBackward(const StepSpec& spec,
                                                                  const StepInputs& inputs) {
  ASSIGN_OR_RETURN(StepResults r,
                   Run(core::CallMode::kFused, spec, inputs, {}, AllocateGradHidden));
  return ForwardBackwardResult{.loss = r.summary.loss,
                               .grad_hidden = std::move(r.buffers.grad_hidden),
                               .summary = std::move(r.summary),
                               .token_extras = std::move(r.buffers.token_extras)};
}

absl::StatusOr<ForwardResult> StepCaller::Forward(const StepSpec& spec, const StepInputs& inputs) {
  // Only a per-row Forward streams outputs back; a scalar one returns its summary's loss.
  const bool per_token = spec.reduction == Reduction::kNone;
  auto allocate = [&](const PreparedStep& p, StepBuffers* buffers) {
    return per_token ? AllocateForwardOutputs(spec, p, buffers) : absl::OkStatus();
  };
  ASSIGN_OR_RETURN(StepResults r, Run(core::CallMode::kForward, spec, inputs, {}, allocate));
  ForwardResult result{.outputs = std::move(r.buffers.outputs),
                       .token_ids = std::move(r.buffers.token_ids),
                       .summary = std::move(r.summary),
                       .token_extras = std::move(r.buffers.token_extras)};
  if (!per_token) result.outputs = torch::tensor(result.summary.loss, torch::kDouble);
  return result;
}

absl::StatusOr<BackwardResult> StepCaller::Backward(const StepSpec& spec, const StepInputs& inputs,
                                                    const torch::Tensor& grad_output) {
  ASSIGN_OR_RETURN(StepResults r,
                   Run(core::CallMode::kBackward, spec, inputs, grad_output, AllocateGradHidden));
  return BackwardResult{.grad_hidden = std::move(r.buffers.grad_hidden),
                        .summary = std::move(r.summary),
                        .token_extras = std::move(r.buffers.token_extras)};
}

}  // namespace remotehead::client::internal
