// A remote LM head as a LibTorch autograd node: the trainer's graph ends in the hidden states,
// the server computes the head, and hidden.grad comes back through loss.backward().
//
//   auto client = *remotehead::client::Client::Create({.target = "head-server:50051"});
//   auto head = *remotehead::client::RemoteHead::Attach(client, {.head_id = "lm"});
//   auto loss = head.loss(hidden, labels);   // one ForwardBackward round trip
//   loss.backward();                         // hidden.grad = dX; dW accumulated on the server
//
// Two paths:
// - loss() (fused): the forward makes one ForwardBackward call — the loss, dX, and dW added on
//   the server — and keeps dX; the backward returns it. The server's dW is computed for an
//   upstream gradient equal to the spec's upstream_scale (default 1), so the loss must reach
//   backward() unscaled or scaled by exactly that factor: declare a loss scale (or 1/k for k
//   accumulated micro-batches — better, pass the whole batch's token count as the normalizer)
//   in the spec up front. When dW is accumulated, a backward whose grad_output differs from
//   upstream_scale (relative 1e-6) throws StatusError(FAILED_PRECONDITION) instead of leaving
//   dW silently inconsistent with dX; with accumulate_weight_grad off (frozen head) any
//   grad_output is exact, dX being linear in it. Without gradients (torch::NoGradGuard, or
//   hidden not requiring grad) loss() makes a Forward call instead: nothing is accumulated.
// - token_outputs() (two-phase): the forward makes a Forward call with reduction NONE and
//   returns per-token outputs (e.g. token_logprobs); the trainer combines them freely; the
//   backward makes a Backward call with the per-token dL/dy: the server recomputes the logits,
//   returns dX and adds dW. With spec.retain_inputs_seconds > 0 the server keeps the Forward's
//   rows and the Backward sends only dL/dy (falling back to sending X again if the server no
//   longer has them). Either way the Backward is pinned to the weight version the Forward saw:
//   after an optimizer step in between it fails instead of mixing two versions.
//
// Gradient identity: every call that adds dW carries (trainer, step, micro_batch). The trainer
// is the spec's gradient_id.trainer (or a random one per RemoteHead); step is the current step
// (BeginStep, or advanced by OptimizerStep); micro_batch counts the calls within the step. A
// retried call keeps its identity, so the server adds each contribution at most once.
//
// Data-parallel trainers (DataParallel, world_size > 1): each rank attaches with its rank; its
// trainer identity ends in "/rank-<rank>" so that no two ranks share one (the server would take
// the second rank's dW for a replay of the first's), and OptimizerStep is the ranks' synchronous
// step (SynchronousStep): applied once when every rank asked for it, dW averaged over the ranks.
//
// Meshes that evict a lost replica (a Client given ClientOptions::fronts; docs/meshes.md): when
// the trainer's replica is evicted, its Client moves to the front that serves it now
// (REPLICA_MOVED, client.h) and the RemoteHead resends there the calls that added dW since its
// last optimizer step (its replay journal, MoveOptions), then the call that failed: the training
// loop sees nothing.
//
// Errors: loss() / token_outputs() and their backward throw StatusError (a std::runtime_error
// carrying the absl::Status: the server's code and message) — autograd has no other channel.
// hidden may be [..., D] with targets [...]: both are flattened to rows and dX is reshaped back.
// One RemoteHead is meant for one training loop (its counters are guarded, but concurrent
// calls would interleave micro-batch numbers).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/client/client.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::client {

// An absl::Status thrown through LibTorch's autograd.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(absl::Status status);
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Whether a backward's dL/dloss `got` is the upstream gradient `declared` up front
// (StepSpec::upstream_scale), for which the server accumulated dW: equal, or within 1e-6 of
// |declared| (relative, so a loss scale of 65536 and one of 1e-3 are held to the same
// precision). NaN matches nothing. `declared` is never 0 (Attach refuses it). The Python
// client's remotehead.upstream_matches_declared is the same rule; both are tested against
// tests/data/upstream_scale_cases.json.
bool UpstreamMatchesDeclared(double declared, double got);

// This trainer's place among the data-parallel processes that train one head together (e.g.
// torchrun's RANK and WORLD_SIZE, or the trainer's own flags).
struct DataParallel {
  int rank = 0;        // in [0, world_size)
  int world_size = 1;  // 1: a single trainer, whose optimizer steps are its own
};

// What a RemoteHead does when its trainer moves to another replica of a mesh.
struct MoveOptions {
  // The replay journal: a host copy of each call that added dW since the last optimizer step (a
  // ForwardBackward's hidden rows, targets, weights, aux; a Backward's, and its dL/dy; an
  // embedding gradient's ids and rows) — about one step's worth of the head's inputs
  // (RemoteHead::journal_bytes) — resent to the new front after a move. false: nothing kept, and
  // a move throws StatusError(UNAVAILABLE, reason REPLICA_MOVED): the step's dW is gone.
  bool journal = true;
};

