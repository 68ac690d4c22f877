// A RemoteHead's replay journal (replay_journal.h): the calls kept since the last optimizer
// step, and what a move of the trainer to another replica's front does with them.
#include "replay_journal.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::client::internal {
namespace {

// At most this many moves while one call runs (one per replica lost meanwhile).
constexpr int kMovesPerCall = 8;

// `t` detached on the host (what the journal keeps of an input); undefined for undefined.
torch::Tensor HostCopy(const torch::Tensor& t) {
  if (!t.defined()) return t;
  return t.detach().to(torch::kCPU, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

// What a REPLICA_MOVED status says of the move (nullopt for any other status).
std::optional<ReplicaMove> MoveOf(const absl::Status& status) {
  const std::optional<core::ErrorReason> why = core::GetReason(status);
  if (status.ok() || !why.has_value() || why->reason != reason::kReplicaMoved) return std::nullopt;
  ReplicaMove move;
  const auto& m = why->metadata;
  if (!m.contains("to_replica") || !m.contains("incarnation") || !m.contains("weight_version") ||
      !absl::SimpleAtoi(m.at("to_replica"), &move.to_replica) ||
      !absl::SimpleAtoi(m.at("weight_version"), &move.weight_version)) {
    return std::nullopt;
  }
  move.incarnation = m.at("incarnation");
  move.kept = m.contains("kept") && m.at("kept") == "true";
  return move;
}

}  // namespace

ReplayJournal::ReplayJournal(Client& client, std::string head_id, std::string incarnation,
                             bool keep)
    : client_(client),
      head_id_(std::move(head_id)),
      keep_(keep),
      replica_(client.replica()),
      incarnation_(std::move(incarnation)) {}

std::string ReplayJournal::Current(const std::string& expected) const {
  std::lock_guard<std::mutex> lock(mu_);
  return left_.contains(expected) ? incarnation_ : expected;
}

absl::Status ReplayJournal::Resilient(const std::function<absl::Status()>& call,
                                      int64_t held_version) {
  const int now = client_.replica();
  int was = now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was = replica_;
  }
  const bool noticed = now != was;
  if (noticed) {  // another call of the client noticed the move: described here
    ASSIGN_OR_RETURN(const HeadInfo info, client_.DescribeHead(head_id_));
    const absl::Status moved = core::WithReason(
        absl::UnavailableError(absl::StrCat("moved before this call: this trainer now dials "
                                            "replica ",
                                            now, "'s front at ", client_.target())),
        reason::kReplicaMoved,
        {{"from_replica", absl::StrCat(was)}, {"to_replica", absl::StrCat(now)}});
    RETURN_IF_ERROR(Moved(
        moved,
        {.to_replica = now, .incarnation = info.incarnation, .weight_version = info.weight_version},
        held_version));
  }
  for (int i = 0; i < kMovesPerCall; ++i) {
    const absl::Status status = call();
    std::optional<ReplicaMove> move = MoveOf(status);
    if (!move.has_value()) {
      ASSIGN_OR_RETURN(move, Healed(status, held_version));
      if (!move.has_value()) return status;
    }
    RETURN_IF_ERROR(Moved(status, *move, held_version));
  }
  return call();
}

absl::StatusOr<std::optional<ReplicaMove>> ReplayJournal::Healed(const absl::Status& status,
                                                                 int64_t held_version) {
  const std::optional<core::ErrorReason> why = core::GetReason(status);
  if (!why.has_value() || why->reason != core::reason::kServerRestarted || !client_.meshed()) {
    return std::nullopt;
  }
  // On a mesh whose replica was evicted, then admitted again and healed, the trainer's front is
  // a new process holding the mesh's weights at the trainer's version (or past it): what the old
  // process took goes again — a move to the same replica. Anything else stays a restart.
  ASSIGN_OR_RETURN(const HeadInfo info, client_.DescribeHead(head_id_));
  std::string pinned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pinned = incarnation_;
  }
  if (info.incarnation == pinned || info.weight_version < held_version) return std::nullopt;
  return ReplicaMove{.to_replica = client_.replica(),
                     .incarnation = info.incarnation,
                     .weight_version = info.weight_version};
}

