#include "step/step_session.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "group/group_steps.h"
#include "protocol.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"
#include "step/step_header.h"

namespace remotehead::server {
namespace {

// Rows per engine call: the engine's own chunk size for these options (one GEMM chunk per
// call, no ragged tail), capped at kMaxBatchBytes of X so that compute starts — and dX streams
// back — while later rows are still arriving.
constexpr int64_t kMaxBatchBytes = int64_t{8} << 20;

// Decodes a per-token tensor field if present (an absent message field stays undefined).
absl::Status DecodeOptional(bool present, const v1::Tensor& wire, const std::string& field,
                            torch::Tensor* out) {
  if (!present) return absl::OkStatus();
  ASSIGN_OR_RETURN(*out, wire::DecodeTensorView(wire, field));
  return absl::OkStatus();
}

// Appends the rows of `t` (if defined) as TensorChunk responses of at most `chunk_bytes`,
// numbered from `first_row`, into the response field `field` (grad_hidden or outputs).
absl::Status AppendRowChunks(const torch::Tensor& t, int64_t first_row, int64_t chunk_bytes,
                             v1::TensorChunk* (v1::StepResponse::*field)(),
                             std::vector<v1::StepResponse>* responses) {
  if (!t.defined()) return absl::OkStatus();
  const int64_t bytes_per_row = t.numel() == 0 ? 1 : t.nbytes() / t.size(0);
  for (const auto& [offset, count] : wire::PlanRowChunks(t.size(0), bytes_per_row, chunk_bytes)) {
    v1::StepResponse response;
    v1::TensorChunk* chunk = (response.*field)();
    chunk->set_row_offset(first_row + offset);
    RETURN_IF_ERROR(wire::EncodeTensor(t.narrow(0, offset, count), chunk->mutable_values()));
    responses->push_back(std::move(response));
  }
  return absl::OkStatus();
}

}  // namespace

// [n, D] hidden in the head's dtype with [n] per-token tensors: what can be concatenated.
bool StepSession::WellFormed(const core::TokenBatch& b, const torch::Tensor& grad_output) const {
  if (b.hidden.dim() != 2 || b.hidden.size(1) != plan_.hidden_size ||
      b.hidden.scalar_type() != head_dtype_) {
    return false;
  }
  const int64_t n = b.hidden.size(0);
  auto per_token = [n](const torch::Tensor& t) {
    return !t.defined() || (t.dim() == 1 && t.size(0) == n);
  };
  if (!per_token(b.targets) || !per_token(b.weights) || !per_token(grad_output)) return false;
  for (const auto& [name, t] : b.aux) {
    if (!per_token(t)) return false;
  }
  return true;
}

StepSession::~StepSession() {
  if (!group_open_) return;
  // The other ranks' scratch of a request that failed or was abandoned: freed, not committed.
  // Best effort: a group that is down discards nothing, and has nothing to keep either.
  absl::StatusOr<HeadGroup::Lane> lane = group_->Enter();
  if (!lane.ok()) return;
  lane->Run(StepEndCommand(group_session_, header_->head_id(), /*commit=*/false, std::nullopt,
                           std::nullopt, std::nullopt),
            [] { return absl::OkStatus(); })
      .IgnoreError();
}

absl::Status StepSession::OnRequest(v1::StepRequest request,
                                    std::vector<v1::StepResponse>* responses, bool more_queued) {
  switch (request.part_case()) {
    case v1::StepRequest::kHeader:
      if (header_.has_value()) {
        return absl::InvalidArgumentError("header: expected exactly one header; got a second");
      }
      return OnHeader(request.header());
    case v1::StepRequest::kRows:
      if (!header_.has_value()) {
        return absl::InvalidArgumentError(
            "header: expected the first message to be the header; got rows");
      }
      RETURN_IF_ERROR(
          OnRows(std::make_shared<const v1::StepRequest>(std::move(request)), responses));
      return more_queued ? absl::OkStatus() : FlushPending(pending_rows_, responses);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("part: ForwardBackward expects a header then rows; got message part ",
                       static_cast<int>(request.part_case())));
  }
}

