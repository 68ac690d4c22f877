// What a Client holds behind its public header: the channel and stub, the retry loop every call
// runs in (channel.cc), and the attempts the calls share — a step call's stream (step_call.cc)
// and the head description read before streaming weights or gradients (head_calls.cc).
#pragma once

#include <grpcpp/grpcpp.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/client/client.h"
#include "remotehead/v1/head_service.grpc.pb.h"
#include "status.h"

namespace remotehead::client {
namespace internal {

using Stub = v1::HeadService::Stub;
struct PreparedStep;  // prepare_step.h

}  // namespace internal

struct Client::Impl {
  using Stub = internal::Stub;

  const ClientOptions& options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<Stub> stub;
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
                     const Request& request, Response* response) {
    return WithRetries(rpc, [&](grpc::ClientContext* context) {
      response->Clear();
      return internal::FromGrpc((stub.get()->*method)(context, request, response));
    });
  }

  // One attempt of a step call: a writer thread sends the header and the row chunks while this
  // thread assembles the streamed dX / outputs; then the summary. `grad_hidden` / `outputs`
  // (preallocated, or undefined when the call returns none) are overwritten by every attempt.
  // `token_ids`: a sampling Forward's drawn tokens.
  absl::Status StepAttempt(grpc::ClientContext* context, const internal::PreparedStep& p,
                           const torch::Tensor& grad_hidden, const torch::Tensor& outputs,
                           v1::StepSummary* summary, const torch::Tensor& token_ids = {});

  // The server's functions, read by the first call that needs them and kept (functions.cc);
  // Function: one of them by name, nullopt when the server lists none of that name.
  absl::StatusOr<std::vector<FunctionInfo>> Functions();
  absl::StatusOr<std::optional<FunctionInfo>> Function(const std::string& name);
  std::mutex functions_mu;
  std::optional<std::vector<FunctionInfo>> functions;
  // A per-row Forward's result buffers, shaped and typed as its function's listing says.
  absl::Status AllocateForwardOutputs(const StepSpec& spec, const internal::PreparedStep& p,
                                      ForwardResult* result);

  // The shape and dtype of a head, read inside an attempt (with that attempt's deadline) before
  // its weights or gradients are streamed into preallocated tensors.
  absl::StatusOr<v1::HeadInfo> DescribeForStream(const grpc::ClientContext& attempt_context,
                                                 const std::string& head_id);
};

}  // namespace remotehead::client
