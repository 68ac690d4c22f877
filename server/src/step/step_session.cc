#include "step/step_session.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "remotehead/core/device_transfer.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/core/status_macros.h"
#include "service/head_expectations.h"
#include "step/step_teacher.h"

namespace remotehead::server {

RowLayout StepSession::row_layout() const {
  return {.call_rows = call_.rows,
          .batch_rows = batcher_.batch_rows(),
          .width = plan_.hidden_size,
          .dtype = head_dtype_,
          .device = device_,
          .teacher_width = teacher_.entry != nullptr ? teacher_.hidden_size : -1,
          .teacher_dtype = teacher_.dtype};
}

absl::Status StepSession::Begin(StepCall call, std::unique_ptr<StepFanout> fanout) {
  ASSIGN_OR_RETURN(entry_, registry_->Get(call.head_id));
  if (call.accumulate_weight_grad && entry_->frozen()) {
    return HeadFrozenError(call.head_id, "header.accumulate_weight_grad", "accumulating dW");
  }
  // This process's own options: when to stop (set before or after Begin), fused blocks, shard.
  call.options.should_stop = std::move(options_.should_stop);
  call.options.fused_blocks = options_.fused_blocks;
  // The loss of each batch stays on the device until the summary reads their sum once: no batch
  // waits for the device to finish its work (on a GPU, the next batch's rows are copied in and
  // the last batch's dX copied out meanwhile).
  call.options.loss_on_device = true;
  call_ = std::move(call);
  fanout_ = std::move(fanout);
  if (fanout_ != nullptr) options_.shard = fanout_->Shard(entry_->shards());
  ASSIGN_OR_RETURN(teacher_, PlanTeacher(*registry_, *entry_, call_.teacher_head_id));
  RETURN_IF_ERROR(PlanBatches());
  if (!call_.inputs_handle.empty()) RETURN_IF_ERROR(CheckRetainedInputs());
  RETURN_IF_ERROR(CheckVersionAndIdentity());
  begun_ = true;
  kept_reserved_ = call_.retain_inputs_seconds > 0
                       ? RetainedInputsBytes(plan_, call_.rows, teacher_.row_bytes)
                       : 0;
  compaction_ = RowCompaction::For(plan_, mode_, options_, call_.grad_hidden_dtype, head_dtype_);
  return absl::OkStatus();
}

// The engine's plan for these options: the function and params resolved once, the chunk size
// the rows are batched to, and the memory model admission uses.
absl::Status StepSession::PlanBatches() {
  // With the teacher set: the engine's memory model counts its logits too.
  auto plan = [&](const core::Head& head, const core::Head* teacher) {
    device_ = head.device();
    head_dtype_ = head.dtype();
    options_.teacher = teacher;
    return core::PlanCall(head, options_);
  };
  ASSIGN_OR_RETURN(plan_, entry_->ReadWith(teacher_.entry.get(), plan));
  RETURN_IF_ERROR(core::CheckCallMode(plan_, mode_, options_.reduction));
  // What a row brings: X, and a two-head call's teacher hidden states.
  const int64_t row_bytes = plan_.hidden_size * plan_.head_elem_bytes + teacher_.row_bytes;
  // What a row returns: dX, or a Forward's outputs (a row of logits is V values).
  const int64_t result_row_bytes =
      std::max<int64_t>(1, mode_ == core::CallMode::kForward ? plan_.output_row_bytes : row_bytes);
  // Every byte count derived from the rows (EstimateMemory: X in flight twice, the results,
  // the retained inputs) must stay far from overflowing int64, whatever a client declares.
  const int64_t max_rows =
      std::numeric_limits<int64_t>::max() / 8 / (std::max(row_bytes, result_row_bytes) + 64);
  if (call_.rows > max_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rows: expected at most ", max_rows, " (", plan_.hidden_size,
                     " values per row; byte counts of more overflow); got ", call_.rows));
  }
  batcher_.set_batch_rows(BatchRows(plan_, call_.rows, row_bytes, result_row_bytes));
  return absl::OkStatus();
}

