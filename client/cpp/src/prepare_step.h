// A step call's preparation: the caller's inputs checked and laid out for the wire, the header
// and the row plan. The rules are shared byte-for-byte with the Python client
// (client/python/remotehead/_steps.py); tests/python/test_conformance.py compares both clients'
// messages.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/client/client.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"
#include "remotehead/wire/frames.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::client::internal {

// A step's inputs in wire layout (CPU, contiguous, wire dtypes), its header and its row plan:
// built once, sent by every attempt.
struct PreparedStep {
  core::CallMode mode = core::CallMode::kFused;
  std::string inputs_handle;  // a Backward by a Forward's retained inputs
  bool by_handle() const { return !inputs_handle.empty(); }
  v1::StepRequest header;
  int64_t rows = 0;
  int64_t hidden_size = 0;
  torch::ScalarType result_dtype = torch::kFloat;  // the caller's hidden dtype: dX comes back in it
  // What travels with the rows; all undefined but grad_output for a Backward by inputs handle.
  torch::Tensor hidden, targets, weights, grad_output;
  torch::Tensor teacher_hidden;  // a two-head call's [N, D_teacher]
  std::vector<std::pair<std::string, torch::Tensor>> aux;
  std::vector<wire::RowRange> chunks;
  // Rows that contribute nothing left out (CompactRows): which of the caller's rows travel
  // ([rows] int64), and how many the caller gave; undefined when every row travels.
  torch::Tensor kept;
  int64_t caller_rows = 0;

  // The message carrying rows [offset, offset + count) of every tensor above, framed around
  // their bytes, which it references (keeping the tensors alive) instead of copying.
  wire::Frames RowsFrames(int64_t offset, int64_t count) const;
  // A result of the rows sent ([rows, ...]) in the caller's rows ([caller_rows, ...]), zeros in
  // the rows left out; as it is when every row travels (or `t` is undefined).
  torch::Tensor Expand(const torch::Tensor& t) const;
  // `status` naming a row as the caller gave it. The server names a row by its index among the
  // rows sent ("targets[12]": the ErrorInfo metadata "field" and the message's leading field);
  // with rows left out that is not the caller's row. Rewritten from the metadata (data, never
  // the message's text): the field, in the metadata and leading the message, becomes the
  // caller's ("targets[5]"); code and reason kept. As it is when every row travels.
  absl::Status CallerError(absl::Status status) const;
};

// Checks the inputs of a step call in `mode` (INVALID_ARGUMENT naming the field), writes its
// header and plans its row messages, none over chunk_bytes. grad_output: a Backward's dL/dy
// (reduction NONE) or dL/d(loss); ignored otherwise. What to leave out (the Python client's
// _compaction.compact, to the row): with `compact`, the rows whose target is spec.ignore_index
// (the function's listing says they contribute nothing, and spec.compact_rows asks for it);
// given `keep` ([k] int64 of `keep_of` rows: a Backward by the inputs handle of a Forward that
// left rows out), all but those rows.
absl::StatusOr<PreparedStep> PrepareStep(const StepSpec& spec, const StepInputs& inputs,
                                         core::CallMode mode, const torch::Tensor& grad_output,
                                         int64_t chunk_bytes, bool compact = false,
                                         const torch::Tensor& keep = {}, int64_t keep_of = 0);

}  // namespace remotehead::client::internal
