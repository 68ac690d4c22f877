// What a Client holds behind its public header: the channel and stub, the retry loop every call
// runs in (channel.cc), and what the step calls share (step_call.cc): one call's run and one
// attempt's streams.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/client/client.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "status.h"

namespace remotehead::client {
namespace internal {

using Stub = v1::HeadService::Stub;
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

}  // namespace internal

struct Client::Impl {
  using Stub = internal::Stub;

  const ClientOptions& options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<Stub> stub;
  // Streams 1..C-1 of a striped step (ClientOptions::streams), each on its own connection.
  std::vector<std::shared_ptr<grpc::Channel>> stripe_channels;
  // A channel to `address` with the client's credentials and arguments.
  std::function<std::shared_ptr<grpc::Channel>(const std::string& address)> open;
  // A mesh's leader, when it is not `stub`'s server (known from ClientOptions::fronts or from
  // a NOT_THE_LEADER): the operations that change every replica go there.
  std::mutex leader_mu;
  std::shared_ptr<grpc::Channel> leader_channel;
  std::shared_ptr<Stub> leader_stub;
  std::atomic<int64_t> calls{0}, attempts{0}, retries{0};
  std::mutex rng_mu;
  std::mt19937_64 rng{std::random_device{}()};

  explicit Impl(const ClientOptions& o) : options(o) {}

  // The backoff `ms`, spread by the retry policy's jitter.
  std::chrono::milliseconds Jittered(double ms);

  // Runs `attempt` until it returns anything but UNAVAILABLE, or the attempts or the deadline
  // run out. `already_done` (optional) is asked before every retry whether the failed attempt
  // took effect after all (for calls that are not idempotent): true ends the call with OK;
  // UNAVAILABLE counts as that attempt's failure.
  using Attempt = std::function<absl::Status(grpc::ClientContext*)>;
  using AlreadyDone = std::function<absl::StatusOr<bool>(grpc::ClientContext*)>;
  absl::Status WithRetries(const char* rpc, const Attempt& attempt,
                           const AlreadyDone& already_done = nullptr);

  template <typename Request, typename Response>
  absl::Status Unary(const char* rpc,
                     grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                     const Request& request, Response* response, Stub* on = nullptr) {
    Stub* target = on != nullptr ? on : stub.get();
    return WithRetries(rpc, [&](grpc::ClientContext* context) {
      response->Clear();
      return internal::FromGrpc((target->*method)(context, request, response));
    });
  }
  // Connects the mesh's leader at `address` (the operations that change every replica).
  void ConnectLeader(const std::string& address);
  // `call` on the leader's stub (the client's own when no other is known); after a
  // NOT_THE_LEADER that names the leader, connected to it and run once more there.
  absl::Status ToLeader(const std::function<absl::Status(Stub*)>& call);

  // A step call in `mode`, as ForwardBackward, Forward and Backward all run it: its inputs
  // prepared once (PrepareStep; `grad_output`: a Backward's), its buffers allocated — `allocate`
  // those of its kind (dX, a Forward's outputs), the token extras the spec asks for here — then
  // every attempt streamed into them (WithRetries, the call named by its mode) and the summary
  // read back.
  using AllocateStepBuffers =
      std::function<absl::Status(const internal::PreparedStep&, internal::StepBuffers*)>;
  absl::StatusOr<internal::StepResults> RunStep(core::CallMode mode, const StepSpec& spec,
                                                const StepInputs& inputs,
                                                const torch::Tensor& grad_output,
                                                const AllocateStepBuffers& allocate);
  // One attempt of a step call, on ClientOptions::streams streams: a writer thread per stream
  // sends its header and row chunks while a reader per stream (this thread reads the first)
  // assembles the streamed dX / outputs; then the summary. The defined tensors of `buffers`
  // (preallocated) are overwritten by every attempt.
  absl::Status StepAttempt(grpc::ClientContext* context, const internal::PreparedStep& p,
                           const internal::StepBuffers& buffers, v1::StepSummary* summary);
  // A new key naming one striped attempt's streams (empty for one stream).
  std::string StripeKey();

  // The server's functions, read by the first call that needs them and kept (functions.cc);
  // Function: one of them by name, nullopt when the server lists none of that name.
  absl::StatusOr<std::vector<FunctionInfo>> Functions();
  absl::StatusOr<std::optional<FunctionInfo>> Function(const std::string& name);
  std::mutex functions_mu;
  std::optional<std::vector<FunctionInfo>> functions;
  // What each Forward that kept its inputs on the server left out, by inputs handle (the rows
  // kept [k] int64 of how many the caller gave), so that a Backward by that handle sends
  // grad_output for the same rows, targets given or not; forgotten when the Backward succeeds,
  // at most kMaxHandleRows kept (the oldest go first).
  struct HandleRows {
    torch::Tensor kept;
    int64_t rows = 0;
  };
  static constexpr size_t kMaxHandleRows = 4096;
  std::mutex handle_rows_mu;
  std::map<std::string, HandleRows> handle_rows;
  std::deque<std::string> handle_order;
  std::optional<HandleRows> RowsOfHandle(const std::string& handle);
  void AfterStep(const internal::PreparedStep& p, const std::string& handle,
                 const std::string& backward_by_handle);
  // A per-row Forward's result buffers, shaped and typed as its function's listing says.
  absl::Status AllocateForwardOutputs(const StepSpec& spec, const internal::PreparedStep& p,
                                      internal::StepBuffers* buffers);
};

}  // namespace remotehead::client