// Per-call additions to the RemoteHead's spec.
struct HeadCall {
  torch::Tensor weights;                     // [...] per-token weights (weighted_sum)
  std::map<std::string, torch::Tensor> aux;  // [...] each, e.g. GRPO's "advantages"
  std::optional<double> normalizer;          // e.g. the accumulated batch's valid tokens
  std::optional<std::string> function;       // overrides the spec's (loss) or token_logprobs
  std::map<std::string, double> params;      // merged over the spec's params
  std::optional<GradientId> gradient_id;     // default: (trainer, step, next micro-batch)
};

// Per-call options of RemoteHead::embed (a tied input embedding served by the head).
struct EmbedCall {
  // Its rows get no gradient (torch::nn::Embedding's padding_idx).
  std::optional<int64_t> padding_idx;
  // Multiplies the rows, as the model's embedding does (Gemma's sqrt(hidden_size), computed by
  // the caller in the model's own way and dtype).
  double scale = 1.0;
  std::optional<torch::ScalarType> dtype;  // of the rows (default: the head's)
  // Default: (trainer, step, the step's next embedding micro-batch): the k-th embed() of a step
  // shares its GradientId with the k-th loss() — the server keeps the two contributions apart.
  std::optional<GradientId> gradient_id;
};

class RemoteHead {
 public:
  // `spec` holds the defaults of every call (head_id required). Describes the head once: hidden
  // states are sent in the head's dtype, and dX comes back in the caller's. With
  // data_parallel.world_size > 1 the trainer identity (spec.gradient_id's trainer, or a random
  // one) gets "/rank-<rank>" appended unless it already ends so. Every call (steps, embedding
  // lookups and gradients, OptimizerStep) is pinned to the server process described here
  // (spec.expected_incarnation, unless set): after a restart they fail with FAILED_PRECONDITION
  // (SERVER_RESTARTED) and add nothing; attach anew to go on from the restored head. After a
  // move to another replica's front they are pinned to that front's process.
  static absl::StatusOr<RemoteHead> Attach(std::shared_ptr<Client> client, StepSpec spec,
                                           DataParallel data_parallel = {}, MoveOptions moves = {});

  // Fused scalar loss (the spec's function and reduction; NONE is refused). Differentiable
  // w.r.t. hidden. A 0-d float32 tensor (float64 for float64 hidden) on hidden's device.
  torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& labels,
                     const HeadCall& call = {});

  // Two-phase per-token outputs, shaped like targets (float32; float64 for float64 hidden), on
  // hidden's device; the function defaults to token_logprobs. Differentiable w.r.t. hidden.
  torch::Tensor token_outputs(const torch::Tensor& hidden, const torch::Tensor& targets,
                              const HeadCall& call = {});

  // A tied input embedding served by this head: W[ids] * scale, shaped ids.shape + [D], on ids'
  // device. Differentiable: its backward sends the gradient of the rows — summed per distinct
  // id in float32, padding_idx's dropped — to be added into the head's dW (Client::
  // EmbeddingGradient) under the call's gradient id, pinned to the version the lookup read.
  // Only distinct ids travel. With accumulate_weight_grad off, or without gradients, only the
  // lookup is made.
  torch::Tensor embed(const torch::Tensor& ids, const EmbedCall& call = {});

  // Starts optimizer step `step`: later calls are micro-batches 0, 1, … of it.
  void BeginStep(int64_t step);
  // The server-side optimizer step on this head, then BeginStep(step + 1); info() becomes the
  // HeadInfo it returns. With world_size > 1 it is the ranks' synchronous step
  // {step(), rank, world_size} pinned to the weight version info() holds (every rank must hold
  // the same; the server checks that they agree), unless `options` sets synchronous /
  // expected_weight_version itself; it returns once every rank asked for it.
  absl::StatusOr<HeadInfo> OptimizerStep(const OptimizerStepOptions& options);

  // The summary of the last completed call (loss, valid_tokens, extras, replayed, …).
  StepSummary last_summary() const;
  // The head as this trainer last left it: described at Attach, then each OptimizerStep's.
  const HeadInfo& info() const;
  const StepSpec& spec() const;
  const DataParallel& data_parallel() const;
  const std::string& trainer() const;  // the GradientId::trainer of this RemoteHead's calls
  Client& client() const;
  int64_t step() const;
  // The calls the replay journal keeps now, and the bytes of their host copies.
  int64_t journal_calls() const;
  int64_t journal_bytes() const;

  // Autograd nodes share this state, so a RemoteHead may be moved or copied (copies share
  // their counters) while graphs built with it are alive.
  struct State;

 private:
  explicit RemoteHead(std::shared_ptr<State> state) : state_(std::move(state)) {}

  std::shared_ptr<State> state_;
};

}  // namespace remotehead::client