// ----- the header -----

absl::Status StepSession::OnHeader(const v1::StepHeader& header) {
  ASSIGN_OR_RETURN(entry_, registry_->Get(header.head_id()));
  if (group_ != nullptr) {
    shard_ = {.group = &group_->collectives(), .ranges = entry_->shards()};
    options_.shard = &shard_;
    group_session_ = group_->NewSession();
  }
  // The options the header states: the same conversion every rank of a group makes.
  ASSIGN_OR_RETURN(StepHeaderOptions read, ReadStepHeader(header, mode_));
  // This process's own: its shard of a group, and when to stop (set before the header).
  read.options.shard = options_.shard;
  read.options.should_stop = std::move(options_.should_stop);
  options_ = std::move(read.options);
  grad_hidden_dtype_ = read.grad_hidden_dtype;
  // The engine's plan for these options: the function and params resolved once, the chunk
  // size the rows are batched to, and the memory model admission uses.
  ASSIGN_OR_RETURN(plan_, entry_->Read([&](const core::Head& head) {
    device_ = head.device();
    head_dtype_ = head.dtype();
    return core::PlanCall(head, options_);
  }));
  RETURN_IF_ERROR(core::CheckCallMode(plan_, mode_, options_.reduction));
  const int64_t row_bytes = plan_.hidden_size * plan_.head_elem_bytes;
  // What a row returns: dX, or a Forward's outputs (a row of logits is V values).
  const int64_t result_row_bytes =
      std::max<int64_t>(1, mode_ == core::CallMode::kForward ? plan_.output_row_bytes : row_bytes);
  // Every byte count derived from header.rows (EstimateMemory: X in flight twice, the results,
  // the retained inputs) must stay far from overflowing int64, whatever a client declares.
  const int64_t max_rows =
      std::numeric_limits<int64_t>::max() / 8 / (std::max(row_bytes, result_row_bytes) + 64);
  if (header.rows() > max_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rows: expected at most ", max_rows, " (", plan_.hidden_size,
                     " values per row; byte counts of more overflow); got ", header.rows()));
  }
  // Batches stay within kMaxBatchBytes of X and of results.
  batch_rows_ = std::max<int64_t>(1, std::min({plan_.chunk_rows, kMaxBatchBytes / row_bytes,
                                               kMaxBatchBytes / result_row_bytes}));
  if (!header.inputs_handle().empty()) RETURN_IF_ERROR(CheckRetainedInputs(header));
  RETURN_IF_ERROR(CheckVersionAndIdentity(header));
  header_ = header;
  kept_reserved_ =
      header.retain_inputs_seconds() > 0 ? RetainedInputsBytes(plan_, header.rows()) : 0;
  return absl::OkStatus();
}

absl::Status StepSession::CheckRetainedInputs(const v1::StepHeader& header) {
  ASSIGN_OR_RETURN(inputs_, retained_->Get(header.inputs_handle()));
  if (inputs_->head_id != header.head_id()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.inputs_handle: expected a handle from a Forward on head \"",
                     header.head_id(), "\"; got one from head \"", inputs_->head_id, "\""));
  }
  const int64_t retained_rows = inputs_->batch.rows();
  if (header.rows() != retained_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rows: expected the ", retained_rows,
                     " rows retained under header.inputs_handle; got ", header.rows()));
  }
  return absl::OkStatus();
}

