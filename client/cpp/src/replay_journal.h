// What a RemoteHead resends when its trainer moves to another replica of a mesh — the Python
// client's _replay_journal.py with RemoteHead's _resilient / _moved / _current, rule for rule.
//
// On a mesh that evicts a lost replica (--mesh_min_replicas), the dW a trainer's calls added to
// its replica since the last applied optimizer step is lost with that replica; the trainer itself
// is not. Its Client follows the mesh to the front that serves it now and returns REPLICA_MOVED
// (options.h); the journal then sends those calls again to that front, under the same gradient
// ids (exactly once there) and pinned to the same weight version, with the new front's
// incarnation, and the call that failed is asked again: the training loop sees nothing. If the
// new front is already past the weight version the trainer holds, the step in flight was applied
// (with this trainer's dW): nothing is resent, and the step asked again gets its answer.
//
// The journal keeps each such call — a ForwardBackward, a two-phase Backward with its upstream
// gradient, a tied embedding's gradient rows — from when it succeeded until the trainer's next
// optimizer step applies. Memory: a host copy of every journaled call's per-token inputs (hidden
// states in the caller's dtype, targets, weights, aux, teacher rows, a Backward's dL/dy, an
// embedding gradient's ids and rows) until that step — about one step's worth of the head's
// inputs (bytes()). Without the journal (MoveOptions::journal false) nothing is kept, and a move
// fails the call with REPLICA_MOVED.
//
// Each kept call remembers the front (incarnation) that took it: a move away from a front that
// still serves (WRONG_REPLICA: the mesh admitted the trainer's replica again) resends nothing,
// and a front that restarted and was healed (SERVER_RESTARTED, the new process at the trainer's
// version) counts as a move to the same replica: what the old process took is resent.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/client/client.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::client::internal {

// What a REPLICA_MOVED status says of a move (replay_journal.cc reads it).
struct ReplicaMove {
  int to_replica = 0;
  std::string incarnation;
  int64_t weight_version = 0;
  bool kept = false;  // the front left still serves, with this trainer's dW
};

class ReplayJournal {
 public:
  // `client` must outlive the journal. `incarnation`: the server process the trainer's calls are
  // pinned to (RemoteHead::Attach's). `keep`: whether calls are kept at all.
  ReplayJournal(Client& client, std::string head_id, std::string incarnation, bool keep);
  ReplayJournal(const ReplayJournal&) = delete;
  ReplayJournal& operator=(const ReplayJournal&) = delete;

  // The incarnation a call pinned to `expected` goes with now: the front's this trainer dials, if
  // `expected` is one it moved away from; `expected` otherwise.
  std::string Current(const std::string& expected) const;

  // `call()`, and again after this trainer moved to another replica's front (a REPLICA_MOVED of
  // this call, or of another call of the client noticed before it): first what the journal holds
  // is sent there. `held_version`: the weight version the trainer holds (RemoteHead::info()).
  absl::Status Resilient(const std::function<absl::Status()>& call, int64_t held_version);

  // `call(incarnation)` under Resilient, pinned at each try to Current(expected); its result.
  template <typename R, typename Call>
  absl::StatusOr<R> Pinned(const std::string& expected, int64_t held_version, Call&& call) {
    std::optional<R> result;
    RETURN_IF_ERROR(Resilient(
        [&]() -> absl::Status {
          absl::StatusOr<R> r = call(Current(expected));
          if (!r.ok()) return r.status();
          result = *std::move(r);
          return absl::OkStatus();
        },
        held_version));
    return *std::move(result);
  }
  // `call(spec)` under Resilient, `spec` pinned at each try to Current(spec.expected_incarnation).
  template <typename R, typename Call>
  absl::StatusOr<R> PinnedStep(const StepSpec& spec, int64_t held_version, Call&& call) {
    return Pinned<R>(spec.expected_incarnation, held_version, [&](const std::string& incarnation) {
      StepSpec pinned = spec;
      pinned.expected_incarnation = incarnation;
      return call(pinned);
    });
  }

  // A step call that added dW (spec.accumulate_weight_grad), kept for a move: a ForwardBackward,
  // or a Backward when `grad_output` is defined. Host copies of its inputs are kept.
  void RecordStep(const StepSpec& spec, const StepInputs& inputs,
                  const torch::Tensor& grad_output = {});
  // A tied embedding's gradient (Client::EmbeddingGradient) kept for a move.
  void RecordEmbedding(const torch::Tensor& ids, const torch::Tensor& grad,
                       const GradientId& gradient_id, int64_t weight_version);
  // The trainer's dW was applied: nothing to resend.
  void Clear();

  int64_t calls() const;
  int64_t bytes() const;  // what the kept tensors hold now

 private:
  // Sends a kept call again, to a front of `incarnation`.
  using Resend = std::function<absl::Status(const std::string& incarnation)>;
  // A kept call, and the incarnation of the front that took it (that holds its dW).
  struct Kept {
    std::string taken_by;
    Resend resend;
  };
  void Record(Resend resend, std::initializer_list<torch::Tensor> kept);
  // A move the client reported (`moved`: REPLICA_MOVED, to `move.to_replica`, whose front serves
  // the head at `move.incarnation` and `move.weight_version`): this trainer's calls pinned to
  // that front, then what the front left took replayed there (nothing if it keeps it:
  // move.kept), or the journal cleared when the step in flight was applied. An error: what the
  // call returns (the move itself without a journal; a replayed call's failure).
  absl::Status Moved(const absl::Status& moved, const ReplicaMove& move, int64_t held_version);
  // `status` a SERVER_RESTARTED of this trainer's front, on a mesh whose replica was healed
  // since: the move to the same replica's new process (nullopt: a restart, as it is).
  absl::StatusOr<std::optional<ReplicaMove>> Healed(const absl::Status& status,
                                                    int64_t held_version);
  // Every kept call the front of incarnation `lost` took sent again, in order, to a front of
  // `incarnation` (which takes them over); how many.
  absl::StatusOr<int64_t> Replay(const std::string& lost, const std::string& incarnation);

  Client& client_;
  const std::string head_id_;
  const bool keep_;
  std::mutex move_mu_;  // one move handled at a time: a second finds the first's done
  mutable std::mutex mu_;
  int replica_;                 // the replica holding this trainer's dW since its last step
  std::string incarnation_;     // the front's this trainer dials now
  std::set<std::string> left_;  // the fronts' this trainer moved away from
  std::vector<Kept> calls_;
  int64_t bytes_ = 0;
};

}  // namespace remotehead::client::internal
