// One ForwardBackward / Forward / Backward call, in the server's own types (step_call.h):
// validates the call against its head, turns its rows into engine calls whose dX (or per-token
// outputs) go back to the trainer, accumulates dW into scratch buffers, and commits them to the
// head only when the whole request succeeded — so a failed, cancelled or disconnected request
// leaves the head's gradients bit-identical, and a replayed gradient id is recognised and not
// added twice.
//
// The path of one call: its stream's reactor and pipeline (rpc/stream_reactor.h,
// rpc/stream_pipeline.h, gRPC) hand each message to StepStream (rpc/step_stream.cc, the protobuf
// side), which reads it into core types: the header → Begin (the engine's CallPlan, the version
// and identity, admission's EstimateMemory); rows → AddRows, batched to the engine's chunk size →
// ComputeRows → core::FusedForwardBackward / Forward / Backward (core/src/engine.cc); the end of
// the stream → Finish (commit, summary).
//
// Not thread-safe: the pipeline hands it one message at a time, in order.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/service/head_registry.h"
#include "service/request_memory.h"
#include "step/engine_call.h"
#include "step/retained_inputs.h"
#include "step/row_batcher.h"
#include "step/row_compaction.h"
#include "step/step_call.h"
#include "step/step_teacher.h"

namespace remotehead::server {

class StepSession {
 public:
  // kFused: ForwardBackward; kForward: outputs only, nothing accumulated; kBackward: the
  // two-phase backward (dL/dy per row for reduction NONE; for a scalar reduction dL/dloss is
  // the options' upstream_scale), with X re-sent or taken from a Forward's retained inputs.
  StepSession(HeadRegistry* registry, RetainedInputStore* retained, core::CallMode mode)
      : registry_(registry), retained_(retained), mode_(mode) {}
  StepSession(const StepSession&) = delete;
  StepSession& operator=(const StepSession&) = delete;

  // The call's header, once, before any rows (the transport keeps that order). With `fanout` (the
  // front of a head group), every engine call and the commit run on every rank through it.
  absl::Status Begin(StepCall call, std::unique_ptr<StepFanout> fanout = nullptr);
  // The rows of one message; each computed batch's results go to `sink`. Batches are cut at fixed
  // rows — every batch_rows() rows of the call, the last one when its last row (header.rows)
  // has come — never by arrival: so the same call gives the same bits whatever the timing, the
  // message sizes the transport chose to deliver at once, or the number of streams it came over.
  absl::Status AddRows(StepRowsIn rows, const StepResultSink& sink);
  // The client has sent everything: computes what is left, checks completeness, commits.
  absl::StatusOr<StepOutcome> Finish(const StepResultSink& sink);

  bool has_begun() const { return begun_; }
  // After Begin: what is computed; after Finish: how much, and the largest logits chunk.
  const std::string& head_id() const { return call_.head_id; }
  const std::string& function() const { return call_.options.function; }
  int64_t valid_tokens() const { return outcome_.valid_tokens; }
  int64_t logits_chunk_bytes() const { return logits_chunk_bytes_; }
  // After Begin: what the call's rows are (row_batcher.h).
  RowLayout row_layout() const;
  // After Begin: the bytes this request will hold while it runs — one engine call on a
  // batch (core's memory model, CallPlan::Memory), the scratch dW, the rows and results the
  // transport may buffer for it (`pipeline_bytes`), the inputs a Forward retains.
  MemoryEstimate EstimateMemory(int64_t pipeline_bytes) const;
  // Asked between chunks of every engine call (cancellation, deadline).
  void set_should_stop(std::function<bool()> should_stop) {
    options_.should_stop = std::move(should_stop);
  }
  void set_fused_blocks(bool fused) { options_.fused_blocks = fused; }  // --fused_blocks
  // Asked for more admitted bytes when the inputs a Forward retains outgrow what its estimate
  // reserved for them (per-token weights and aux are known only as they arrive).
  void set_reserve_more(std::function<absl::Status(int64_t bytes, const std::string& why)> f) {
    reserve_more_ = std::move(f);
  }

 private:
  // The call against its head, in the order it is checked: the engine's plan, the retained
  // inputs, the version and the identity.
  absl::Status PlanBatches();
  absl::Status CheckRetainedInputs();
  absl::Status CheckVersionAndIdentity();