absl::Status ReplayJournal::Moved(const absl::Status& moved, const ReplicaMove& move,
                                  int64_t held_version) {
  std::lock_guard<std::mutex> one_move(move_mu_);
  std::string lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Another call handled it: this trainer dials that front already.
    if (move.to_replica == replica_ && move.incarnation == incarnation_) return absl::OkStatus();
    replica_ = move.to_replica;
    lost = incarnation_;
    left_.insert(incarnation_);
    incarnation_ = move.incarnation;
  }
  if (move.weight_version > held_version) {
    // The step in flight was applied after all (with this trainer's dW): nothing to resend; the
    // step asked again gets its answer.
    Clear();
    return absl::OkStatus();
  }
  if (move.kept) return absl::OkStatus();  // the front left keeps this trainer's dW
  if (!keep_) return moved;
  ASSIGN_OR_RETURN(const int64_t replayed, Replay(lost, move.incarnation));
  client_.CountReplays(replayed);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ReplayJournal::Replay(const std::string& lost,
                                              const std::string& incarnation) {
  std::vector<Kept> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls = calls_;
  }
  int64_t replayed = 0;
  for (const Kept& kept : calls) {
    if (kept.taken_by != lost) continue;
    RETURN_IF_ERROR(kept.resend(incarnation));
    ++replayed;
  }
  // What was resent is the new front's from now on.
  std::lock_guard<std::mutex> lock(mu_);
  for (Kept& kept : calls_) {
    if (kept.taken_by == lost) kept.taken_by = incarnation;
  }
  return replayed;
}

void ReplayJournal::Record(Resend resend, std::initializer_list<torch::Tensor> kept) {
  int64_t bytes = 0;
  for (const torch::Tensor& t : kept) {
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  }
  std::lock_guard<std::mutex> lock(mu_);
  calls_.push_back({.taken_by = incarnation_, .resend = std::move(resend)});
  bytes_ += bytes;
}

void ReplayJournal::RecordStep(const StepSpec& spec, const StepInputs& inputs,
                               const torch::Tensor& grad_output) {
  if (!keep_ || !spec.accumulate_weight_grad) return;
  StepInputs kept{.hidden = HostCopy(inputs.hidden),
                  .targets = HostCopy(inputs.targets),
                  .weights = HostCopy(inputs.weights),
                  .aux = {},
                  .teacher_hidden = HostCopy(inputs.teacher_hidden)};
  int64_t aux_bytes = 0;
  for (const auto& [name, t] : inputs.aux) {
    kept.aux[name] = HostCopy(t);
    aux_bytes += static_cast<int64_t>(kept.aux[name].nbytes());
  }
  const torch::Tensor grad = HostCopy(grad_output);
  // The rows travel again: no handle of the old front's, nothing retained at the new one.
  StepSpec resent = spec;
  resent.inputs_handle.clear();
  resent.retain_inputs_seconds = 0;
  Client& client = client_;
  Record(
      [&client, resent, kept, grad](const std::string& incarnation) -> absl::Status {
        StepSpec pinned = resent;
        pinned.expected_incarnation = incarnation;
        if (grad.defined()) return client.Backward(pinned, kept, grad).status();
        return client.ForwardBackward(pinned, kept).status();
      },
      {kept.hidden, kept.targets, kept.weights, kept.teacher_hidden, grad});
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ += aux_bytes;
}

void ReplayJournal::RecordEmbedding(const torch::Tensor& ids, const torch::Tensor& grad,
                                    const GradientId& gradient_id, int64_t weight_version) {
  if (!keep_) return;
  const torch::Tensor i = HostCopy(ids), rows = HostCopy(grad);
  Client& client = client_;
  Record(
      [&client, head_id = head_id_, i, rows, gradient_id,
       weight_version](const std::string& incarnation) -> absl::Status {
        return client
            .EmbeddingGradient(
                head_id, i, rows, gradient_id,
                {.expected_incarnation = incarnation, .expected_weight_version = weight_version})
            .status();
      },
      {i, rows});
}

void ReplayJournal::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.clear();
  bytes_ = 0;
}

int64_t ReplayJournal::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(calls_.size());
}

int64_t ReplayJournal::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace remotehead::client::internal
