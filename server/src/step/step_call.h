// A step call in the server's own types — what StepSession computes on and gives back. The
// wire's StepHeader, StepRows and StepResponse (remotehead.v1) are read into these and written
// from them by rpc/step_stream.cc, the session's protobuf-facing side; the session itself
// includes no protobuf.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/service/head_registry.h"

namespace remotehead::server {

// The header of a call: everything it states, read and checked as far as the header alone
// determines (step_header.h). What needs the head — the function's params against the head, the
// incarnation and version, then the identity — is checked by the session, in that order.
struct StepCall {
  std::string head_id;
  core::StepOptions options;  // function … logits_dtype (not first_row, shard, should_stop)
  std::optional<torch::ScalarType> grad_hidden_dtype;  // dX's dtype when asked
  int64_t rows = 0;                                    // >= 0
  std::optional<int64_t> valid_tokens;                 // as declared; checked at the end
  std::string expected_incarnation;                    // empty: unchecked
  std::optional<int64_t> expected_weight_version;      // unset: unchecked
  bool accumulate_weight_grad = false;                 // dW accumulates, under `gradient`
  std::optional<GradientKey> gradient;  // with accumulate_weight_grad, when named (has a trainer)
  std::string inputs_handle;            // a Backward on a Forward's inputs
  double retain_inputs_seconds = 0;     // > 0: a Forward that retains its inputs
  // A two-head function's frozen teacher head (empty: none); checked against the function by
  // the header's reading, against the registry and the student by the session (step_teacher.h).
  std::string teacher_head_id;
};

// The rows of one message: views of its bytes, which `owner` keeps alive.
struct StepRowsIn {
  int64_t row_offset = 0;
  core::TokenBatch batch;     // each tensor undefined when the message carries none
  torch::Tensor grad_output;  // dL/dy per row, undefined when not sent
  std::shared_ptr<const void> owner;

  // Any of hidden, targets, weights, aux, teacher_hidden was sent.
  bool has_inputs() const {
    return batch.hidden.defined() || batch.targets.defined() || batch.weights.defined() ||
           !batch.aux.empty() || batch.teacher_hidden.defined();
  }
};

// What rows [first_row, first_row + n) give back: dX (ForwardBackward, Backward) or a Forward's
// outputs (and drawn token ids); the tensors that do not apply stay undefined.
struct StepRowResults {
  int64_t first_row = 0;
  torch::Tensor grad_hidden;
  torch::Tensor outputs;
  torch::Tensor token_ids;
  core::TokenExtras token_extras;  // StepCall::options.token_extras, by name
};
// Where the session hands each batch's results as soon as they exist (the transport encodes and
// queues them, so dX streams back while later rows are computed).
using StepResultSink = std::function<absl::Status(StepRowResults)>;

// The whole call's summary, after everything was computed and committed.
struct StepOutcome {
  bool replayed = false;  // the gradient identity had been applied already
  int64_t weight_version = 0;
  double loss = 0;
  int64_t valid_tokens = 0;
  double denominator = 1;
  int64_t chunk_rows = 0;
  int64_t num_chunks = 0;
  std::map<std::string, double> extras;
  std::string inputs_handle;  // a Forward that retained its inputs
};

// A request's engine calls on the other ranks of a head group (group_steps.h: GroupStepFront).
// Both calls take the group's lane before any head's lock, and run `here` — this process's part —
// when every rank has the command. A two-head call reads its teacher under the teacher's lock
// too (HeadEntry::ReadPinnedWith), on every rank.
class StepFanout {
 public:
  virtual ~StepFanout() = default;
  // This head's vocabulary shards on the group (set into the options of every engine call).
  virtual const core::VocabShard* Shard(const std::vector<core::ShardRange>& ranges) = 0;
  // One engine call on `entry`'s head at `*pin` (pinned here when unset), with `teacher`'s head
  // (null: none) read as well, on every rank: here(head, teacher head or null).
  struct Batch {
    core::CallMode mode;
    bool accumulate = false;
    int64_t first_row = 0;
    const core::TokenBatch* batch = nullptr;
    const torch::Tensor* grad_output = nullptr;
  };
  using Here = std::function<absl::Status(const core::Head&, const core::Head*)>;
  virtual absl::Status RunBatch(const Batch& call, const HeadEntry& entry, const HeadEntry* teacher,
                                std::optional<HeadPin>* pin, const Here& here) = 0;
  // The end of a request that accumulated: every rank commits its scratch dW, this process last.
  virtual absl::StatusOr<CommitResult> Commit(
      const StepCommit& commit, const std::function<absl::StatusOr<CommitResult>()>& here) = 0;
};

}  // namespace remotehead::server
