#include "remotehead/server/group/mesh_epochs.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

// The global rank a verdict names as lost (-1: none).
int LostRank(const absl::Status& status) {
  const std::optional<core::ErrorReason> reason = core::GetReason(status);
  int lost = -1;
  if (!reason.has_value()) return -1;
  const auto it = reason->metadata.find("lost_rank");
  return it != reason->metadata.end() && absl::SimpleAtoi(it->second, &lost) ? lost : -1;
}

}  // namespace

MeshEpochs::MeshEpochs(const GroupConfig& config, std::ostream* log, Hooks hooks)
    : config_(config),
      log_(log),
      hooks_(std::move(hooks)),
      epoch_(MeshEpoch::First(config.replicas)) {}

void MeshEpochs::Enable(int min_replicas, EvictionCap cap) {
  if (config_.replicas > 1 && min_replicas < config_.replicas) min_replicas_ = min_replicas;
  cap_ = cap;
}

MeshEpoch MeshEpochs::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

int MeshEpochs::OnEpoch(std::function<void(const MeshEpoch&)> listener) {
  std::lock_guard<std::mutex> lock(calling_);
  listeners_[next_listener_] = std::move(listener);
  return next_listener_++;
}

void MeshEpochs::RemoveListener(int id) {
  std::lock_guard<std::mutex> lock(calling_);
  listeners_.erase(id);
}

bool MeshEpochs::NamesEvicted(const absl::Status& status) const {
  const int lost = LostRank(status);
  return lost >= 0 && !current().serves(lost / config_.ranks_per_replica());
}

bool MeshEpochs::Capped(const std::string& cause) {
  if (cap_.evictions <= 0) return false;
  int64_t recent = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point since = Clock::now() - cap_.window;
    recent = std::count_if(entered_.begin(), entered_.end(),
                           [&](Clock::time_point at) { return at >= since; });
  }
  if (recent < cap_.evictions) return false;
  if (log_ != nullptr) {
    *log_ << "remotehead-server: mesh: " << cause << ", but " << recent
          << " replica(s) were evicted within the last " << cap_.window.count()
          << " s (--mesh_max_evictions " << cap_.evictions
          << "): no more evictions; the mesh goes down" << std::endl;
  }
  return true;
}

bool MeshEpochs::Evict(const absl::Status& verdict) {
  const int lost = LostRank(verdict);
  if (min_replicas_ <= 0 || lost < 0) return false;
  return EvictReplica(lost / config_.ranks_per_replica(),
                      absl::StrCat(hooks_.describe(lost), " is lost"));
}

bool MeshEpochs::EvictReplica(int replica, const std::string& cause) {
  if (min_replicas_ <= 0) return false;
  std::lock_guard<std::mutex> one(evicting_);
  for (;;) {
    const MeshEpoch now = current();
    if (!now.serves(replica)) return true;  // evicted already: the mesh went on
    // Replica 0's global rank 0 serves the store, unless it is external: then its loss is the
    // mesh's, as without eviction. (Without it, the leader's replica is evicted like any other:
    // the next serving replica leads.)
    if ((replica == 0 && !config_.store_external) ||
        static_cast<int>(now.live.size()) - 1 < min_replicas_) {
      return false;
    }
    if (Capped(cause)) return false;
    const MeshEpoch proposed = now.Without(replica, cause);
    const absl::StatusOr<std::string> settled =
        hooks_.settle(store_keys::MeshEpochRecord(proposed.number), proposed.Encode());
    if (!settled.ok()) return false;  // the store fails: the mesh is down, as without eviction
    const absl::StatusOr<MeshEpoch> next = MeshEpoch::Decode(*settled);
    if (!next.ok() || next->number != proposed.number) return false;
    Adopt(*next);  // another process may have evicted another replica first: then look again
  }
}

void MeshEpochs::Resume(const MeshEpoch& current) {
  std::lock_guard<std::mutex> lock(mu_);
  epoch_ = current;
  joining_ = true;
}

bool MeshEpochs::joining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return joining_;
}

absl::StatusOr<MeshEpoch> MeshEpochs::Admit(int replica) {
  std::lock_guard<std::mutex> one(evicting_);
  const MeshEpoch now = current();
  if (now.serves(replica)) return now;
  const MeshEpoch proposed =
      now.With(replica, absl::StrCat("every process of replica ", replica, " asked to join"));
  ASSIGN_OR_RETURN(const std::string settled,
                   hooks_.settle(store_keys::MeshEpochRecord(proposed.number), proposed.Encode()));
  ASSIGN_OR_RETURN(const MeshEpoch next, MeshEpoch::Decode(settled));
  Adopt(next);
  return next;
}

void MeshEpochs::Adopt(const MeshEpoch& next) {
  bool joining = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (next.number != epoch_.number + 1) return;
    epoch_ = next;
    if (next.admitted == config_.replica()) joining_ = false;
    joining = joining_;
    // The cap counts evictions only.
    if (next.evicted >= 0) entered_.push_back(Clock::now());
  }
  hooks_.watch(next);
  if (next.admitted >= 0) {
    if (log_ != nullptr) {
      *log_ << "remotehead-server: mesh: " << next.cause << ": replica " << next.admitted
            << " admitted; the mesh goes on in " << next.Describe() << " once it is healed; "
            << next.Moves(config_.replicas) << std::endl;
    }
  } else if (log_ != nullptr) {
    *log_ << "remotehead-server: mesh: " << next.cause << ": replica " << next.evicted
          << " evicted; the mesh goes on in " << next.Describe() << "; "
          << next.Moves(config_.replicas) << std::endl;
  }
  // A process joining the mesh waits for the epoch that admits its replica: an eviction of its
  // replica meanwhile (its old processes' loss, noticed late) is no verdict on it.
  if (!next.serves(config_.replica()) && !joining) {
    hooks_.go_down(core::WithReason(
        absl::UnavailableError(absl::StrCat(
            "this process's replica ", config_.replica(), " was evicted from the mesh (",
            next.cause, "): the mesh goes on in ", next.Describe(), "; ",
            next.Moves(config_.replicas),
            " — this process serves nothing more; it restarts itself to join the mesh again (the "
            "replica is admitted once every process of it asks)")),
        core::reason::kGroupUnavailable,
        {{"rank", absl::StrCat(config_.rank)},
         {"evicted", absl::StrCat(next.evicted)},
         {"epoch", absl::StrCat(next.number)}}));
  }
  std::lock_guard<std::mutex> calling(calling_);
  for (const auto& [id, listener] : listeners_) listener(next);
}

}  // namespace remotehead::server
