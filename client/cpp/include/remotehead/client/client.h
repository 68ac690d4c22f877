// The C++ client of a remotehead server: one typed call per RPC of
// remotehead/v1/head_service.proto, taking and returning torch::Tensor.
//
// - Every fallible call returns absl::Status / absl::StatusOr; a server error comes back with
//   its gRPC code mapped 1:1 (absl and gRPC share google.rpc.Code) and the server's message.
// - A call that fails with UNAVAILABLE (no server yet, a restart, a dropped connection) is
//   retried as a whole with exponential backoff; no other code is ever retried. Step calls keep
//   their gradient identity across attempts, so the server's exactly-once ledger turns a replay
//   of work that did reach it into a no-op (StepSummary::replayed).
// - Step calls stream: a writer thread sends the header and then the rows of X (with the same
//   rows of targets, weights and aux inputs) while the calling thread receives dX / per-token
//   outputs as the server produces them, so upload, compute and download overlap.
//
// - On a mesh that evicts a lost replica, a call at this trainer's front that changes epochs is
//   asked again (ClientOptions::reconfigure_timeout); when the trainer's replica is evicted, the
//   call follows the mesh to the front that serves it now and returns REPLICA_MOVED (options.h).
//
// A Client is thread-safe: many threads may issue calls at once (each call has its own gRPC
// context and stream on a shared channel; a call keeps the front it began on if another call
// moves the client to another front).
//
// The value types the calls take and return have headers of their own, included here:
// options.h (connecting and retrying), head_types.h (heads, weights, gradients, the optimizer)
// and step_types.h (steps and the server's functions).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/client/head_types.h"
#include "remotehead/client/options.h"
#include "remotehead/client/step_types.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::client {