// The weights the request expects, and the identity its gradient accumulates under.
absl::Status StepSession::CheckVersionAndIdentity(const v1::StepHeader& header) {
  RETURN_IF_ERROR(CheckIncarnation(header.expected_incarnation(), "header.expected_incarnation",
                                   entry_->Describe()));
  const HeadPin now = entry_->Pin();
  const int64_t version = now.weight_version;
  if (header.has_expected_weight_version() && header.expected_weight_version() != version) {
    HeadDescription head = entry_->Describe();  // only to say what is wrong
    head.weight_version = version;              // the version pinned below
    RETURN_IF_ERROR(CheckWeightVersion(header.expected_weight_version(),
                                       "header.expected_weight_version", head));
  }
  if (inputs_ != nullptr && inputs_->weight_version != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("header.inputs_handle: expected the head to be at the version its Forward ran "
                     "against, ",
                     inputs_->weight_version, "; got version ", version,
                     " (an optimizer step happened in between)"));
  }
  // A request that names its version computes on that version or not at all.
  if (header.has_expected_weight_version() || inputs_ != nullptr) pin_ = now;
  if (!header.accumulate_weight_grad()) return absl::OkStatus();
  if (!header.has_gradient_id() || header.gradient_id().trainer().empty()) {
    return absl::InvalidArgumentError(
        "header.gradient_id: expected a trainer / step / micro_batch identity when "
        "accumulate_weight_grad is set; got none");
  }
  key_ = GradientKey{header.gradient_id().trainer(), header.gradient_id().step(),
                     header.gradient_id().micro_batch()};
  scratch_ = entry_->Read([](const core::Head& head) { return head.NewGradientBuffers(); });
  return absl::OkStatus();
}

MemoryEstimate StepSession::EstimateMemory(int64_t pipeline_bytes) const {
  return StepMemory({.plan = &plan_,
                     .mode = mode_,
                     .rows = header_->rows(),
                     .batch_rows = batch_rows_,
                     .scratch_bytes = key_.has_value() ? scratch_.nbytes() : 0,
                     .pipeline_bytes = pipeline_bytes,
                     .retains_inputs = header_->retain_inputs_seconds() > 0});
}

// ----- rows -----

absl::Status StepSession::OnRows(std::shared_ptr<const v1::StepRequest> message,
                                 std::vector<v1::StepResponse>* responses) {
  const v1::StepRows& rows = message->rows();
  if (rows.row_offset() != received_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("rows.row_offset: expected ", received_rows_,
                                                   " (rows arrive in order); got ",
                                                   rows.row_offset()));
  }
  PendingRows part{.message = message};
  ASSIGN_OR_RETURN(part.grad_output, DecodeGradOutput(rows));
  ASSIGN_OR_RETURN(part.batch, DecodeInputs(rows, part.grad_output));
  // A Backward by handle counts rows by its grad_output (the engine checks its shape).
  const int64_t n = inputs_ == nullptr            ? part.batch.rows()
                    : part.grad_output.dim() >= 1 ? part.grad_output.size(0)
                                                  : 1;
  if (received_rows_ + n > header_->rows()) {
    return absl::InvalidArgumentError(absl::StrCat(
        inputs_ != nullptr ? "rows.grad_output" : "rows", ": expected ", header_->rows(),
        " rows in all (header.rows); got at least ", received_rows_ + n));
  }
  if (inputs_ != nullptr) part.batch = inputs_->batch.Slice(received_rows_, n);
  received_rows_ += n;
  return Enqueue(std::move(part), responses);
}

// dL/dy of each row: required by (and only used by) a Backward with reduction NONE.
absl::StatusOr<torch::Tensor> StepSession::DecodeGradOutput(const v1::StepRows& rows) const {
  if (mode_ != core::CallMode::kBackward || options_.reduction != core::Reduction::kNone) {
    return torch::Tensor();
  }
  if (!rows.has_grad_output()) {
    return absl::InvalidArgumentError(
        "rows.grad_output: Backward with reduction NONE needs dL/dy for every row; got none");
  }
  ASSIGN_OR_RETURN(torch::Tensor g, wire::DecodeTensorView(rows.grad_output(), "rows.grad_output"));
  return g.to(device_);
}

