#include "service/request_memory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "remotehead/core/head.h"
#include "remotehead/core/memory_stats.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {

MemoryEstimate StepMemory(const StepMemoryInputs& in) {
  const core::CallPlan& plan = *in.plan;
  // The engine runs one batch at a time; core's memory model says what one call holds.
  const core::CallMemory engine = plan.Memory(std::min(in.rows, in.batch_rows), in.mode);
  const int64_t x_bytes = in.rows * plan.hidden_size * plan.head_elem_bytes;
  // In flight: rows received but not computed and results not yet sent (X-sized each), plus
  // the whole X (and int64 targets) when a Forward keeps its inputs for the Backward.
  // A Forward's results may outweigh X (rows of logits): X plus the results then. A two-head
  // call's rows carry the teacher's hidden states with X.
  const int64_t result_bytes =
      in.mode == core::CallMode::kForward ? in.rows * plan.output_row_bytes : x_bytes;
  const int64_t in_bytes = x_bytes + in.rows * in.teacher_row_bytes;
  const int64_t pipeline =
      std::min(std::max(2 * in_bytes, in_bytes + result_bytes), in.pipeline_bytes);
  const int64_t kept =
      in.retains_inputs ? RetainedInputsBytes(plan, in.rows, in.teacher_row_bytes) : 0;
  MemoryEstimate e;
  e.bytes = engine.total() + in.scratch_bytes + pipeline + kept;
  e.breakdown =
      absl::StrCat("engine workspace ", core::FormatMiB(engine.total()), " (", engine.Breakdown(),
                   ") + scratch dW ", core::FormatMiB(in.scratch_bytes), " + rows in flight ",
                   core::FormatMiB(pipeline));
  if (kept > 0) absl::StrAppend(&e.breakdown, " + retained inputs ", core::FormatMiB(kept));
  return e;
}

int64_t RetainedInputsBytes(const core::CallPlan& plan, int64_t rows, int64_t teacher_row_bytes) {
  return rows * (plan.hidden_size * plan.head_elem_bytes + 8 + teacher_row_bytes);
}

int64_t StreamPipelineBytes(int streams, int read_ahead_messages,
                            int64_t max_pending_response_bytes) {
  return int64_t{streams} * (read_ahead_messages + 1) * (int64_t{4} << 20) + 2 * kMaxBatchBytes +
         max_pending_response_bytes;
}

MemoryEstimate UploadBufferMemory(const std::string& head_id, int64_t vocab_size,
                                  int64_t hidden_size, bool bias, torch::ScalarType dtype) {
  return {
      .bytes = vocab_size * (hidden_size + (bias ? 1 : 0)) *
               static_cast<int64_t>(c10::elementSize(dtype)),
      .breakdown = absl::StrCat("the upload buffer of head \"", head_id, "\", header.vocab_size ",
                                vocab_size, " × header.hidden_size ", hidden_size)};
}

MemoryEstimate EmbeddingRowsMemory(const std::string& head_id, int64_t ids, int64_t hidden_size,
                                   torch::ScalarType dtype, const std::string& field) {
  return {.bytes = ids * hidden_size * static_cast<int64_t>(c10::elementSize(dtype)),
          .breakdown = absl::StrCat("the embedding rows of head \"", head_id, "\", ", field, " ",
                                    ids, " × hidden_size ", hidden_size)};
}

absl::StatusOr<MemoryEstimate> HeadMemory(const std::string& head_id, int64_t vocab_size,
                                          int64_t hidden_size, torch::ScalarType dtype, bool bias,
                                          std::optional<torch::ScalarType> grad_dtype,
                                          const std::string& field_prefix) {
  ASSIGN_OR_RETURN(const int64_t bytes, core::HeadMemoryBytes(vocab_size, hidden_size, dtype, bias,
                                                              grad_dtype, field_prefix));
  return MemoryEstimate{
      .bytes = bytes,
      .breakdown = absl::StrCat(
          "head \"", head_id, "\" of ", field_prefix, "vocab_size ", vocab_size, " × ",
          field_prefix, "hidden_size ", hidden_size, " ", core::DtypeName(dtype),
          bias ? " with bias" : "", ": weights and ",
          core::DtypeName(grad_dtype.value_or(core::AccumulationDtype(dtype))), " gradients")};
}

}  // namespace remotehead::server
