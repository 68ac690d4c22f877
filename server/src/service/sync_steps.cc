#include "service/sync_steps.h"

#include <algorithm>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/server/service/metrics.h"

namespace remotehead::server {
namespace {

// Applied steps kept per head for the ranks whose answer was lost (a retry comes within a few
// steps or not at all).
constexpr size_t kAppliedKept = 8;

// The fields every rank of a step must send alike, by name as on the wire, with their values.
std::vector<std::pair<std::string, std::string>> AgreedFields(const SyncStepRequest& r) {
  std::vector<std::pair<std::string, std::string>> fields = {
      {"synchronous.world_size", absl::StrCat(r.world_size)},
      {"grad_scale", absl::StrCat(r.spec.grad_scale)},
      {"zero_gradients", r.spec.zero_gradients ? "true" : "false"},
      {"expected_incarnation", absl::StrCat("\"", r.expected_incarnation, "\"")},
      {"expected_weight_version", r.spec.expected_weight_version.has_value()
                                      ? absl::StrCat(*r.spec.expected_weight_version)
                                      : std::string("unset")},
  };
  if (const auto* sgd = std::get_if<core::SgdOptions>(&r.spec.optimizer)) {
    fields.insert(fields.end(), {{"optimizer", "sgd"},
                                 {"sgd.lr", absl::StrCat(sgd->lr)},
                                 {"sgd.momentum", absl::StrCat(sgd->momentum)},
                                 {"sgd.weight_decay", absl::StrCat(sgd->weight_decay)}});
  } else {
    const auto& adamw = std::get<core::AdamWOptions>(r.spec.optimizer);
    fields.insert(fields.end(), {{"optimizer", "adamw"},
                                 {"adamw.lr", absl::StrCat(adamw.lr)},
                                 {"adamw.beta1", absl::StrCat(adamw.beta1)},
                                 {"adamw.beta2", absl::StrCat(adamw.beta2)},
                                 {"adamw.eps", absl::StrCat(adamw.eps)},
                                 {"adamw.weight_decay", absl::StrCat(adamw.weight_decay)}});
  }
  return fields;
}

// INVALID_ARGUMENT for ranks that disagree on `field`, with its reason.
absl::Status Disagreement(const std::string& field, const SyncStepRequest& first,
                          const std::string& message) {
  return core::WithReason(
      absl::InvalidArgumentError(message), core::reason::kRanksDisagree,
      {{"head", first.head_id}, {"step", absl::StrCat(first.step)}, {"field", field}});
}

absl::Status CheckRequest(const SyncStepRequest& r) {
  if (r.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("synchronous.world_size: expected >= 1; got ", r.world_size));
  }
  if (r.rank < 0 || r.rank >= r.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("synchronous.rank: expected in [0, ", r.world_size, "); got ", r.rank));
  }
  if (r.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("synchronous.step: expected >= 0; got ", r.step));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<int> TrainerShare::Ranks(int world_size) const {
  std::vector<int> ranks(world_size);
  for (int t = 0; t < world_size; ++t) ranks[t] = t;
  return ranks;
}

absl::Status TrainerShare::CheckRank(const SyncStepRequest&) const { return absl::OkStatus(); }

void TrainerShare::Came(const SyncStepRequest&, const std::vector<int>&) {}

void TrainerShare::Left(const SyncStepRequest&, const std::vector<int>&,
                        std::chrono::system_clock::time_point) {}

absl::Status TrainerShare::Missing(const SyncStepRequest& first, const std::vector<int>& came,
                                   std::chrono::milliseconds waited) {
  std::vector<int> missing;
  for (int r : Ranks(first.world_size)) {
    if (std::find(came.begin(), came.end(), r) == came.end()) missing.push_back(r);
  }
  return core::WithReason(
      absl::AbortedError(absl::StrCat(
          "synchronous optimizer step ", first.step, " of head \"", first.head_id,
          "\": expected all ", first.world_size, " ranks within ",
          absl::FormatDuration(absl::FromChrono(waited)), "; got ranks [",
          absl::StrJoin(came, ", "), "], missing ranks [", absl::StrJoin(missing, ", "),
          "]: nothing applied, the accumulated dW is kept (ask again once every rank runs)")),
      core::reason::kRanksMissing,
      {{"head", first.head_id},
       {"step", absl::StrCat(first.step)},
       {"missing_ranks", absl::StrJoin(missing, ",")}});
}

SynchronousSteps::SynchronousSteps(Apply apply, Describe describe,
                                   std::chrono::milliseconds timeout, ServerMetrics* metrics)
    : apply_(std::move(apply)),
      describe_(std::move(describe)),
      timeout_(timeout),
      metrics_(metrics) {
  timer_ = std::thread([this] { TimerLoop(); });
}

SynchronousSteps::~SynchronousSteps() {
  AbortAll(core::WithReason(
      absl::UnavailableError(
          "synchronous optimizer step: the server is shutting down; nothing applied"),
      core::reason::kServerDraining));
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  timer_.join();
}

absl::Status SynchronousSteps::Agree(const SyncStepRequest& first, const SyncStepRequest& request) {
  if (request.step != first.step) {
    return Disagreement("synchronous.step", first,
                        absl::StrCat("synchronous.step: every rank of a synchronous step must ask "
                                     "for the same step; rank ",
                                     first.rank, " waits at step ", first.step, ", rank ",
                                     request.rank, " asked for step ", request.step, " (head \"",
                                     first.head_id, "\"): nothing applied"));
  }
  const auto expected = AgreedFields(first);
  const auto got = AgreedFields(request);
  for (size_t i = 0; i < expected.size() && i < got.size(); ++i) {
    if (expected[i] != got[i]) {
      const std::string field =
          got[i].first == expected[i].first ? got[i].first : std::string("optimizer");
      return Disagreement(
          field, first,
          absl::StrCat(field, ": every rank of a synchronous step must agree; rank ", first.rank,
                       " asked for ", expected[i].second, ", rank ", request.rank, " for ",
                       got[i].second, " (head \"", first.head_id, "\", step ", first.step,
                       "): nothing applied"));
    }
  }
  return absl::OkStatus();
}

void SynchronousSteps::Arrive(SyncStepRequest request, Reply reply) {
  const Waiter waiter{std::move(reply), Clock::now()};
  absl::Status bad = CheckRequest(request);
  if (bad.ok()) bad = trainers_->CheckRank(request);
  if (!bad.ok()) {
    Send({{waiter, bad}});
    return;
  }
  // Read before the lock: the head's own lock is never taken under ours.
  const absl::StatusOr<HeadDescription> now = describe_(request.head_id);
  Replies replies;
  std::vector<Pending> left;  // steps ended here (their trainers answered)
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A step applied already: its answer again (a rank whose reply was lost), if nothing has
    // moved the head since.
    if (auto it = applied_.find(request.head_id); it != applied_.end() && now.ok()) {
      for (const Applied& a : it->second) {
        if (a.step == request.step && a.world_size == request.world_size &&
            a.result.weight_version == now->weight_version) {
          replies.push_back({waiter, a.result});
          break;
        }
      }
    }
    if (replies.empty()) {
      auto [it, fresh] = pending_.try_emplace(request.head_id);
      Pending& pending = it->second;
      if (fresh) {
        pending.first = request;
        pending.deadline = waiter.arrived + timeout_;
        wake_.notify_all();
      } else if (absl::Status disagree = Agree(pending.first, request); !disagree.ok()) {
        // Trainers that disagree are broken: every rank learns it now, rather than at the
        // timeout, and nothing is applied.
        replies.push_back({waiter, disagree});
        if (!pending.applying) {
          left.push_back(pending);
          TakeAll(pending, disagree, &replies);
          pending_.erase(it);
          if (metrics_ != nullptr) metrics_->CountSyncStepAborted("disagreement");
        }
      }
      if (replies.empty()) {
        pending.ranks[request.rank].push_back(waiter);
        last = !pending.applying &&
               pending.ranks.size() == trainers_->Ranks(pending.first.world_size).size();
        if (last) pending.applying = true;
      }
    }
    UpdateWaitingLocked();
  }
  const auto answered = std::chrono::system_clock::now();
  Send(std::move(replies));
  TellCame(request.head_id);
  for (const Pending& p : left) TellLeft(p, answered);
  if (last) ApplyAndAnswer(request.head_id);
}

