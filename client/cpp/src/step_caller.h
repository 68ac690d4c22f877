// The streaming step calls (ForwardBackward, Forward, Backward) over a Client's channel: each
// prepared once (prepare_step.h), then every attempt streams it — a writer thread per stream
// sends the header and the rows while the readers assemble dX / per-token outputs as they
// arrive, then the summary.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "channel.h"
#include "functions.h"
#include "remotehead/client/step_types.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::client::internal {

struct PreparedStep;  // prepare_step.h

// Where a step call's attempts write its results: dX, per-row outputs, a sampling Forward's
// drawn token ids (each undefined when the call returns none) and the token extras asked for.
struct StepBuffers {
  torch::Tensor grad_hidden, outputs, token_ids;
  TokenExtras token_extras;
};

// What a step call returns: its buffers, as the attempt that succeeded filled them, and the
// summary.
struct StepResults {
  StepBuffers buffers;
  StepSummary summary;
};

class StepCaller {
 public:
  // `channel` and `functions` must outlive the StepCaller.
  StepCaller(Channel& channel, FunctionListing& functions)
      : channel_(channel), functions_(functions) {}
  StepCaller(const StepCaller&) = delete;
  StepCaller& operator=(const StepCaller&) = delete;

  // As Client's calls of the same names (client.h).
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const StepSpec& spec,
                                                        const StepInputs& inputs);
  absl::StatusOr<ForwardResult> Forward(const StepSpec& spec, const StepInputs& inputs);
  absl::StatusOr<BackwardResult> Backward(const StepSpec& spec, const StepInputs& inputs,
                                          const torch::Tensor& grad_output);

 private:
  // A step call in `mode`, as ForwardBackward, Forward and Backward all run it: its inputs
  // prepared once (PrepareStep; `grad_output`: a Backward's), its buffers allocated — `allocate`
  // those of its kind (dX, a Forward's outputs), the token extras the spec asks for here — then
  // every attempt streamed into them (Channel::WithRetries, the call named by its mode) and the
  // summary read back.
  using AllocateStepBuffers = std::function<absl::Status(const PreparedStep&, StepBuffers*)>;
  absl::StatusOr<StepResults> Run(core::CallMode mode, const StepSpec& spec,
                                  const StepInputs& inputs, const torch::Tensor& grad_output,
                                  const AllocateStepBuffers& allocate);
  // One attempt of a step call, on ClientOptions::streams streams: a writer thread per stream
  // sends its header and row chunks while a reader per stream (this thread reads the first)
  // assembles the streamed dX / outputs; then the summary. The defined tensors of `buffers`
  // (preallocated) are overwritten by every attempt.
  absl::Status Attempt(grpc::ClientContext* context, const PreparedStep& p,
                       const StepBuffers& buffers, v1::StepSummary* summary);
  // A new key naming one striped attempt's streams (empty for one stream).
  std::string StripeKey();
  // A per-row Forward's result buffers, shaped and typed as its function's listing says.
  absl::Status AllocateForwardOutputs(const StepSpec& spec, const PreparedStep& p,
                                      StepBuffers* buffers);

  // What each Forward that kept its inputs on the server left out, by inputs handle (the rows
  // kept [k] int64 of how many the caller gave), so that a Backward by that handle sends
  // grad_output for the same rows, targets given or not; forgotten when the Backward succeeds,
  // at most kMaxHandleRows kept (the oldest go first).
  struct HandleRows {
    torch::Tensor kept;
    int64_t rows = 0;
  };
  static constexpr size_t kMaxHandleRows = 4096;
  std::optional<HandleRows> RowsOfHandle(const std::string& handle);
  void AfterStep(const PreparedStep& p, const std::string& handle,
                 const std::string& backward_by_handle);

  Channel& channel_;
  FunctionListing& functions_;
  std::mutex handle_rows_mu_;
  std::map<std::string, HandleRows> handle_rows_;
  std::deque<std::string> handle_order_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_{std::random_device{}()};
};

}  // namespace remotehead::client::internal
