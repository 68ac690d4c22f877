#include "step_session.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/tensor_codec.h"

namespace remotehead::server {
namespace {

absl::StatusOr<core::Reduction> FromWireReduction(v1::Reduction r) {
  switch (r) {
    case v1::REDUCTION_UNSPECIFIED:
    case v1::REDUCTION_MEAN:
      return core::Reduction::kMean;
    case v1::REDUCTION_SUM:
      return core::Reduction::kSum;
    case v1::REDUCTION_WEIGHTED_SUM:
      return core::Reduction::kWeightedSum;
    case v1::REDUCTION_NONE:
      return core::Reduction::kNone;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "header.function.reduction: expected NONE, SUM, MEAN or WEIGHTED_SUM; got ", r));
  }
}

// Decodes a per-token tensor field if present (an absent message field stays undefined).
absl::Status DecodeOptional(bool present, const v1::Tensor& wire, const std::string& field,
                            torch::Tensor* out) {
  if (!present) return absl::OkStatus();
  ASSIGN_OR_RETURN(*out, DecodeTensor(wire, field));
  return absl::OkStatus();
}

}  // namespace

absl::Status StepSession::OnRequest(const v1::StepRequest& request,
                                    std::vector<v1::StepResponse>* responses) {
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
      return OnRows(request.rows(), responses);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("part: ForwardBackward expects a header then rows; got message part ",
                       static_cast<int>(request.part_case())));
  }
}

absl::Status StepSession::OnHeader(const v1::StepHeader& header) {
  ASSIGN_OR_RETURN(entry_, registry_->Get(header.head_id()));
  if (header.rows() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rows: expected >= 0; got ", header.rows()));
  }
  const v1::FunctionSpec& fn = header.function();
  options_.function = fn.name().empty() ? "cross_entropy" : fn.name();
  options_.params = core::FunctionParams(fn.params().begin(), fn.params().end());
  ASSIGN_OR_RETURN(options_.reduction, FromWireReduction(fn.reduction()));
  if (options_.reduction == core::Reduction::kNone) {
    return absl::InvalidArgumentError(
        "header.function.reduction: ForwardBackward needs a scalar loss (SUM, MEAN or "
        "WEIGHTED_SUM); got NONE — use Forward and Backward for per-token outputs");
  }
  if (fn.has_ignore_index()) options_.ignore_index = fn.ignore_index();
  if (fn.has_normalizer()) {
    options_.normalizer = fn.normalizer();
  } else if (options_.reduction == core::Reduction::kMean) {
    if (!header.has_valid_tokens() || header.valid_tokens() < 0) {
      return absl::InvalidArgumentError(
          "header.valid_tokens: reduction MEAN without a normalizer needs the number of "
          "targets != ignore_index over all rows; got none");
    }
    // A mean over zero tokens is 0 with zero gradients (the engine's convention).
    options_.normalizer = std::max<int64_t>(header.valid_tokens(), 1);
  }
  options_.chunk_rows = header.chunking().chunk_rows();
  options_.memory_budget_bytes = header.chunking().memory_budget_bytes();
  if (header.has_upstream_scale()) options_.upstream_scale = header.upstream_scale();

  std::lock_guard<std::mutex> lock(entry_->mu);
  if (header.has_expected_weight_version() &&
      header.expected_weight_version() != entry_->head->version()) {
    return absl::FailedPreconditionError(
        absl::StrCat("header.expected_weight_version: expected the head's current version ",
                     entry_->head->version(), "; got ", header.expected_weight_version()));
  }
  if (header.accumulate_weight_grad()) {
    if (!header.has_gradient_id() || header.gradient_id().trainer().empty()) {
      return absl::InvalidArgumentError(
          "header.gradient_id: expected a trainer / step / micro_batch identity when "
          "accumulate_weight_grad is set; got none");
    }
    key_ = GradientKey{header.gradient_id().trainer(), header.gradient_id().step(),
                       header.gradient_id().micro_batch()};
    scratch_ = entry_->head->NewGradientBuffers();
  }
  header_ = header;
  return absl::OkStatus();
}