absl::StatusOr<core::TokenBatch> StepSession::DecodeInputs(const v1::StepRows& rows,
                                                           const torch::Tensor& grad_output) const {
  core::TokenBatch batch;
  if (inputs_ != nullptr) {
    if (rows.has_hidden() || rows.has_targets() || rows.has_weights() || rows.aux_size() > 0) {
      return absl::InvalidArgumentError(
          "rows: expected only grad_output (header.inputs_handle supplies hidden, targets, "
          "weights and aux); got input tensors");
    }
    if (!grad_output.defined()) {
      return absl::InvalidArgumentError(
          "rows: expected no rows (a scalar reduction with header.inputs_handle needs none); "
          "got rows");
    }
    return batch;  // sliced from the retained inputs by the caller
  }
  ASSIGN_OR_RETURN(batch.hidden, wire::DecodeTensorView(rows.hidden(), "rows.hidden"));
  RETURN_IF_ERROR(
      DecodeOptional(rows.has_targets(), rows.targets(), "rows.targets", &batch.targets));
  RETURN_IF_ERROR(
      DecodeOptional(rows.has_weights(), rows.weights(), "rows.weights", &batch.weights));
  for (const auto& [name, wire_tensor] : rows.aux()) {
    ASSIGN_OR_RETURN(batch.aux[name],
                     wire::DecodeTensorView(wire_tensor, absl::StrCat("rows.aux[\"", name, "\"]")));
  }
  return batch.To(device_);
}

absl::Status StepSession::Enqueue(PendingRows part, std::vector<v1::StepResponse>* responses) {
  const bool well_formed = WellFormed(part.batch, part.grad_output);
  // A malformed part (e.g. hidden that is not [n, D]) is not batched with others: the engine
  // checks it on its own and reports exactly what is wrong.
  if (!well_formed) {
    RETURN_IF_ERROR(FlushPending(pending_rows_, responses));
    return ComputeRows(std::move(part.batch), part.grad_output, responses);
  }
  // Parts are concatenated only with parts that carry the same inputs.
  if (!pending_.empty() && !pending_.front().batch.SameInputs(part.batch)) {
    RETURN_IF_ERROR(FlushPending(pending_rows_, responses));
  }
  pending_rows_ += part.batch.rows();
  pending_.push_back(std::move(part));
  while (pending_rows_ >= batch_rows_) RETURN_IF_ERROR(FlushPending(batch_rows_, responses));
  return absl::OkStatus();
}

absl::Status StepSession::FlushPending(int64_t rows, std::vector<v1::StepResponse>* responses) {
  if (rows <= 0) return absl::OkStatus();
  std::vector<core::TokenBatch> parts;
  std::vector<torch::Tensor> grads;
  std::vector<std::shared_ptr<const v1::StepRequest>> owners;  // alive until computed
  for (int64_t need = rows; need > 0;) {
    PendingRows& front = pending_.front();
    const int64_t available = front.batch.rows();
    const int64_t take = std::min(available, need);
    parts.push_back(front.batch.Slice(0, take));
    if (front.grad_output.defined()) grads.push_back(front.grad_output.narrow(0, 0, take));
    owners.push_back(front.message);
    if (take == available) {
      pending_.pop_front();
    } else {
      front.batch = front.batch.Slice(take, available - take);
      if (front.grad_output.defined()) {
        front.grad_output = front.grad_output.narrow(0, take, available - take);
      }
    }
    need -= take;
  }
  pending_rows_ -= rows;
  torch::Tensor grad_output;
  if (mode_ == core::CallMode::kBackward) {
    grad_output = options_.reduction != core::Reduction::kNone
                      ? torch::full({}, options_.upstream_scale, torch::kDouble)
                      : torch::cat(grads);
  }
  return ComputeRows(core::TokenBatch::Concat(parts), grad_output, responses);
}