void SynchronousSteps::TellLeft(const Pending& pending,
                                std::chrono::system_clock::time_point answered) {
  // Under the same lock as Came: a Came read before the step ended is told before this.
  std::lock_guard<std::mutex> telling(telling_);
  std::vector<int> ranks;
  for (const auto& [rank, waiters] : pending.ranks) ranks.push_back(rank);
  trainers_->Left(pending.first, ranks, answered);
}

void SynchronousSteps::TellCame(const std::string& head_id) {
  std::lock_guard<std::mutex> telling(telling_);
  SyncStepRequest first;
  std::vector<int> came;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(head_id);
    if (it == pending_.end()) return;
    first = it->second.first;
    for (const auto& [rank, waiters] : it->second.ranks) came.push_back(rank);
  }
  trainers_->Came(first, came);
}

void SynchronousSteps::ApplyAndAnswer(const std::string& head_id) {
  SyncStepRequest first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = pending_.at(head_id).first;
  }
  OptimizerStepSpec spec = first.spec;
  spec.grad_scale = first.spec.grad_scale / first.world_size;
  // Applied outside the lock: other heads' steps and this one's retries go on meanwhile.
  const absl::StatusOr<HeadDescription> result = apply_(first, spec);
  Replies replies;
  std::vector<Pending> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(head_id);
    if (result.ok()) {
      std::deque<Applied>& applied = applied_[head_id];
      applied.push_back({it->second.first.step, it->second.first.world_size, *result});
      while (applied.size() > kAppliedKept) applied.pop_front();
      if (metrics_ != nullptr) metrics_->CountSyncStepApplied();
    } else if (metrics_ != nullptr) {
      metrics_->CountSyncStepAborted("refused");
    }
    left.push_back(it->second);
    TakeAll(it->second, result, &replies);
    pending_.erase(it);
    UpdateWaitingLocked();
  }
  const auto answered = std::chrono::system_clock::now();
  Send(std::move(replies));
  for (const Pending& p : left) TellLeft(p, answered);
}

