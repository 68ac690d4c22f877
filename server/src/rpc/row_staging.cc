#include "rpc/row_staging.h"

#include <algorithm>
#include <utility>

#include "remotehead/wire/row_buffer.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::server {

void RowStaging::Configure(const RowLayout& layout) {
  std::lock_guard<std::mutex> lock(mu_);
  layout_ = layout;
  layout_->batch_rows = std::max<int64_t>(1, layout.batch_rows);
}

torch::Tensor RowStaging::BufferLocked(int64_t index) {
  Batch& batch = batches_[index];
  if (!batch.buffer.defined()) {
    const RowLayout& l = *layout_;
    const int64_t rows = std::min(l.batch_rows, l.call_rows - index * l.batch_rows);
    batch.buffer = l.device.is_cuda()
                       ? torch::empty({rows, l.width},
                                      torch::TensorOptions().dtype(l.dtype).pinned_memory(true))
                       : wire::EmptyRows({rows, l.width}, l.dtype);
  }
  return batch.buffer;
}

bool RowStaging::Decode(const std::vector<wire::BytePiece>& pieces, v1::StepRequest* message,
                        std::vector<StagedHidden>* staged) {
  staged->clear();
  RowLayout layout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!layout_.has_value()) return false;
    layout = *layout_;
  }
  std::optional<wire::SplitTensor> split = wire::SplitHiddenData(pieces);
  if (!split.has_value() || !message->ParseFromString(split->rest) ||
      message->part_case() != v1::StepRequest::kRows) {
    return false;
  }
  const v1::Tensor& head = message->rows().hidden();
  const absl::StatusOr<torch::ScalarType> dtype =
      wire::CheckTensor(head, split->data_size, "rows.hidden");
  if (!dtype.ok() || *dtype != layout.dtype || head.shape_size() != 2 ||
      head.shape(1) != layout.width) {
    return false;
  }
  const int64_t first = message->rows().row_offset(), rows = head.shape(0);
  const int64_t row_bytes = layout.width * static_cast<int64_t>(c10::elementSize(layout.dtype));
  if (rows < 1 || first < 0 || first > layout.call_rows - rows) return false;
  // Where each batch's share of the rows goes: taken under the lock, copied outside it.
  std::vector<std::pair<int64_t, torch::Tensor>> into;  // (batch index, destination rows)
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t row = first; row < first + rows;) {
      const int64_t index = row / layout.batch_rows;
      const int64_t end = std::min(first + rows, (index + 1) * layout.batch_rows);
      into.emplace_back(index,
                        BufferLocked(index).narrow(0, row - index * layout.batch_rows, end - row));
      row = end;
    }
  }
  int64_t at = 0;
  for (const auto& [index, rows_there] : into) {
    wire::CopyBytes(pieces, split->data_offset + at * row_bytes, rows_there.size(0) * row_bytes,
                    static_cast<char*>(rows_there.data_ptr()));
    staged->push_back({.first_row = first + at, .hidden = rows_there});
    at += rows_there.size(0);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [index, rows_there] : into) {
    const auto batch = batches_.find(index);
    if (batch == batches_.end()) continue;  // made whole already (rows sent twice)
    batch->second.staged += rows_there.size(0);
    if (batch->second.staged >= batch->second.buffer.size(0)) batches_.erase(batch);
  }
  return true;
}

}  // namespace remotehead::server
