// The rows of a step call received and not yet computed: whatever the size of the client's
// messages, the engine runs on batches of `batch_rows` rows (its own chunk size, capped: see
// StepSession::PlanBatches). Parts are concatenated only with parts that carry the same inputs
// and row shapes; their bytes stay owned by the messages they alias until computed.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::server {

// Rows per engine call of a step on `call_rows` rows of `row_bytes` (X) each returning
// `result_row_bytes`: the engine's own chunk size for the plan (one GEMM chunk per call, no
// ragged tail), capped at 8 MiB of X and of results so that compute starts — and dX streams
// back — while later rows are still arriving; all of the call's rows for a row-coupled plan (a
// sequence-level loss), which the engine computes on all of them at once.
int64_t BatchRows(const core::CallPlan& plan, int64_t call_rows, int64_t row_bytes,
                  int64_t result_row_bytes);
// A row-coupled call's one batch: INVALID_ARGUMENT when it `split` (only messages whose inputs
// differ do that: RowBatcher::Add), naming the row where it did.
absl::Status CheckCoupledBatch(const core::CallPlan& plan, bool split, int64_t at_row);

// What a call's rows are, fixed at its header (StepSession::row_layout): how many and how they
// are batched, and what a row must be to be batched — hidden states of the head's width and
// dtype (on its device), and a two-head call's teacher's. The transport stages rows in this
// layout (rpc/row_staging.h).
struct RowLayout {
  int64_t call_rows = 0;  // header.rows
  int64_t batch_rows = 1;
  int64_t width = 0;  // the head's hidden size
  torch::ScalarType dtype = torch::kFloat;
  torch::Device device = torch::kCPU;
  int64_t teacher_width = -1;  // a two-head call's teacher's hidden size; -1: no teacher
  torch::ScalarType teacher_dtype = torch::kFloat;
};
// [n, width] hidden in the head's dtype with [n] per-token tensors ([n] or [n, k] aux, a
// two-head call's [n, teacher_width] teacher hidden states in the teacher's dtype): rows that can
// be concatenated with others. A part that is not is computed alone, and the engine says what is
// wrong with it.
bool Batchable(const core::TokenBatch& b, const torch::Tensor& grad_output,
               const RowLayout& layout);

class RowBatcher {
 public:
  struct Part {
    std::shared_ptr<const void> owner;  // owns the bytes the tensors alias
    core::TokenBatch batch;
    torch::Tensor grad_output;  // dL/dy per row (a Backward with reduction NONE), or undefined
  };
  // Computes one batch: its rows concatenated, with their grad_output rows concatenated
  // (undefined when the parts have none).
  using Compute = std::function<absl::Status(core::TokenBatch batch, torch::Tensor grad_output)>;

  void set_batch_rows(int64_t rows) { batch_rows_ = rows; }
  int64_t batch_rows() const { return batch_rows_; }
  int64_t pending_rows() const { return pending_rows_; }

  // Queues `part`, first computing what is pending if `part` cannot join it, then every full
  // batch.
  absl::Status Add(Part part, const Compute& compute);
  // Queues `part` as it is (rows that join whatever is pending).
  void Append(Part part);
  // Computes the first `rows` pending rows as one batch.
  absl::Status Flush(int64_t rows, const Compute& compute);
  // Computes everything pending, in batches of at most batch_rows().
  absl::Status FlushAll(const Compute& compute);

 private:
  std::deque<Part> pending_;
  int64_t pending_rows_ = 0;
  int64_t batch_rows_ = 1;
};

}  // namespace remotehead::server
