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
  ASSIGN_OR_RETURN(*out, DecodeTensorView(wire, field));
  return absl::OkStatus();
}

// Appends the rows of `t` (if defined) as TensorChunk responses of at most `chunk_bytes`,
// numbered from `first_row`, into the response field `field` (grad_hidden or outputs).
absl::Status AppendRowChunks(const torch::Tensor& t, int64_t first_row, int64_t chunk_bytes,
                             v1::TensorChunk* (v1::StepResponse::*field)(),
                             std::vector<v1::StepResponse>* responses) {
  if (!t.defined()) return absl::OkStatus();
  const int64_t bytes_per_row = t.numel() == 0 ? 1 : t.nbytes() / t.size(0);
  for (const auto& [offset, count] : PlanRowChunks(t.size(0), bytes_per_row, chunk_bytes)) {
    v1::StepResponse response;
    v1::TensorChunk* chunk = (response.*field)();
    chunk->set_row_offset(first_row + offset);
    RETURN_IF_ERROR(EncodeTensor(t.narrow(0, offset, count), chunk->mutable_values()));
    responses->push_back(std::move(response));
  }
  return absl::OkStatus();
}

// Rows per engine call: the engine's own chunk size for these options (one GEMM chunk per call,
// no ragged tail), capped at kMaxBatchBytes of X so that compute starts — and dX streams back —
// while later rows are still arriving. Options the engine will refuse give 1 (each message is
// computed as it comes, and the engine reports the error).
constexpr int64_t kMaxBatchBytes = int64_t{8} << 20;

int64_t EngineBatchRows(const core::Head& head, const core::StepOptions& options) {
  const core::FunctionRegistry& registry = core::FunctionRegistry::Builtin();
  auto fn = registry.Find(options.function);
  if (!fn.ok()) return 1;
  auto params = registry.ResolveParams(**fn, options.params);
  if (!params.ok()) return 1;
  auto sizes = core::ResolveChunkSizes(head, **fn, *params, options);
  if (!sizes.ok()) return 1;
  const int64_t row_bytes = head.hidden_size() * c10::elementSize(head.dtype());
  return std::max<int64_t>(1, std::min(sizes->chunk_rows, kMaxBatchBytes / row_bytes));
}