  // Rows.
  absl::StatusOr<torch::Tensor> GradOutputOf(const StepRowsIn& rows) const;
  // The inputs of a message (on the head's device), or none for a Backward by handle, whose
  // rows are the retained inputs'.
  absl::StatusOr<core::TokenBatch> InputsOf(const StepRowsIn& rows,
                                            const torch::Tensor& grad_output) const;
  // Queues the part of request rows [first_row, …) for batching — without the rows that
  // contribute nothing (row_compaction.h) — or computes it now when it cannot be batched.
  absl::Status Enqueue(RowBatcher::Part part, int64_t first_row, const StepResultSink& sink);
  // Computes everything pending, then gives back the dropped rows received so far as zeros.
  absl::Status FlushReceived(const StepResultSink& sink);
  // A retaining Forward keeps the rows as sent (dropped ones too: its Backward drops the same).
  absl::Status Retain(const core::TokenBatch& rows);
  // How the batcher's batches are computed: ComputeRows with this mode's grad_output.
  RowBatcher::Compute ComputeBatch(const StepResultSink& sink);
  // Computes the next kept rows; their results, placed at their request rows, go to `sink`.
  absl::Status ComputeRows(core::TokenBatch batch, const torch::Tensor& grad_output,
                           const StepResultSink& sink);
  // Runs the engine for one batch in this session's mode; fills dX / outputs / token ids.
  absl::Status Compute(const core::TokenBatch& batch, const torch::Tensor& grad_output,
                       EngineOutputs* results);
  // The engine call on this process's head (on a group, its part of the call on every rank).
  absl::Status ComputeHere(const core::Head& head, const core::Head* teacher,
                           const core::TokenBatch& batch, const torch::Tensor& grad_output,
                           EngineOutputs* results);
  void AddStats(const core::StepStats& stats);
  // Adds the scratch dW to the head (on a group: on every rank, the front last).
  absl::StatusOr<CommitResult> Commit();

  // The end.
  absl::Status ComputeRemaining(const StepResultSink& sink);
  absl::Status CheckComplete() const;
  absl::StatusOr<std::string> RetainInputs(const CommitResult& commit);
  StepOutcome Outcome(const CommitResult& commit);

  HeadRegistry* registry_;
  RetainedInputStore* retained_;
  const core::CallMode mode_;
  std::unique_ptr<StepFanout> fanout_;  // on a group: the other ranks
  std::shared_ptr<HeadEntry> entry_;
  PlannedTeacher teacher_;  // a two-head call's teacher (step_teacher.h)
  // The head's version and gradient window the request computes on: fixed at the header when
  // it pins a version (expected_weight_version, inputs_handle), else at its first computation.
  std::optional<HeadPin> pin_;
  bool begun_ = false;
  StepCall call_;
  core::StepOptions& options_ = call_.options;  // the engine's options, this process's own set
  core::CallPlan plan_;                 // the engine's plan for these options (chunk sizes, memory)
  torch::Device device_ = torch::kCPU;  // the head's (fixed for its lifetime)
  torch::ScalarType head_dtype_ = torch::kFloat;
  core::GradientBuffers scratch_;                 // with call_.gradient
  std::shared_ptr<const RetainedInputs> inputs_;  // Backward by handle
  std::vector<core::TokenBatch> kept_rows_;       // Forward that retains its inputs
  int64_t kept_bytes_ = 0;                        // their bytes so far
  int64_t kept_reserved_ = 0;                     // and what admission holds for them
  std::function<absl::Status(int64_t, const std::string&)> reserve_more_;
  RowBatcher batcher_;         // the rows received and not yet computed
  RowCompaction compaction_;   // the rows that contribute nothing, dropped (when the function says)
  int64_t received_rows_ = 0;  // rows taken from the client (or the retained inputs)
  bool coupled_batch_done_ = false;  // a row-coupled call's one batch was computed
  int64_t next_row_ = 0;             // request rows whose results have been produced
  StepOutcome outcome_;              // the summary's sums so far (tokens, chunks, extras)
  torch::Tensor loss_sum_;           // the batches' losses so far, on the device (read at Finish)
  HealthWindow health_;              // the head's health over the calls that accumulated dW
  int64_t logits_chunk_bytes_ = 0;
};

}  // namespace remotehead::server
