#include "step/row_batcher.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "service/request_memory.h"

namespace remotehead::server {

int64_t BatchRows(const core::CallPlan& plan, int64_t call_rows, int64_t row_bytes,
                  int64_t result_row_bytes) {
  if (plan.couples_rows) return std::max<int64_t>(1, call_rows);
  return std::max<int64_t>(1, std::min({plan.chunk_rows, kMaxBatchBytes / row_bytes,
                                        kMaxBatchBytes / result_row_bytes}));
}

absl::Status CheckCoupledBatch(const core::CallPlan& plan, bool split, int64_t at_row) {
  if (!split) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "rows: function ", plan.function->name,
      " couples the rows of a sequence with these params (computed on all rows at once), so "
      "every message must carry the same inputs (hidden, targets, weights, aux); got messages "
      "whose inputs differ, the call split at row ",
      at_row));
}
bool Batchable(const core::TokenBatch& b, const torch::Tensor& grad_output,
               const RowLayout& layout) {
  if (b.hidden.dim() != 2 || b.hidden.size(1) != layout.width ||
      b.hidden.scalar_type() != layout.dtype) {
    return false;
  }
  const int64_t n = b.hidden.size(0);
  auto per_token = [n](const torch::Tensor& t) {
    return !t.defined() || (t.dim() == 1 && t.size(0) == n);
  };
  if (!per_token(b.targets) || !per_token(b.weights) || !per_token(grad_output)) return false;
  for (const auto& [name, t] : b.aux) {
    // [n], or [n, k] (a sparse teacher's top-k)
    if (!per_token(t) && !(t.dim() == 2 && t.size(0) == n)) return false;
  }
  const torch::Tensor& th = b.teacher_hidden;
  return !th.defined() ||
         (layout.teacher_width >= 0 && th.dim() == 2 && th.size(0) == n &&
          th.size(1) == layout.teacher_width && th.scalar_type() == layout.teacher_dtype);
}

namespace {

// Whether two well-formed parts' rows have the same shape beyond their first dimension (the k
// of [n, k] aux), so that they can be concatenated.
bool SameRowShapes(const core::TokenBatch& a, const core::TokenBatch& b) {
  for (const auto& [name, t] : a.aux) {
    const auto it = b.aux.find(name);
    if (it == b.aux.end() || it->second.dim() != t.dim() ||
        (t.dim() == 2 && it->second.size(1) != t.size(1))) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::Status RowBatcher::Add(Part part, const Compute& compute) {
  // Parts are concatenated only with parts that carry the same inputs.
  if (!pending_.empty() && (!pending_.front().batch.SameInputs(part.batch) ||
                            !SameRowShapes(pending_.front().batch, part.batch))) {
    RETURN_IF_ERROR(Flush(pending_rows_, compute));
  }
  Append(std::move(part));
  while (pending_rows_ >= batch_rows_) RETURN_IF_ERROR(Flush(batch_rows_, compute));
  return absl::OkStatus();
}

void RowBatcher::Append(Part part) {
  pending_rows_ += part.batch.rows();
  pending_.push_back(std::move(part));
}

absl::Status RowBatcher::Flush(int64_t rows, const Compute& compute) {
  if (rows <= 0) return absl::OkStatus();
  std::vector<core::TokenBatch> parts;
  std::vector<torch::Tensor> grads;
  std::vector<std::shared_ptr<const void>> owners;  // alive until computed
  for (int64_t need = rows; need > 0;) {
    Part& front = pending_.front();
    const int64_t available = front.batch.rows();
    const int64_t take = std::min(available, need);
    parts.push_back(front.batch.Slice(0, take));
    if (front.grad_output.defined()) grads.push_back(front.grad_output.narrow(0, 0, take));
    owners.push_back(front.owner);
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
  return compute(core::TokenBatch::Concat(parts),
                 grads.empty() ? torch::Tensor() : torch::cat(grads));
}

absl::Status RowBatcher::FlushAll(const Compute& compute) {
  while (pending_rows_ > 0) RETURN_IF_ERROR(Flush(std::min(batch_rows_, pending_rows_), compute));
  return absl::OkStatus();
}

}  // namespace remotehead::server