// [n, D] hidden in the head's dtype with [n] per-token tensors: what can be concatenated.
bool WellFormed(const core::TokenBatch& b, const torch::Tensor& grad_output,
                const core::Head& head) {
  if (b.hidden.dim() != 2 || b.hidden.size(1) != head.hidden_size() ||
      b.hidden.scalar_type() != head.dtype()) {
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

// The same optional inputs, with the same dtypes.
bool SameInputs(const core::TokenBatch& a, const core::TokenBatch& b) {
  auto same = [](const torch::Tensor& x, const torch::Tensor& y) {
    return x.defined() == y.defined() && (!x.defined() || x.scalar_type() == y.scalar_type());
  };
  if (!same(a.targets, b.targets) || !same(a.weights, b.weights) || a.aux.size() != b.aux.size()) {
    return false;
  }
  for (const auto& [name, t] : a.aux) {
    auto it = b.aux.find(name);
    if (it == b.aux.end() || !same(t, it->second)) return false;
  }
  return true;
}

// Rows [start, start + n) of every per-token tensor of `b` (views, no copy).
core::TokenBatch SliceBatch(const core::TokenBatch& b, int64_t start, int64_t n) {
  core::TokenBatch s;
  s.hidden = b.hidden.narrow(0, start, n);
  if (b.targets.defined()) s.targets = b.targets.narrow(0, start, n);
  if (b.weights.defined()) s.weights = b.weights.narrow(0, start, n);
  for (const auto& [name, t] : b.aux) s.aux[name] = t.narrow(0, start, n);
  return s;
}

// The rows of consecutive batches as one batch (a Forward's inputs, kept for its Backward).
core::TokenBatch ConcatBatches(const std::vector<core::TokenBatch>& parts) {
  auto cat = [&](auto get) {
    std::vector<torch::Tensor> ts;
    for (const auto& p : parts) ts.push_back(get(p));
    return ts.empty() || !ts.front().defined() ? torch::Tensor() : torch::cat(ts);
  };
  core::TokenBatch b;
  b.hidden = cat([](const core::TokenBatch& p) { return p.hidden; });
  b.targets = cat([](const core::TokenBatch& p) { return p.targets; });
  b.weights = cat([](const core::TokenBatch& p) { return p.weights; });
  if (!parts.empty()) {
    for (const auto& [name, t] : parts.front().aux) {
      b.aux[name] = cat([&name](const core::TokenBatch& p) { return p.aux.at(name); });
    }
  }
  return b;
}

}  // namespace

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
  if (options_.reduction == core::Reduction::kNone && mode_ == Mode::kFused) {
    return absl::InvalidArgumentError(
        "header.function.reduction: ForwardBackward needs a scalar loss (SUM, MEAN or "
        "WEIGHTED_SUM); got NONE — use Forward and Backward for per-token outputs");
  }
  if (mode_ == Mode::kForward && header.accumulate_weight_grad()) {
    return absl::InvalidArgumentError(
        "header.accumulate_weight_grad: Forward computes no gradients; got true");
  }
  if (header.retain_inputs_seconds() != 0 &&
      (mode_ != Mode::kForward || !(header.retain_inputs_seconds() > 0))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.retain_inputs_seconds: expected 0, or > 0 on a Forward; got ",
        header.retain_inputs_seconds(), mode_ == Mode::kForward ? "" : " on a gradient call"));
  }
  if (!header.inputs_handle().empty() && mode_ != Mode::kBackward) {
    return absl::InvalidArgumentError(
        "header.inputs_handle: expected none (only Backward takes retained inputs); got one");
  }
  if (header.grad_hidden_dtype() != v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(const torch::ScalarType dtype,
                     FromWireDtype(header.grad_hidden_dtype(), "header.grad_hidden_dtype"));
    if (!torch::isFloatingType(dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.grad_hidden_dtype: expected a floating dtype; got ",
                       c10::toString(dtype)));
    }
    grad_hidden_dtype_ = dtype;
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
  if (!header.inputs_handle().empty()) RETURN_IF_ERROR(CheckRetainedInputs(header));
  batch_rows_ = EngineBatchRows(*entry_->head, options_);
  // One logits buffer for the whole request (a new one per batch would cost page faults);
  // every engine call on it runs under the head's lock, one at a time.
  if (header.rows() > 0 && batch_rows_ > 1) {
    options_.logits_workspace =
        torch::empty({std::min(batch_rows_, header.rows()), entry_->head->vocab_size()},
                     entry_->head->weight().options());
  }

  std::lock_guard<std::mutex> lock(entry_->mu);
  if (header.has_expected_weight_version() &&
      header.expected_weight_version() != entry_->head->version()) {
    return absl::FailedPreconditionError(
        absl::StrCat("header.expected_weight_version: expected the head's current version ",
                     entry_->head->version(), "; got ", header.expected_weight_version()));
  }
  if (inputs_ != nullptr && inputs_->weight_version != entry_->head->version()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.inputs_handle: expected the head to be at the version its Forward ran "
        "against, ", inputs_->weight_version, "; got version ", entry_->head->version(),
        " (an optimizer step happened in between)"));
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

absl::Status StepSession::CheckRetainedInputs(const v1::StepHeader& header) {
  ASSIGN_OR_RETURN(inputs_, retained_->Get(header.inputs_handle()));
  if (inputs_->head_id != header.head_id()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.inputs_handle: expected a handle from a Forward on head \"",
                     header.head_id(), "\"; got one from head \"", inputs_->head_id, "\""));
  }
  const int64_t retained_rows = inputs_->batch.hidden.size(0);
  if (header.rows() != retained_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.rows: expected the ", retained_rows,
                     " rows retained under header.inputs_handle; got ", header.rows()));
  }
  return absl::OkStatus();
}

