#include "rpc/stripe_joins.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace remotehead::server {

absl::StatusOr<std::shared_ptr<StripedCall>> StripeJoins::Join(const std::string& key,
                                                               const Create& create) {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  for (auto it = ended_.begin(); it != ended_.end();) {
    it = now - it->second.at > kRemember ? ended_.erase(it) : std::next(it);
  }
  if (const auto ended = ended_.find(key); ended != ended_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.stripe.key: the striped step \"", key, "\" has already ended",
        ended->second.how.ok() ? "" : absl::StrCat(" (", ended->second.how.message(), ")"),
        "; a retry sends all its streams under a new key"));
  }
  Running& slot = running_[key];
  if (std::shared_ptr<StripedCall> running = slot.pipeline.lock()) return running;
  std::shared_ptr<StripedCall> created = create();
  slot = Running{.pipeline = created, .since = now};
  if (!watcher_.joinable()) watcher_ = std::thread([this] { Watch(); });
  return created;
}

StripeJoins::~StripeJoins() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

void StripeJoins::Watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    wake_.wait_for(lock,
                   std::min<std::chrono::milliseconds>(join_within_ / 4, std::chrono::seconds(1)));
    std::vector<std::shared_ptr<StripedCall>> late;
    const Clock::time_point now = Clock::now();
    for (const auto& [key, running] : running_) {
      if (now - running.since < join_within_) continue;
      if (std::shared_ptr<StripedCall> p = running.pipeline.lock()) late.push_back(std::move(p));
    }
    // Outside mu_: a pipeline calls End under its own lock.
    lock.unlock();
    for (const auto& p : late) p->FailUnlessJoined(join_within_);
    late.clear();
    lock.lock();
  }
}

void StripeJoins::End(const std::string& key, const absl::Status& how) {
  std::lock_guard<std::mutex> lock(mu_);
  running_.erase(key);
  ended_[key] = Ended{.how = how, .at = Clock::now()};
}

void StripeJoins::Abort(const std::string& key, const absl::Status& why) {
  std::shared_ptr<StripedCall> running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (const auto it = running_.find(key); it != running_.end()) {
      running = it->second.pipeline.lock();
    }
    running_.erase(key);
    ended_[key] = Ended{.how = why, .at = Clock::now()};
  }
  // Outside mu_: the pipeline calls End under its own lock.
  if (running != nullptr) running->Fail(why);
}

}  // namespace remotehead::server
