// One ForwardBackward / Forward / Backward call, independent of gRPC: validates the header,
// turns the StepRows messages into engine calls whose dX (or per-token outputs) go back to the
// trainer, accumulates dW into scratch buffers, and commits them to the head only when the
// whole request succeeded — so a failed, cancelled or disconnected request leaves the head's
// gradients bit-identical, and a replayed gradient id is recognised and not added twice.
//
// The path of one call: StepReactor (step_reactor.cc, gRPC) hands each message to OnRequest:
// the header → OnHeader (validation, the engine's CallPlan, admission's EstimateMemory); rows →
// OnRows, batched to the engine's chunk size → ComputeRows → core::FusedForwardBackward /
// Forward / Backward (core/src/engine.cc); the end of the stream → OnClientDone (commit,
// summary).
//
// Not thread-safe: the reactor hands it one message at a time, in order.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "group/group_steps.h"
#include "step/engine_call.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/v1/head_service.pb.h"
#include "request_memory.h"
#include "step/retained_inputs.h"

namespace remotehead::server {

class StepSession {
 public:
  // kFused: ForwardBackward; kForward: outputs only, nothing accumulated; kBackward: the
  // two-phase backward (dL/dy per row for reduction NONE; for a scalar reduction dL/dloss is
  // header.upstream_scale), with X re-sent or taken from a Forward's retained inputs.
  // With `group` (the front of a head group), every engine call and the commit run on every
  // rank (group_steps.h).
  StepSession(HeadRegistry* registry, RetainedInputStore* retained, core::CallMode mode,
              int64_t response_chunk_bytes, HeadGroup* group = nullptr)
      : registry_(registry),
        retained_(retained),
        mode_(mode),
        response_chunk_bytes_(response_chunk_bytes),
        group_(group) {}
  // On a group, a request that ends without committing discards the other ranks' scratch.
  ~StepSession();
  StepSession(const StepSession&) = delete;
  StepSession& operator=(const StepSession&) = delete;

  // Handles one client message; appends what goes back to the client to `responses`.
  // Takes the message: the rows it carries are computed from its bytes without a copy. Rows
  // are batched up to the engine's chunk size while `more_queued` (the transport holds further
  // messages); otherwise everything received is computed now, so a client that waits for dX
  // before sending more rows is never left waiting.
  absl::Status OnRequest(v1::StepRequest request, std::vector<v1::StepResponse>* responses,
                         bool more_queued = false);
  // The client has sent everything: checks completeness, commits, appends the summary.
  absl::Status OnClientDone(std::vector<v1::StepResponse>* responses);

  bool has_header() const { return header_.has_value(); }
  // After OnClientDone succeeded (metrics): what was computed, and the largest logits chunk.
  const std::string& head_id() const { return header_->head_id(); }
  const std::string& function() const { return options_.function; }
  int64_t valid_tokens() const { return valid_tokens_; }
  int64_t logits_chunk_bytes() const { return logits_chunk_bytes_; }
  // After the header: the bytes this request will hold while it runs — one engine call on a
  // batch (core's memory model, CallPlan::Memory), the scratch dW, the rows and results the
  // transport may buffer for it (`pipeline_bytes`), the inputs a Forward retains.
  MemoryEstimate EstimateMemory(int64_t pipeline_bytes) const;
  // Asked between chunks of every engine call (cancellation, deadline).
  void set_should_stop(std::function<bool()> should_stop) {
    options_.should_stop = std::move(should_stop);
  }
  // Asked for more admitted bytes when the inputs a Forward retains outgrow what its estimate
  // reserved for them (per-token weights and aux are known only as they arrive).
  void set_reserve_more(std::function<absl::Status(int64_t bytes, const std::string& why)> f) {
    reserve_more_ = std::move(f);
  }
  // Reported in the summary.
  void set_timings(const v1::StepTimings& timings) { timings_ = timings; }

 private:
  // Rows received and not yet computed: the engine runs on batches of batch_rows_ rows (its
  // own chunk size, capped), whatever the size of the client's messages.
  struct PendingRows {
    std::shared_ptr<const v1::StepRequest> message;  // owns the bytes the tensors alias
    core::TokenBatch batch;
    torch::Tensor grad_output;  // Backward with reduction NONE
  };