absl::Status StepSession::OnRows(const v1::StepRows& rows,
                                 std::vector<v1::StepResponse>* responses) {
  if (rows.row_offset() != next_row_) {
    return absl::InvalidArgumentError(absl::StrCat("rows.row_offset: expected ", next_row_,
                                                   " (rows arrive in order); got ",
                                                   rows.row_offset()));
  }
  core::TokenBatch batch;
  ASSIGN_OR_RETURN(batch.hidden, DecodeTensor(rows.hidden(), "rows.hidden"));
  RETURN_IF_ERROR(
      DecodeOptional(rows.has_targets(), rows.targets(), "rows.targets", &batch.targets));
  RETURN_IF_ERROR(
      DecodeOptional(rows.has_weights(), rows.weights(), "rows.weights", &batch.weights));
  for (const auto& [name, wire] : rows.aux()) {
    ASSIGN_OR_RETURN(batch.aux[name], DecodeTensor(wire, absl::StrCat("rows.aux[\"", name, "\"]")));
  }
  const int64_t n = batch.hidden.dim() >= 1 ? batch.hidden.size(0) : 0;
  if (next_row_ + n > header_->rows()) {
    return absl::InvalidArgumentError(absl::StrCat("rows: expected ", header_->rows(),
                                                   " rows in all (header.rows); got at least ",
                                                   next_row_ + n));
  }
  const auto& head = *entry_->head;
  if (batch.hidden.defined() && batch.hidden.device() != head.device()) {
    batch.hidden = batch.hidden.to(head.device());
    if (batch.targets.defined()) batch.targets = batch.targets.to(head.device());
    if (batch.weights.defined()) batch.weights = batch.weights.to(head.device());
    for (auto& [name, t] : batch.aux) t = t.to(head.device());
  }
  absl::StatusOr<core::FusedResult> result;
  {
    // The head's weights must not change under a running computation (optimizer steps).
    std::lock_guard<std::mutex> lock(entry_->mu);
    result = core::FusedForwardBackward(head, batch, options_, key_ ? &scratch_ : nullptr);
  }
  if (!result.ok()) return result.status();
  loss_ += result->loss;
  valid_tokens_ += result->stats.valid_tokens;
  chunk_rows_ = std::max(chunk_rows_, result->stats.chunk_rows);
  num_chunks_ += result->stats.num_chunks;
  for (const auto& [name, value] : result->stats.extras) extras_[name] += value;

  const torch::Tensor& dx = result->grad_hidden;
  const int64_t bytes_per_row = dx.size(1) * dx.element_size();
  for (const auto& [offset, count] : PlanRowChunks(n, bytes_per_row, response_chunk_bytes_)) {
    v1::StepResponse response;
    v1::TensorChunk* chunk = response.mutable_grad_hidden();
    chunk->set_row_offset(next_row_ + offset);
    RETURN_IF_ERROR(EncodeTensor(dx.narrow(0, offset, count), chunk->mutable_values()));
    responses->push_back(std::move(response));
  }
  next_row_ += n;
  return absl::OkStatus();
}

absl::Status StepSession::OnClientDone(std::vector<v1::StepResponse>* responses) {
  if (!header_.has_value()) {
    return absl::InvalidArgumentError("header: expected a header; the stream ended without one");
  }
  if (next_row_ != header_->rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: expected ", header_->rows(), " rows (header.rows); got ", next_row_));
  }
  if (header_->has_valid_tokens() && header_->valid_tokens() != valid_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.valid_tokens: expected the number of targets != ignore_index in the rows, ",
        valid_tokens_, "; got ", header_->valid_tokens()));
  }
  v1::StepResponse response;
  v1::StepSummary* summary = response.mutable_summary();
  {
    std::lock_guard<std::mutex> lock(entry_->mu);
    core::Head& head = *entry_->head;
    if (key_.has_value()) {
      auto [it, inserted] = entry_->applied.try_emplace(*key_);
      if (inserted) {
        // Commit: the only place a request's gradient reaches the head.
        head.grads().weight.add_(scratch_.weight);
        if (scratch_.bias.defined()) head.grads().bias.add_(scratch_.bias);
        it->second = {loss_, valid_tokens_, head.version()};
      } else {
        summary->set_replayed(true);
      }
    }
    summary->set_weight_version(head.version());
  }
  summary->set_loss(loss_);
  summary->set_valid_tokens(valid_tokens_);
  summary->set_denominator(options_.normalizer.value_or(1.0));
  summary->set_chunk_rows(chunk_rows_);
  summary->set_num_chunks(num_chunks_);
  for (const auto& [name, value] : extras_) (*summary->mutable_extras())[name] = value;
  responses->push_back(std::move(response));
  return absl::OkStatus();
}

}  // namespace remotehead::server
