#include "step/row_compaction.h"

#include <algorithm>
#include <utility>

#include "remotehead/core/token_batch.h"

namespace remotehead::server {

RowCompaction RowCompaction::For(const core::CallPlan& plan, core::CallMode mode,
                                 const core::StepOptions& options,
                                 std::optional<torch::ScalarType> grad_hidden_dtype,
                                 torch::ScalarType head_dtype) {
  if (!plan.function->ignored_rows_contribute_nothing) return RowCompaction();
  RowResultKinds kinds{.hidden_size = plan.hidden_size,
                       .token_extras = options.token_extras,
                       .token_extras_dtype = core::OutputDtype(core::OutputKind::kPerToken,
                                                               head_dtype, torch::kFloat)};
  if (mode != core::CallMode::kForward) {
    kinds.grad_hidden = grad_hidden_dtype.value_or(head_dtype);
  } else if (options.reduction == core::Reduction::kNone) {
    kinds.outputs = kinds.token_extras_dtype;
  }
  return RowCompaction(options.ignore_index, std::move(kinds));
}

RowBatcher::Part RowCompaction::Compact(RowBatcher::Part part, int64_t first_row) {
  const int64_t n = part.batch.rows();
  if (!on_ || !part.batch.targets.defined() || n == 0) {
    KeepAll(first_row, n);
    return part;
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor keep = core::ContributingRows(part.batch.targets, ignore_index_);
  const int64_t k = keep.size(0);
  if (k == n) {
    KeepAll(first_row, n);
    return part;
  }
  const torch::Tensor rows = keep.to(torch::kCPU).contiguous();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) kept_.push_back(first_row + row[i]);
  dropped_ += n - k;
  part.batch = part.batch.Select(keep);
  if (part.grad_output.defined()) {
    part.grad_output = part.grad_output.index_select(0, keep.to(part.grad_output.device()));
  }
  return part;
}

void RowCompaction::KeepAll(int64_t first_row, int64_t n) {
  if (!on_) return;
  for (int64_t i = 0; i < n; ++i) kept_.push_back(first_row + i);
}

const std::vector<int64_t>* RowCompaction::RowNumbers(int64_t n) {
  if (!on_) return nullptr;
  const auto end = kept_.begin() + std::min<int64_t>(n, static_cast<int64_t>(kept_.size()));
  numbers_.assign(kept_.begin(), end);
  return &numbers_;
}

StepRowResults RowCompaction::Place(StepRowResults computed, int64_t n) {
  computed.first_row = given_back_;
  if (!on_) {
    given_back_ += n;
    return computed;
  }
  n = std::min<int64_t>(n, static_cast<int64_t>(kept_.size()));
  if (n == 0) return computed;
  std::vector<int64_t> rows(kept_.begin(), kept_.begin() + n);
  kept_.erase(kept_.begin(), kept_.begin() + n);
  const int64_t span = rows.back() + 1 - given_back_;
  if (span != n) {
    // Dropped rows between them: each result is spread over the span, zeros elsewhere.
    const torch::Tensor index = torch::tensor(rows, torch::kLong) - given_back_;
    auto spread = [&](torch::Tensor& t) {
      if (!t.defined()) return;
      std::vector<int64_t> sizes = t.sizes().vec();
      sizes[0] = span;
      torch::Tensor placed = torch::zeros(sizes, t.options());
      placed.index_copy_(0, index.to(t.device()), t);
      t = std::move(placed);
    };
    spread(computed.grad_hidden);
    spread(computed.outputs);
    spread(computed.token_ids);
    for (auto& [name, t] : computed.token_extras) spread(t);
  }
  given_back_ += span;
  return computed;
}

std::optional<StepRowResults> RowCompaction::FillTo(int64_t end) {
  if (!on_ || end <= given_back_) return std::nullopt;
  const int64_t span = end - given_back_;
  StepRowResults zeros{.first_row = given_back_};
  if (kinds_.grad_hidden.has_value()) {
    zeros.grad_hidden = torch::zeros({span, kinds_.hidden_size}, *kinds_.grad_hidden);
  }
  if (kinds_.outputs.has_value()) zeros.outputs = torch::zeros({span}, *kinds_.outputs);
  for (const std::string& name : kinds_.token_extras) {
    zeros.token_extras[name] = torch::zeros({span}, kinds_.token_extras_dtype);
  }
  given_back_ = end;
  return zeros;
}

}  // namespace remotehead::server