MemoryEstimate StepSession::EstimateMemory(int64_t pipeline_bytes) const {
  const core::Head& head = *entry_->head;
  const int64_t rows = header_->rows();
  const int64_t vocab = head.vocab_size();
  // One row of logits in the head's dtype, plus an fp32 gradient buffer for other dtypes.
  const int64_t logit_row_bytes =
      vocab * (c10::elementSize(head.dtype()) + (head.dtype() == torch::kFloat ? 0 : 4));
  // Function blocks: fp32 logits, their gradient and the function's temporaries.
  const int64_t block_bytes = 4 * std::min(core::kFunctionBlockBytes, rows * vocab * 4);
  int64_t engine = options_.chunk_rows > 0 ? options_.chunk_rows * logit_row_bytes + block_bytes
                   : options_.memory_budget_bytes > 0 ? options_.memory_budget_bytes
                                                      : core::kDefaultMemoryBudgetBytes;
  engine = std::min(engine, rows * logit_row_bytes + block_bytes);
  int64_t scratch = 0;
  if (key_.has_value()) {
    scratch = head.grads().weight.nbytes() +
              (head.grads().bias.defined() ? head.grads().bias.nbytes() : 0);
  }
  const int64_t x_bytes = rows * head.hidden_size() * c10::elementSize(head.dtype());
  // In flight: rows received but not computed and results not yet sent (X-sized each), plus
  // the whole X when a Forward keeps its inputs for the Backward.
  const int64_t pipeline = std::min(2 * x_bytes, pipeline_bytes);
  const int64_t kept = header_->retain_inputs_seconds() > 0 ? x_bytes : 0;
  MemoryEstimate e;
  e.bytes = engine + scratch + pipeline + kept;
  auto mib = [](int64_t b) { return absl::StrCat(static_cast<double>(b) / (1 << 20), " MiB"); };
  e.breakdown = absl::StrCat("engine workspace ", mib(engine), " + scratch dW ", mib(scratch),
                             " + rows in flight ", mib(pipeline));
  if (kept > 0) absl::StrAppend(&e.breakdown, " + retained inputs ", mib(kept));
  return e;
}

absl::Status StepSession::OnRows(std::shared_ptr<const v1::StepRequest> message,
                                 std::vector<v1::StepResponse>* responses) {
  const v1::StepRows& rows = message->rows();
  if (rows.row_offset() != received_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("rows.row_offset: expected ", received_rows_,
                                                   " (rows arrive in order); got ",
                                                   rows.row_offset()));
  }
  const core::Head& head = *entry_->head;
  PendingRows part{.message = message};
  if (mode_ == Mode::kBackward && options_.reduction == core::Reduction::kNone) {
    if (!rows.has_grad_output()) {
      return absl::InvalidArgumentError(
          "rows.grad_output: Backward with reduction NONE needs dL/dy for every row; got none");
    }
    ASSIGN_OR_RETURN(part.grad_output, DecodeTensorView(rows.grad_output(), "rows.grad_output"));
    part.grad_output = part.grad_output.to(head.device());
  }
  int64_t n = 0;
  if (inputs_ != nullptr) {
    if (rows.has_hidden() || rows.has_targets() || rows.has_weights() || rows.aux_size() > 0) {
      return absl::InvalidArgumentError(
          "rows: expected only grad_output (header.inputs_handle supplies hidden, targets, "
          "weights and aux); got input tensors");
    }
    if (!part.grad_output.defined()) {
      return absl::InvalidArgumentError(
          "rows: expected no rows (a scalar reduction with header.inputs_handle needs none); "
          "got rows");
    }
    n = part.grad_output.dim() >= 1 ? part.grad_output.size(0) : 1;
    if (received_rows_ + n > header_->rows()) {
      return absl::InvalidArgumentError(absl::StrCat("rows.grad_output: expected ",
                                                     header_->rows(), " rows in all; got at least ",
                                                     received_rows_ + n));
    }
    part.batch = SliceBatch(inputs_->batch, received_rows_, n);
  } else {
    core::TokenBatch& batch = part.batch;
    ASSIGN_OR_RETURN(batch.hidden, DecodeTensorView(rows.hidden(), "rows.hidden"));
    RETURN_IF_ERROR(
        DecodeOptional(rows.has_targets(), rows.targets(), "rows.targets", &batch.targets));
    RETURN_IF_ERROR(
        DecodeOptional(rows.has_weights(), rows.weights(), "rows.weights", &batch.weights));
    for (const auto& [name, wire] : rows.aux()) {
      ASSIGN_OR_RETURN(batch.aux[name],
                       DecodeTensorView(wire, absl::StrCat("rows.aux[\"", name, "\"]")));
    }
    n = batch.hidden.dim() >= 1 ? batch.hidden.size(0) : 0;
    if (received_rows_ + n > header_->rows()) {
      return absl::InvalidArgumentError(absl::StrCat("rows: expected ", header_->rows(),
                                                     " rows in all (header.rows); got at least ",
                                                     received_rows_ + n));
    }
    if (batch.hidden.defined() && batch.hidden.device() != head.device()) {
      batch.hidden = batch.hidden.to(head.device());
      if (batch.targets.defined()) batch.targets = batch.targets.to(head.device());
      if (batch.weights.defined()) batch.weights = batch.weights.to(head.device());
      for (auto& [name, t] : batch.aux) t = t.to(head.device());
    }
    // A malformed part (e.g. hidden that is not [n, D]) is not batched with others: the
    // engine checks it on its own and reports exactly what is wrong.
    if (!WellFormed(part.batch, part.grad_output, head)) {
      RETURN_IF_ERROR(FlushPending(pending_rows_, responses));
      received_rows_ += n;
      return ComputeRows(std::move(batch), part.grad_output, responses);
    }
    // Parts are concatenated only with parts that carry the same inputs.
    if (!pending_.empty() && !SameInputs(pending_.front().batch, part.batch)) {
      RETURN_IF_ERROR(FlushPending(pending_rows_, responses));
    }
  }
  received_rows_ += n;
  pending_rows_ += n;
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
    const int64_t available = front.batch.hidden.size(0);
    const int64_t take = std::min(available, need);
    parts.push_back(SliceBatch(front.batch, 0, take));
    if (front.grad_output.defined()) grads.push_back(front.grad_output.narrow(0, 0, take));
    owners.push_back(front.message);
    if (take == available) {
      pending_.pop_front();
    } else {
      front.batch = SliceBatch(front.batch, take, available - take);
      if (front.grad_output.defined()) {
        front.grad_output = front.grad_output.narrow(0, take, available - take);
      }
    }
    need -= take;
  }
  pending_rows_ -= rows;
  core::TokenBatch batch = parts.size() == 1 ? std::move(parts.front()) : ConcatBatches(parts);
  torch::Tensor grad_output;
  if (mode_ == Mode::kBackward) {
    grad_output = options_.reduction != core::Reduction::kNone
                      ? torch::full({}, options_.upstream_scale, torch::kDouble)
                  : grads.size() == 1 ? grads.front()
                                      : torch::cat(grads);
  }
  return ComputeRows(std::move(batch), grad_output, responses);
}