void SynchronousSteps::TakeAll(Pending& pending, const absl::StatusOr<HeadDescription>& status,
                               Replies* out) {
  for (auto& [rank, waiters] : pending.ranks) {
    for (Waiter& w : waiters) out->push_back({std::move(w), status});
  }
  pending.ranks.clear();
}

void SynchronousSteps::AbortAll(const absl::Status& status) {
  Replies replies;
  std::vector<Pending> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.applying) {  // its answer comes from the step itself
        ++it;
        continue;
      }
      left.push_back(it->second);
      TakeAll(it->second, status, &replies);
      if (metrics_ != nullptr) metrics_->CountSyncStepAborted("draining");
      it = pending_.erase(it);
    }
    UpdateWaitingLocked();
  }
  const auto answered = std::chrono::system_clock::now();
  Send(std::move(replies));
  for (const Pending& p : left) TellLeft(p, answered);
}

void SynchronousSteps::TimerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    Clock::time_point next = Clock::time_point::max();
    for (const auto& [head, pending] : pending_) {
      if (!pending.applying && pending.deadline < next) next = pending.deadline;
    }
    if (next == Clock::time_point::max()) {
      wake_.wait(lock);
      continue;
    }
    if (wake_.wait_until(lock, next) != std::cv_status::timeout) continue;
    // The steps that waited too long, taken out; each answered, outside the lock (on a mesh
    // the answer reads what the other fronts told: TrainerShare::Missing).
    std::vector<Pending> expired;
    const Clock::time_point now = Clock::now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.applying || it->second.deadline > now) {
        ++it;
        continue;
      }
      expired.push_back(std::move(it->second));
      if (metrics_ != nullptr) metrics_->CountSyncStepAborted("timeout");
      it = pending_.erase(it);
    }
    UpdateWaitingLocked();
    lock.unlock();
    for (Pending& p : expired) {
      std::vector<int> came;
      for (const auto& [rank, waiters] : p.ranks) came.push_back(rank);
      Replies replies;
      const Pending ended = p;
      TakeAll(p, trainers_->Missing(p.first, came, timeout_), &replies);
      const auto answered = std::chrono::system_clock::now();
      Send(std::move(replies));
      TellLeft(ended, answered);
    }
    lock.lock();
  }
}

void SynchronousSteps::UpdateWaitingLocked() {
  if (metrics_ == nullptr) return;
  int64_t waiting = 0;
  for (const auto& [head, pending] : pending_) {
    for (const auto& [rank, waiters] : pending.ranks) waiting += waiters.size();
  }
  metrics_->SetSyncStepRanksWaiting(waiting);
}

void SynchronousSteps::Send(Replies replies) {
  const Clock::time_point now = Clock::now();
  for (auto& [waiter, result] : replies) {
    if (metrics_ != nullptr) {
      metrics_->ObserveSyncStepWait(std::chrono::duration<double>(now - waiter.arrived).count());
    }
    waiter.reply(result);
  }
}

}  // namespace remotehead::server