class Client {
 public:
  // Validates the options (INVALID_ARGUMENT naming the field) and opens the channel; does not
  // wait for a connection (the first call does, retrying while the server is UNAVAILABLE).
  static absl::StatusOr<std::shared_ptr<Client>> Create(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Head lifecycle. CreateHead / UploadHead / DropHead are retried on UNAVAILABLE like every
  // call: if an attempt took effect but its answer was lost, the retry reports ALREADY_EXISTS
  // (create, upload) or NOT_FOUND (drop).
  absl::StatusOr<HeadInfo> CreateHead(const std::string& head_id, const InitSpec& init);
  absl::StatusOr<HeadInfo> CreateHead(const std::string& head_id, const SafetensorsSource& source);
  // Streams weight [V, D] (then bias [V]) rows; the head takes weight's dtype.
  absl::StatusOr<HeadInfo> UploadHead(const std::string& head_id, const torch::Tensor& weight,
                                      const torch::Tensor& bias = {},
                                      const UploadOptions& options = {});
  absl::StatusOr<HeadInfo> DescribeHead(const std::string& head_id);
  absl::StatusOr<std::vector<HeadInfo>> ListHeads();
  absl::Status DropHead(const std::string& head_id);
  // dtype unset: the head's own. `pin`: the export is refused (FAILED_PRECONDITION, nothing
  // streamed) unless the server process and the weight version are the ones the caller holds,
  // so a checkpoint never pairs a body with another version's head.
  absl::StatusOr<HeadWeights> ExportWeights(const std::string& head_id,
                                            std::optional<torch::ScalarType> dtype = {},
                                            const ExportPin& pin = {});
  // Writes a safetensors file on the server (`path` relative to its --checkpoint_dir; atomic,
  // replacing only a checkpoint remotehead wrote); returns the bytes written. Empty names: the
  // server's defaults (lm_head.weight, lm_head.bias).
  absl::StatusOr<int64_t> SaveWeights(const std::string& head_id, const std::string& path,
                                      const std::string& weight_name = "",
                                      const std::string& bias_name = "");

  // Gradients and the server-side optimizer. dtype unset: the accumulators' (HeadInfo::grad_dtype:
  // float32 unless the head is in the memory mode).
  absl::StatusOr<HeadGradients> FetchGradients(const std::string& head_id,
                                               std::optional<torch::ScalarType> dtype = {});
  absl::StatusOr<HeadInfo> ZeroGradients(const std::string& head_id);
  // A single caller's optimizer step is not idempotent, so before retrying one the client asks
  // the server whether the failed attempt took effect (the head's weight_version moved past the
  // version read before the first attempt) and, if it did, returns that state instead of
  // stepping twice. This costs one DescribeHead round trip per call.
  // A synchronous step (options.synchronous) is retried as it is: the server answers a retry of
  // a step it applied with that step's HeadInfo. It returns once every rank came, so
  // ClientOptions::deadline, when set, must leave room for the slowest rank (up to the server's
  // --sync_step_timeout_seconds); a step whose call ran out of time may still be applied when
  // the last rank comes, and calling it again returns its answer.
  absl::StatusOr<HeadInfo> OptimizerStep(const std::string& head_id,
                                         const OptimizerStepOptions& options);

  // Durable training state (a server started with --state_dir; FAILED_PRECONDITION without one).
  // SaveHeadState writes the head's whole training state — weights, bias, optimizer state and
  // version — on the server now (on a head group or a mesh: every rank its shard, under one
  // state id) and returns the head's info, whose state_id names the state for RestoreHeadState.
  // RestoreHeadState puts the head back to that state (weights, optimizer state, version) and
  // zeroes its gradients (a new accumulation window); NOT_FOUND for an unknown state id or head,
  // INVALID_ARGUMENT for a state of another head's shape. Both go to a mesh's leader, like every
  // change to all replicas, and are retried on UNAVAILABLE (saving again writes a new state;
  // restoring again gives the same head).
  absl::StatusOr<HeadInfo> SaveHeadState(const std::string& head_id);
  absl::StatusOr<HeadInfo> RestoreHeadState(const std::string& head_id,
                                            const std::string& state_id);

  // Tied embeddings (a model whose input embedding is this head; RemoteHead::embed is the
  // differentiable form). The rows W[ids] (ids int64 [n], each in [0, V); repeats allowed) in
  // `dtype` (unset: the head's); `pin` as ExportWeights'. On a group every rank reads its rows.
  absl::StatusOr<EmbeddingRows> EmbeddingLookup(const std::string& head_id,
                                                const torch::Tensor& ids,
                                                std::optional<torch::ScalarType> dtype = {},
                                                const ExportPin& pin = {});
  // dW[ids] += grad ([n, D], any float dtype; repeated ids add up) on the server, exactly once
  // per `gradient_id` (kept apart from the head steps' contributions under the same id, so one
  // micro-batch's head step and embedding gradient share it). `pin`: what the lookup read —
  // its weight version (EmbeddingRows::weight_version) and the server process (FAILED_PRECONDITION,
  // nothing added, once the head moved on or the server restarted). Retried like a step.
  absl::StatusOr<EmbeddingGradientResult> EmbeddingGradient(const std::string& head_id,
                                                            const torch::Tensor& ids,
                                                            const torch::Tensor& grad,
                                                            const GradientId& gradient_id,
                                                            const ExportPin& pin = {});

  // Every function the server computes (read once per Client and kept: a Forward with
  // reduction NONE shapes its outputs from it).
  absl::StatusOr<std::vector<FunctionInfo>> ListFunctions();

  // Fused: loss, dX and (spec.accumulate_weight_grad) dW on the server in one pass.
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const StepSpec& spec,
                                                        const StepInputs& inputs);
  // Outputs only, nothing accumulated (spec.accumulate_weight_grad is ignored).
  absl::StatusOr<ForwardResult> Forward(const StepSpec& spec, const StepInputs& inputs);
  // Two-phase backward: the rows again with dL/d(output) — grad_output [N] for reduction NONE,
  // a single value (dL/d(loss), sent as the header's upstream scale) otherwise. The server
  // recomputes the logits, returns dX and adds dW (exactly once per gradient id).
  absl::StatusOr<BackwardResult> Backward(const StepSpec& spec, const StepInputs& inputs,
                                          const torch::Tensor& grad_output);

  // The options as given (`target`, `rank`: as resolved at Create; target() is the front dialled
  // now).
  const ClientOptions& options() const { return options_; }
  ClientStats stats() const;
  // The mesh replica whose front this trainer dials now (0 off a mesh), and its address.
  int replica() const;
  std::string target() const;
  // Whether this client knows a mesh's fronts (ClientOptions' list of addresses).
  bool meshed() const;
  // Counts `calls` resent after a move (ClientStats::replays): RemoteHead's replay journal counts
  // its own; a program that resends its calls itself after REPLICA_MOVED may count them here.
  void CountReplays(int64_t calls);

 private:
  struct Impl;
  Client(ClientOptions options, std::unique_ptr<Impl> impl);

  ClientOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remotehead::client