absl::Status StepSession::ComputeRows(core::TokenBatch batch, const torch::Tensor& grad_output,
                                      std::vector<v1::StepResponse>* responses) {
  const int64_t n = batch.hidden.dim() >= 1 ? batch.hidden.size(0) : 0;
  torch::Tensor dx, outputs;
  options_.first_row = next_row_;  // bad rows are named by their index in the request
  RETURN_IF_ERROR(Compute(batch, grad_output, &dx, &outputs));
  if (dx.defined() && grad_hidden_dtype_ && dx.scalar_type() != *grad_hidden_dtype_) {
    dx = dx.to(*grad_hidden_dtype_);
  }
  RETURN_IF_ERROR(AppendRowChunks(dx, next_row_, response_chunk_bytes_,
                                  &v1::StepResponse::mutable_grad_hidden, responses));
  RETURN_IF_ERROR(AppendRowChunks(outputs, next_row_, response_chunk_bytes_,
                                  &v1::StepResponse::mutable_outputs, responses));
  if (header_->retain_inputs_seconds() > 0) {
    // Owned copies: the batch may alias request messages that are about to be freed.
    core::TokenBatch kept = SliceBatch(batch, 0, n);
    kept.hidden = kept.hidden.clone();
    if (kept.targets.defined()) kept.targets = kept.targets.clone();
    if (kept.weights.defined()) kept.weights = kept.weights.clone();
    for (auto& [name, t] : kept.aux) t = t.clone();
    kept_rows_.push_back(std::move(kept));
  }
  next_row_ += n;
  return absl::OkStatus();
}