absl::Status StepSession::CheckRetainedInputs() {
  ASSIGN_OR_RETURN(inputs_, retained_->Get(call_.inputs_handle));
  if (inputs_->head_id != call_.head_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.inputs_handle: expected a handle from a Forward on head \"",
                     call_.head_id, "\"; got one from head \"", inputs_->head_id, "\""));
  }
  const int64_t retained_rows = inputs_->batch.rows();
  if (call_.rows != retained_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rows: expected the ", retained_rows,
                     " rows retained under header.inputs_handle; got ", call_.rows));
  }
  if (inputs_->teacher_head_id != call_.teacher_head_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.teacher_head_id: expected \"", inputs_->teacher_head_id,
                     "\", the teacher of the Forward that retained header.inputs_handle; got \"",
                     call_.teacher_head_id, "\""));
  }
  if (teacher_.entry != nullptr && inputs_->teacher_version != teacher_.version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.inputs_handle: expected teacher head \"", call_.teacher_head_id,
        "\" at the version its Forward ran against, ", inputs_->teacher_version, "; got version ",
        teacher_.version, " (its weights were replaced in between)"));
  }
  return absl::OkStatus();
}

// The weights the request expects, and the identity its gradient accumulates under.
absl::Status StepSession::CheckVersionAndIdentity() {
  RETURN_IF_ERROR(CheckIncarnation(call_.expected_incarnation, "header.expected_incarnation",
                                   entry_->Describe()));
  const HeadPin now = entry_->Pin();
  const int64_t version = now.weight_version;
  if (call_.expected_weight_version.has_value() && *call_.expected_weight_version != version) {
    HeadDescription head = entry_->Describe();  // only to say what is wrong
    head.weight_version = version;              // the version pinned below
    RETURN_IF_ERROR(
        CheckWeightVersion(call_.expected_weight_version, "header.expected_weight_version", head));
  }
  if (inputs_ != nullptr && inputs_->weight_version != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("header.inputs_handle: expected the head to be at the version its Forward ran "
                     "against, ",
                     inputs_->weight_version, "; got version ", version,
                     " (an optimizer step happened in between)"));
  }
  // A request that names its version computes on that version or not at all.
  if (call_.expected_weight_version.has_value() || inputs_ != nullptr) pin_ = now;
  if (!call_.accumulate_weight_grad) return absl::OkStatus();
  if (!call_.gradient.has_value()) {
    return absl::InvalidArgumentError(
        "header.gradient_id: expected a trainer / step / micro_batch identity when "
        "accumulate_weight_grad is set; got none");
  }
  scratch_ = entry_->Read([](const core::Head& head) { return head.NewGradientBuffers(); });
  return absl::OkStatus();
}

MemoryEstimate StepSession::EstimateMemory(int64_t pipeline_bytes) const {
  return StepMemory({.plan = &plan_,
                     .mode = mode_,
                     .rows = call_.rows,
                     .batch_rows = batcher_.batch_rows(),
                     .scratch_bytes = call_.gradient.has_value() ? scratch_.nbytes() : 0,
                     .pipeline_bytes = pipeline_bytes,
                     .retains_inputs = call_.retain_inputs_seconds > 0,
                     .teacher_row_bytes = teacher_.row_bytes});
}

// ----- rows -----

absl::Status StepSession::AddRows(StepRowsIn rows, const StepResultSink& sink) {
  if (rows.row_offset != received_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("rows.row_offset: expected ", received_rows_,
                                                   " (rows arrive in order); got ",
                                                   rows.row_offset));
  }
  RowBatcher::Part part{.owner = rows.owner};
  ASSIGN_OR_RETURN(part.grad_output, GradOutputOf(rows));
  ASSIGN_OR_RETURN(part.batch, InputsOf(rows, part.grad_output));
  // A Backward by handle counts rows by its grad_output (the engine checks its shape).
  const int64_t n = inputs_ == nullptr            ? part.batch.rows()
                    : part.grad_output.dim() >= 1 ? part.grad_output.size(0)
                                                  : 1;
  if (received_rows_ + n > call_.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(inputs_ != nullptr ? "rows.grad_output" : "rows", ": expected ", call_.rows,
                     " rows in all (header.rows); got at least ", received_rows_ + n));
  }
  if (inputs_ != nullptr) part.batch = inputs_->batch.Slice(received_rows_, n);
  const int64_t first_row = received_rows_;
  received_rows_ += n;
  RETURN_IF_ERROR(Enqueue(std::move(part), first_row, sink));
  // The batcher computed every full batch; the last, ragged one waits for the call's last row.
  return received_rows_ < call_.rows ? absl::OkStatus() : FlushReceived(sink);
}