absl::Status StepSession::ComputeRows(core::TokenBatch batch, const torch::Tensor& grad_output,
                                      std::vector<v1::StepResponse>* responses) {
  EngineOutputs results;
  options_.first_row = next_row_;  // bad rows are named by their index in the request
  RETURN_IF_ERROR(Compute(batch, grad_output, &results));
  torch::Tensor& dx = results.grad_hidden;
  if (dx.defined() && grad_hidden_dtype_ && dx.scalar_type() != *grad_hidden_dtype_) {
    dx = dx.to(*grad_hidden_dtype_);
  }
  RETURN_IF_ERROR(AppendRowChunks(dx, next_row_, response_chunk_bytes_,
                                  &v1::StepResponse::mutable_grad_hidden, responses));
  RETURN_IF_ERROR(AppendRowChunks(results.outputs, next_row_, response_chunk_bytes_,
                                  &v1::StepResponse::mutable_outputs, responses));
  RETURN_IF_ERROR(AppendRowChunks(results.token_ids, next_row_, response_chunk_bytes_,
                                  &v1::StepResponse::mutable_token_ids, responses));
  // Owned copies: the batch may alias request messages that are about to be freed. They are
  // bounded by the budget as they arrive: beyond what the estimate reserved (X and targets),
  // admission is asked for more, and the request fails if the budget has none.
  if (header_->retain_inputs_seconds() > 0) {
    kept_rows_.push_back(batch.Clone());
    kept_bytes_ += kept_rows_.back().nbytes();
    if (kept_bytes_ > kept_reserved_) {
      const int64_t more = kept_bytes_ - kept_reserved_;
      if (reserve_more_) {
        RETURN_IF_ERROR(reserve_more_(
            more, absl::StrCat("inputs retained for the Backward: ", kept_bytes_, " bytes after ",
                               next_row_ + batch.rows(), " rows (per-token weights and aux)")));
      }
      kept_reserved_ += more;
    }
  }
  next_row_ += batch.rows();
  return absl::OkStatus();
}

absl::Status StepSession::Compute(const core::TokenBatch& batch, const torch::Tensor& grad_output,
                                  EngineOutputs* results) {
  auto here = [&](const core::Head& head) {
    return ComputeHere(head, batch, grad_output, results);
  };
  // Under the head's lock, on the version the request began with: its weights must not change
  // under a running computation, nor between two of its batches.
  if (group_ == nullptr) return entry_->ReadPinned(&pin_, here);
  // On a group: the lane first (every group operation takes it before any head's lock), then
  // the pin is checked here before any other rank is asked to compute.
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, group_->Enter());
  return entry_->ReadPinned(&pin_, [&](const core::Head& head) {
    const bool accumulate = key_.has_value();
    group_open_ = group_open_ || accumulate;
    return lane.Run(StepBatchCommand(group_session_, *header_, mode_, accumulate, *pin_,
                                     options_.first_row, batch, grad_output),
                    [&]() -> absl::Status {
                      std::vector<torch::Tensor> tensors = BatchTensors(batch, grad_output);
                      RETURN_IF_ERROR(group_->Share(tensors));
                      return here(head);
                    });
  });
}

absl::Status StepSession::ComputeHere(const core::Head& head, const core::TokenBatch& batch,
                                      const torch::Tensor& grad_output, EngineOutputs* results) {
  // One logits buffer for the whole request (a new one per batch would cost page faults),
  // allocated once the request has been admitted.
  if (!options_.logits_workspace.defined() && batch_rows_ > 1 && header_->rows() > 0) {
    options_.logits_workspace =
        core::NewLogitsWorkspace(head, plan_, std::min(batch_rows_, header_->rows()));
  }
  ASSIGN_OR_RETURN(EngineOutputs r, RunEngine(mode_, head, batch, options_, grad_output,
                                              key_ ? &scratch_ : nullptr));
  if (mode_ == core::CallMode::kFused ||
      (mode_ == core::CallMode::kForward && options_.reduction != core::Reduction::kNone)) {
    loss_ += r.loss;
  }
  AddStats(r.stats);
  *results = std::move(r);
  return absl::OkStatus();
}

void StepSession::AddStats(const core::StepStats& stats) {
  valid_tokens_ += stats.valid_tokens;
  chunk_rows_ = std::max(chunk_rows_, stats.chunk_rows);
  num_chunks_ += stats.num_chunks;
  for (const auto& [name, value] : stats.extras) extras_[name] += value;
}

// ----- the end -----

absl::Status StepSession::OnClientDone(std::vector<v1::StepResponse>* responses) {
  if (!header_.has_value()) {
    return absl::InvalidArgumentError("header: expected a header; the stream ended without one");
  }
  RETURN_IF_ERROR(ComputeRemaining(responses));
  RETURN_IF_ERROR(CheckComplete());
  ASSIGN_OR_RETURN(const CommitResult commit, Commit());
  if (inputs_ != nullptr) retained_->Release(header_->inputs_handle());
  v1::StepResponse response;
  v1::StepSummary* summary = response.mutable_summary();
  if (header_->retain_inputs_seconds() > 0) RETURN_IF_ERROR(RetainInputs(commit, summary));
  FillSummary(commit, summary);
  responses->push_back(std::move(response));
  return absl::OkStatus();
}

