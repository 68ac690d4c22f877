// What a request holds in memory while it runs, for admission control (admission.h): the one
// home of the server's byte counts — a step call's (core's memory model for one engine call,
// the scratch dW, the rows and results in flight, the inputs a Forward retains), an upload's
// buffer, a loaded head's weights and gradients.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/call_plan.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::server {

struct MemoryEstimate {
  int64_t bytes = 0;
  std::string breakdown;  // e.g. "engine workspace 4 MiB (logits …) + scratch dW 122 MiB + …"
};

// A step call of `rows` rows computed in batches of `batch_rows` under `plan`.
struct StepMemoryInputs {
  const core::CallPlan* plan = nullptr;
  core::CallMode mode = core::CallMode::kFused;
  int64_t rows = 0;
  int64_t batch_rows = 1;
  int64_t scratch_bytes = 0;      // the scratch dW it accumulates into (0: none)
  int64_t pipeline_bytes = 0;     // what the transport may buffer for it (StreamPipelineBytes)
  bool retains_inputs = false;    // a Forward that keeps its inputs for the Backward
  int64_t teacher_row_bytes = 0;  // a two-head call: a row of the teacher's hidden states
};
MemoryEstimate StepMemory(const StepMemoryInputs& in);

// What admission reserves up front for the inputs a Forward retains: X, int64 targets and a
// two-head call's teacher hidden states (the per-token weights and aux are asked for as they
// arrive).
int64_t RetainedInputsBytes(const core::CallPlan& plan, int64_t rows,
                            int64_t teacher_row_bytes = 0);

// The most bytes of X (and of results) in one engine call of a step (step/row_batcher.h's
// BatchRows), so that compute starts while later rows still arrive.
inline constexpr int64_t kMaxBatchBytes = int64_t{8} << 20;

// What the transport may hold for one step call over `streams` streams (StepHeader.stripe): the
// request messages each reads ahead (4 MiB each at most, plus the one being handled; their
// hidden rows staged in batch buffers, rpc/row_staging.h, of which at most two are partly
// filled beyond those rows) and the responses not yet taken by the client.
int64_t StreamPipelineBytes(int streams, int read_ahead_messages,
                            int64_t max_pending_response_bytes);

// The CPU buffer an upload assembles the head's rows in.
MemoryEstimate UploadBufferMemory(const std::string& head_id, int64_t vocab_size,
                                  int64_t hidden_size, bool bias, torch::ScalarType dtype);

// A tied embedding's rows of `ids` ids (named by `field`) of a head of width `hidden_size`, in
// `dtype`: a lookup's answer, a gradient's assembly buffer.
MemoryEstimate EmbeddingRowsMemory(const std::string& head_id, int64_t ids, int64_t hidden_size,
                                   torch::ScalarType dtype, const std::string& field);

// A head on this server: its weights and its gradients in `grad_dtype` (unset: float32, or
// float64 for a float64 head). `field_prefix` names where the sizes came from in messages
// ("init.", "--head ", "header.").
absl::StatusOr<MemoryEstimate> HeadMemory(const std::string& head_id, int64_t vocab_size,
                                          int64_t hidden_size, torch::ScalarType dtype, bool bias,
                                          std::optional<torch::ScalarType> grad_dtype,
                                          const std::string& field_prefix);

}  // namespace remotehead::server