absl::Status StepSession::FlushReceived(const StepResultSink& sink) {
  RETURN_IF_ERROR(batcher_.Flush(batcher_.pending_rows(), ComputeBatch(sink)));
  std::optional<StepRowResults> zeros = compaction_.FillTo(received_rows_);
  if (!zeros.has_value()) return absl::OkStatus();
  next_row_ = compaction_.given_back();
  return sink(*std::move(zeros));
}

// dL/dy of each row: required by (and only used by) a Backward with reduction NONE.
absl::StatusOr<torch::Tensor> StepSession::GradOutputOf(const StepRowsIn& rows) const {
  if (mode_ != core::CallMode::kBackward || options_.reduction != core::Reduction::kNone) {
    return torch::Tensor();
  }
  if (!rows.grad_output.defined()) {
    return absl::InvalidArgumentError(
        "rows.grad_output: Backward with reduction NONE needs dL/dy for every row; got none");
  }
  return core::ToDevice(rows.grad_output, device_);
}

absl::StatusOr<core::TokenBatch> StepSession::InputsOf(const StepRowsIn& rows,
                                                       const torch::Tensor& grad_output) const {
  if (inputs_ != nullptr) {
    if (rows.has_inputs()) {
      return absl::InvalidArgumentError(
          "rows: expected only grad_output (header.inputs_handle supplies hidden, targets, "
          "weights and aux); got input tensors");
    }
    if (!grad_output.defined()) {
      return absl::InvalidArgumentError(
          "rows: expected no rows (a scalar reduction with header.inputs_handle needs none); "
          "got rows");
    }
    return core::TokenBatch();  // sliced from the retained inputs by the caller
  }
  if (!rows.batch.hidden.defined()) {
    return absl::InvalidArgumentError(
        "rows.hidden: expected the rows' hidden states [n, D] in every rows message; got none");
  }
  RETURN_IF_ERROR(CheckTeacherRows(rows.batch));
  // On a CUDA head, copied in on the device's inbound stream while the batch before computes
  // (hidden from its page-locked staging buffer; core/device_transfer.h).
  core::TokenBatch batch = core::ToDevice(rows.batch, device_);
  // The teacher's hidden states on the teacher's device (a server's heads share one).
  if (batch.teacher_hidden.defined() && teacher_.entry != nullptr && teacher_.device != device_) {
    batch.teacher_hidden = batch.teacher_hidden.to(teacher_.device);
  }
  return batch;
}

absl::Status StepSession::Enqueue(RowBatcher::Part part, int64_t first_row,
                                  const StepResultSink& sink) {
  // A malformed part (e.g. hidden that is not [n, D]) is not batched with others: the engine
  // checks it on its own and reports exactly what is wrong.
  if (!Batchable(part.batch, part.grad_output, row_layout())) {
    RETURN_IF_ERROR(batcher_.Flush(batcher_.pending_rows(), ComputeBatch(sink)));
    compaction_.KeepAll(first_row, part.batch.rows());
    return ComputeRows(std::move(part.batch), part.grad_output, sink);
  }
  if (call_.retain_inputs_seconds > 0) RETURN_IF_ERROR(Retain(part.batch));
  part = compaction_.Compact(std::move(part), first_row);
  if (part.batch.rows() == 0) return absl::OkStatus();  // every row dropped
  return batcher_.Add(std::move(part), ComputeBatch(sink));
}

// Owned copies: the rows may alias request messages that are about to be freed. They are
// bounded by the budget as they arrive: beyond what the estimate reserved (X and targets),
// admission is asked for more, and the request fails if the budget has none.
absl::Status StepSession::Retain(const core::TokenBatch& rows) {
  kept_rows_.push_back(rows.Clone());
  kept_bytes_ += kept_rows_.back().nbytes();
  if (kept_bytes_ <= kept_reserved_) return absl::OkStatus();
  const int64_t more = kept_bytes_ - kept_reserved_;
  if (reserve_more_) {
    RETURN_IF_ERROR(reserve_more_(
        more, absl::StrCat("inputs retained for the Backward: ", kept_bytes_, " bytes after ",
                           received_rows_, " rows (per-token weights and aux)")));
  }
  kept_reserved_ += more;
  return absl::OkStatus();
}