absl::StatusOr<CommitResult> StepSession::Commit() {
  const std::optional<double> loss =
      mode_ == core::CallMode::kFused ? std::optional<double>(loss_) : std::nullopt;
  auto here = [&] {
    return entry_->Commit({.pin = pin_, .key = key_, .scratch = &scratch_, .loss = loss});
  };
  // Only a request that accumulates changes the other ranks' heads.
  if (group_ == nullptr || !key_.has_value()) return here();
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, group_->Enter());
  absl::StatusOr<CommitResult> result = absl::UnknownError("not run");
  group_open_ = false;  // committed or not, the other ranks let go of the scratch
  RETURN_IF_ERROR(lane.Run(
      StepEndCommand(group_session_, header_->head_id(), /*commit=*/true, pin_, key_, loss),
      [&] {
        result = here();
        return result.status();
      },
      /*local_last=*/true));
  return result;
}

// Whatever is still pending, and — for a scalar Backward by handle, which sends no rows — the
// retained rows, which are then the whole input.
absl::Status StepSession::ComputeRemaining(std::vector<v1::StepResponse>* responses) {
  if (inputs_ != nullptr && options_.reduction != core::Reduction::kNone &&
      received_rows_ < header_->rows()) {
    const int64_t n = header_->rows() - received_rows_;
    pending_.push_back({.batch = inputs_->batch.Slice(received_rows_, n)});
    pending_rows_ += n;
    received_rows_ += n;
  }
  while (pending_rows_ > 0) {
    RETURN_IF_ERROR(FlushPending(std::min(batch_rows_, pending_rows_), responses));
  }
  return absl::OkStatus();
}

absl::Status StepSession::CheckComplete() const {
  if (next_row_ != header_->rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: expected ", header_->rows(), " rows (header.rows); got ", next_row_));
  }
  if (header_->has_valid_tokens() && header_->valid_tokens() != valid_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.valid_tokens: expected the number of targets != ignore_index in the rows, ",
        valid_tokens_, "; got ", header_->valid_tokens()));
  }
  return absl::OkStatus();
}

absl::Status StepSession::RetainInputs(const CommitResult& commit, v1::StepSummary* summary) {
  RetainedInputs kept{.head_id = header_->head_id(),
                      .weight_version = commit.weight_version,
                      .batch = core::TokenBatch::Concat(kept_rows_)};
  kept_rows_.clear();
  if (!kept.batch.hidden.defined()) {  // zero rows
    kept.batch.hidden = entry_->Read([&](const core::Head& head) {
      return torch::empty({0, head.hidden_size()}, head.weight().options());
    });
  }
  ASSIGN_OR_RETURN(std::string handle,
                   retained_->Put(std::move(kept), header_->retain_inputs_seconds()));
  summary->set_inputs_handle(std::move(handle));
  return absl::OkStatus();
}

void StepSession::FillSummary(const CommitResult& commit, v1::StepSummary* summary) {
  // The columns this process computes: its shard's on a head group.
  const int64_t columns = group_ != nullptr ? shard_.mine().rows : plan_.vocab_size;
  logits_chunk_bytes_ = chunk_rows_ * columns * plan_.head_elem_bytes;
  summary->set_replayed(commit.replayed);
  summary->set_weight_version(commit.weight_version);
  summary->set_incarnation(ServerIncarnation());
  summary->set_loss(loss_);
  summary->set_valid_tokens(valid_tokens_);
  summary->set_denominator(options_.normalizer.value_or(1.0));
  summary->set_chunk_rows(chunk_rows_);
  summary->set_num_chunks(num_chunks_);
  for (const auto& [name, value] : extras_) (*summary->mutable_extras())[name] = value;
  *summary->mutable_timings() = timings_;
}

}  // namespace remotehead::server