absl::Status StepSession::Compute(const core::TokenBatch& batch, const torch::Tensor& grad_output,
                                  torch::Tensor* grad_hidden, torch::Tensor* outputs) {
  // The head's weights must not change under a running computation (optimizer steps).
  std::lock_guard<std::mutex> lock(entry_->mu);
  const core::Head& head = *entry_->head;
  core::GradientBuffers* grads = key_ ? &scratch_ : nullptr;
  core::StepStats stats;
  switch (mode_) {
    case Mode::kFused: {
      ASSIGN_OR_RETURN(core::FusedResult r,
                       core::FusedForwardBackward(head, batch, options_, grads));
      loss_ += r.loss;
      *grad_hidden = std::move(r.grad_hidden);
      stats = std::move(r.stats);
      break;
    }
    case Mode::kForward: {
      ASSIGN_OR_RETURN(core::ForwardResult r, core::Forward(head, batch, options_));
      if (options_.reduction == core::Reduction::kNone) {
        *outputs = std::move(r.output);
      } else {
        loss_ += r.output.item<double>();
      }
      stats = std::move(r.stats);
      break;
    }
    case Mode::kBackward: {
      ASSIGN_OR_RETURN(*grad_hidden, core::Backward(head, batch, options_, grad_output, grads));
      // The engine's Backward reports no statistics; the summary still counts the tokens.
      valid_tokens_ += batch.targets.defined()
                           ? (batch.targets != options_.ignore_index).sum().item<int64_t>()
                           : batch.hidden.size(0);
      return absl::OkStatus();
    }
  }
  valid_tokens_ += stats.valid_tokens;
  chunk_rows_ = std::max(chunk_rows_, stats.chunk_rows);
  num_chunks_ += stats.num_chunks;
  for (const auto& [name, value] : stats.extras) extras_[name] += value;
  return absl::OkStatus();
}

absl::Status StepSession::OnClientDone(std::vector<v1::StepResponse>* responses) {
  if (!header_.has_value()) {
    return absl::InvalidArgumentError("header: expected a header; the stream ended without one");
  }
  if (inputs_ != nullptr && options_.reduction != core::Reduction::kNone &&
      received_rows_ < header_->rows()) {
    // A scalar Backward by handle: the retained rows are the whole input.
    const int64_t n = header_->rows() - received_rows_;
    pending_.push_back({.batch = SliceBatch(inputs_->batch, received_rows_, n)});
    pending_rows_ += n;
    received_rows_ += n;
  }
  while (pending_rows_ > 0) {
    RETURN_IF_ERROR(FlushPending(std::min(batch_rows_, pending_rows_), responses));
  }
  if (next_row_ != header_->rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows: expected ", header_->rows(), " rows (header.rows); got ", next_row_));
  }
  if (mode_ != Mode::kBackward && header_->has_valid_tokens() &&
      header_->valid_tokens() != valid_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.valid_tokens: expected the number of targets != ignore_index in the rows, ",
        valid_tokens_, "; got ", header_->valid_tokens()));
  }
  v1::StepResponse response;
  v1::StepSummary* summary = response.mutable_summary();
  if (header_->retain_inputs_seconds() > 0) {
    RetainedInputs kept{.head_id = header_->head_id(), .batch = ConcatBatches(kept_rows_)};
    {
      std::lock_guard<std::mutex> lock(entry_->mu);
      kept.weight_version = entry_->head->version();
      if (!kept.batch.hidden.defined()) {  // zero rows
        kept.batch.hidden = torch::empty({0, entry_->head->hidden_size()},
                                         entry_->head->weight().options());
      }
    }
    kept_rows_.clear();
    ASSIGN_OR_RETURN(std::string handle,
                     retained_->Put(std::move(kept), header_->retain_inputs_seconds()));
    summary->set_inputs_handle(std::move(handle));
  }
  {
    std::lock_guard<std::mutex> lock(entry_->mu);
    core::Head& head = *entry_->head;
    if (key_.has_value()) {
      if (entry_->applied.insert(*key_).second) {
        // Commit: the only place a request's gradient reaches the head.
        head.grads().weight.add_(scratch_.weight);
        if (scratch_.bias.defined()) head.grads().bias.add_(scratch_.bias);
      } else {
        summary->set_replayed(true);
      }
    }
    summary->set_weight_version(head.version());
    if (mode_ == Mode::kFused) entry_->last_loss = loss_;
    logits_chunk_bytes_ = chunk_rows_ * head.vocab_size() *
                          static_cast<int64_t>(c10::elementSize(head.dtype()));
  }
  if (inputs_ != nullptr) retained_->Release(header_->inputs_handle());
  summary->set_loss(loss_);
  summary->set_valid_tokens(valid_tokens_);
  summary->set_denominator(options_.normalizer.value_or(1.0));
  summary->set_chunk_rows(chunk_rows_);
  summary->set_num_chunks(num_chunks_);
  for (const auto& [name, value] : extras_) (*summary->mutable_extras())[name] = value;
  *summary->mutable_timings() = timings_;
  responses->push_back(std::move(response));
  return absl::OkStatus();
}

}  // namespace remotehead::server