RowBatcher::Compute StepSession::ComputeBatch(const StepResultSink& sink) {
  return [this, &sink](core::TokenBatch batch, torch::Tensor grads) {
    if (plan_.couples_rows) {
      RETURN_IF_ERROR(CheckCoupledBatch(plan_, received_rows_ < call_.rows || coupled_batch_done_,
                                        received_rows_));
      coupled_batch_done_ = true;
    }
    torch::Tensor grad_output;
    if (mode_ == core::CallMode::kBackward) {
      grad_output = options_.reduction != core::Reduction::kNone
                        ? torch::full({}, options_.upstream_scale, torch::kDouble)
                        : std::move(grads);
    }
    return ComputeRows(std::move(batch), grad_output, sink);
  };
}

absl::Status StepSession::ComputeRows(core::TokenBatch batch, const torch::Tensor& grad_output,
                                      const StepResultSink& sink) {
  EngineOutputs results;
  // Bad rows are named by their index in the request.
  const int64_t rows = batch.rows();
  options_.row_numbers = compaction_.RowNumbers(rows);
  options_.first_row = options_.row_numbers != nullptr && !options_.row_numbers->empty()
                           ? options_.row_numbers->front()
                           : compaction_.given_back();
  RETURN_IF_ERROR(Compute(batch, grad_output, &results));
  torch::Tensor& dx = results.grad_hidden;
  if (dx.defined() && call_.grad_hidden_dtype && dx.scalar_type() != *call_.grad_hidden_dtype) {
    dx = dx.to(*call_.grad_hidden_dtype);
  }
  StepRowResults placed = compaction_.Place({.grad_hidden = std::move(dx),
                                             .outputs = std::move(results.outputs),
                                             .token_ids = std::move(results.token_ids),
                                             .token_extras = std::move(results.token_extras)},
                                            rows);
  next_row_ = compaction_.given_back();
  return sink(std::move(placed));
}

absl::Status StepSession::Compute(const core::TokenBatch& batch, const torch::Tensor& grad_output,
                                  EngineOutputs* results) {
  auto here = [&](const core::Head& head, const core::Head* teacher) {
    return ComputeHere(head, teacher, batch, grad_output, results);
  };
  // Under the head's lock (and a two-head call's teacher's), on the version the request began
  // with: its weights must not change under a running computation, nor between two of its
  // batches.
  if (fanout_ == nullptr) return entry_->ReadPinnedWith(teacher_.entry.get(), &pin_, here);
  return fanout_->RunBatch({.mode = mode_,
                            .accumulate = call_.gradient.has_value(),
                            .first_row = options_.first_row,
                            .batch = &batch,
                            .grad_output = &grad_output},
                           *entry_, teacher_.entry.get(), &pin_, here);
}

absl::Status StepSession::ComputeHere(const core::Head& head, const core::Head* teacher,
                                      const core::TokenBatch& batch,
                                      const torch::Tensor& grad_output, EngineOutputs* results) {
  if (teacher != nullptr && teacher->version() != teacher_.version) {
    return absl::AbortedError(
        absl::StrCat("header.teacher_head_id: expected teacher head \"", call_.teacher_head_id,
                     "\" at weight version ", teacher_.version,
                     ", the one this request began with; got version ", teacher->version(),
                     " (its weights were replaced meanwhile). Nothing was committed; send "
                     "the request again"));
  }
  options_.teacher = teacher;
  // One logits buffer for the whole request (a new one per batch would cost page faults),
  // allocated once the request has been admitted.
  if (!options_.logits_workspace.defined() && batcher_.batch_rows() > 1 && call_.rows > 0) {
    options_.logits_workspace =
        core::NewLogitsWorkspace(head, plan_, std::min(batcher_.batch_rows(), call_.rows));
  }
  ASSIGN_OR_RETURN(EngineOutputs r, RunEngine(mode_, head, batch, options_, grad_output,
                                              call_.gradient ? &scratch_ : nullptr));
  if (mode_ == core::CallMode::kFused ||
      (mode_ == core::CallMode::kForward && options_.reduction != core::Reduction::kNone)) {
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + r.loss : r.loss;
  }
  AddStats(r.stats);
  *results = std::move(r);
  return absl::OkStatus();
}