  // The header, in the order it is validated.
  // The header's options (step_header.h), then what needs the head: the engine's plan, the
  // retained inputs, the version and the identity.
  absl::Status OnHeader(const v1::StepHeader& header);
  absl::Status CheckRetainedInputs(const v1::StepHeader& header);
  absl::Status CheckVersionAndIdentity(const v1::StepHeader& header);

  // Rows.
  absl::Status OnRows(std::shared_ptr<const v1::StepRequest> message,
                      std::vector<v1::StepResponse>* responses);
  absl::StatusOr<torch::Tensor> DecodeGradOutput(const v1::StepRows& rows) const;
  // The rows of a message: its tensors (views of its bytes, on the head's device), or the
  // retained inputs' rows for a Backward by handle.
  absl::StatusOr<core::TokenBatch> DecodeInputs(const v1::StepRows& rows,
                                                const torch::Tensor& grad_output) const;
  bool WellFormed(const core::TokenBatch& b, const torch::Tensor& grad_output) const;
  // Queues a part for batching, or computes it now when it cannot be batched.
  absl::Status Enqueue(PendingRows part, std::vector<v1::StepResponse>* responses);
  // Computes the first `rows` pending rows.
  absl::Status FlushPending(int64_t rows, std::vector<v1::StepResponse>* responses);
  // Computes rows [next_row_, next_row_ + rows of batch) and appends their results.
  absl::Status ComputeRows(core::TokenBatch batch, const torch::Tensor& grad_output,
                           std::vector<v1::StepResponse>* responses);
  // Runs the engine for one batch in this session's mode; fills dX / outputs / token ids.
  absl::Status Compute(const core::TokenBatch& batch, const torch::Tensor& grad_output,
                       EngineOutputs* results);
  // The engine call on this process's head (on a group, its part of the call on every rank).
  absl::Status ComputeHere(const core::Head& head, const core::TokenBatch& batch,
                           const torch::Tensor& grad_output, EngineOutputs* results);
  void AddStats(const core::StepStats& stats);
  // Adds the scratch dW to the head (on a group: on every rank, the front last).
  absl::StatusOr<CommitResult> Commit();

  // The end.
  absl::Status ComputeRemaining(std::vector<v1::StepResponse>* responses);
  absl::Status CheckComplete() const;
  absl::Status RetainInputs(const CommitResult& commit, v1::StepSummary* summary);
  void FillSummary(const CommitResult& commit, v1::StepSummary* summary);

  HeadRegistry* registry_;
  RetainedInputStore* retained_;
  const core::CallMode mode_;
  const int64_t response_chunk_bytes_;
  HeadGroup* const group_;
  core::VocabShard shard_;     // on a group: this head's shards (options_.shard points here)
  int64_t group_session_ = 0;  // on a group: this request's id in the step commands
  bool group_open_ = false;    // the other ranks hold scratch for it
  std::shared_ptr<HeadEntry> entry_;
  // The head's version and gradient window the request computes on: fixed at the header when
  // it pins a version (expected_weight_version, inputs_handle), else at its first computation.
  std::optional<HeadPin> pin_;
  std::optional<v1::StepHeader> header_;
  core::StepOptions options_;
  core::CallPlan plan_;                 // the engine's plan for these options (chunk sizes, memory)
  torch::Device device_ = torch::kCPU;  // the head's (fixed for its lifetime)
  torch::ScalarType head_dtype_ = torch::kFloat;
  std::optional<torch::ScalarType> grad_hidden_dtype_;
  std::optional<GradientKey> key_;
  core::GradientBuffers scratch_;
  std::shared_ptr<const RetainedInputs> inputs_;  // Backward by handle
  std::vector<core::TokenBatch> kept_rows_;       // Forward that retains its inputs
  int64_t kept_bytes_ = 0;                        // their bytes so far
  int64_t kept_reserved_ = 0;                     // and what admission holds for them
  std::function<absl::Status(int64_t, const std::string&)> reserve_more_;
  std::deque<PendingRows> pending_;
  int64_t pending_rows_ = 0;
  int64_t batch_rows_ = 1;
  int64_t received_rows_ = 0;  // rows taken from the client (or the retained inputs)
  int64_t next_row_ = 0;       // rows computed, whose results have been produced
  int64_t valid_tokens_ = 0;
  double loss_ = 0;
  int64_t chunk_rows_ = 0;
  int64_t num_chunks_ = 0;
  int64_t logits_chunk_bytes_ = 0;
  std::map<std::string, double> extras_;
  v1::StepTimings timings_;
};

}  // namespace remotehead::server