void StepSession::AddStats(const core::StepStats& stats) {
  outcome_.valid_tokens += stats.valid_tokens;
  outcome_.chunk_rows = std::max(outcome_.chunk_rows, stats.chunk_rows);
  outcome_.num_chunks += stats.num_chunks;
  for (const auto& [name, value] : stats.extras) outcome_.extras[name] += value;
  health_.Add(HealthWindow::Of(stats));
}

// ----- the end -----

absl::StatusOr<StepOutcome> StepSession::Finish(const StepResultSink& sink) {
  RETURN_IF_ERROR(ComputeRemaining(sink));
  RETURN_IF_ERROR(CheckComplete());
  if (loss_sum_.defined()) outcome_.loss = loss_sum_.item<double>();  // the one read
  ASSIGN_OR_RETURN(const CommitResult commit, Commit());
  if (teacher_.entry != nullptr) teacher_.entry->AddStudent(call_.head_id);
  if (inputs_ != nullptr) retained_->Release(call_.inputs_handle);
  StepOutcome outcome = Outcome(commit);
  if (call_.retain_inputs_seconds > 0) {
    ASSIGN_OR_RETURN(outcome.inputs_handle, RetainInputs(commit));
  }
  return outcome;
}

absl::StatusOr<CommitResult> StepSession::Commit() {
  const std::optional<double> loss =
      mode_ == core::CallMode::kFused ? std::optional<double>(outcome_.loss) : std::nullopt;
  const StepCommit commit{
      .pin = pin_, .key = call_.gradient, .scratch = &scratch_, .loss = loss, .health = &health_};
  auto here = [&] { return entry_->Commit(commit); };
  // Only a request that accumulates changes the other ranks' heads.
  if (fanout_ == nullptr || !call_.gradient.has_value()) return here();
  return fanout_->Commit(commit, here);
}

// Whatever is still pending, and — for a scalar Backward by handle, which sends no rows — the
// retained rows, which are then the whole input.
absl::Status StepSession::ComputeRemaining(const StepResultSink& sink) {
  if (inputs_ != nullptr && options_.reduction != core::Reduction::kNone &&
      received_rows_ < call_.rows) {
    const int64_t n = call_.rows - received_rows_;
    RowBatcher::Part part =
        compaction_.Compact({.batch = inputs_->batch.Slice(received_rows_, n)}, received_rows_);
    if (part.batch.rows() > 0) batcher_.Append(std::move(part));
    received_rows_ += n;
  }
  RETURN_IF_ERROR(batcher_.FlushAll(ComputeBatch(sink)));
  return FlushReceived(sink);
}

absl::Status StepSession::CheckComplete() const {
  if (next_row_ != call_.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: expected ", call_.rows, " rows (header.rows); got ", next_row_));
  }
  if (call_.valid_tokens.has_value() && *call_.valid_tokens != outcome_.valid_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.valid_tokens: expected the number of targets != ignore_index in the rows, ",
        outcome_.valid_tokens, "; got ", *call_.valid_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StepSession::RetainInputs(const CommitResult& commit) {
  RetainedInputs kept{.head_id = call_.head_id,
                      .weight_version = commit.weight_version,
                      .batch = core::TokenBatch::Concat(kept_rows_),
                      .teacher_head_id = call_.teacher_head_id,
                      .teacher_version = teacher_.version};
  kept_rows_.clear();
  if (!kept.batch.hidden.defined()) {  // zero rows
    kept.batch.hidden = entry_->Read([&](const core::Head& head) {
      return torch::empty({0, head.hidden_size()}, head.weight().options());
    });
  }
  if (teacher_.entry != nullptr && !kept.batch.teacher_hidden.defined()) {  // zero rows
    kept.batch.teacher_hidden = torch::empty(
        {0, teacher_.hidden_size}, torch::TensorOptions(teacher_.dtype).device(teacher_.device));
  }
  return retained_->Put(std::move(kept), call_.retain_inputs_seconds);
}

StepOutcome StepSession::Outcome(const CommitResult& commit) {
  // The columns this process computes: its shard's on a head group.
  const int64_t columns =
      options_.shard != nullptr ? options_.shard->mine().rows : plan_.vocab_size;
  logits_chunk_bytes_ = outcome_.chunk_rows * columns * plan_.head_elem_bytes;
  StepOutcome outcome = outcome_;
  outcome.replayed = commit.replayed;
  outcome.weight_version = commit.weight_version;
  outcome.denominator = options_.normalizer.value_or(1.0);
  return outcome;
}

}  // namespace remotehead::server
