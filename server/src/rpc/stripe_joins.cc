#include "rpc/stripe_joins.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/step_pipeline.h"

namespace remotehead::server {

absl::StatusOr<StripeOf> ReadStripe(const v1::StepRequest& first) {
  if (!first.has_header() || !first.header().has_stripe()) return StripeOf{};
  const v1::StripeSpec& stripe = first.header().stripe();
  if (stripe.count() < 0 || stripe.count() > kMaxStripes) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripe.count: expected 0 to ", kMaxStripes, "; got ", stripe.count()));
  }
  const int count = std::max(stripe.count(), 1);
  if (stripe.index() < 0 || stripe.index() >= count) {
    return absl::InvalidArgumentError(absl::StrCat("header.stripe.index: expected 0 to ", count - 1,
                                                   " (stripe.count ", stripe.count(), "); got ",
                                                   stripe.index()));
  }
  if (count == 1) return StripeOf{};
  if (stripe.key().empty() || stripe.key().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripe.key: expected 1 to 128 bytes naming the step's streams; got ",
                     stripe.key().size()));
  }
  if (stripe.index() > 0) {
    v1::StepHeader rest = first.header();
    rest.clear_stripe();
    if (rest.ByteSizeLong() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header: stream ", stripe.index(), " of a striped step states only its stripe (stream ",
          "0 carries the header); got ", rest.ShortDebugString()));
    }
  }
  if (stripe.has_messages() && stripe.messages() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripe.messages: expected >= 0 (the rows messages of stream ",
                     stripe.index(), "); got ", stripe.messages()));
  }
  StripeOf of{.key = stripe.key(), .count = count, .index = stripe.index()};
  if (stripe.has_messages()) of.messages = stripe.messages();
  return of;
}

absl::StatusOr<std::shared_ptr<StepPipeline>> StripeJoins::Join(const std::string& key,
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
  if (std::shared_ptr<StepPipeline> running = slot.pipeline.lock()) return running;
  std::shared_ptr<StepPipeline> created = create();
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
    std::vector<std::shared_ptr<StepPipeline>> late;
    const Clock::time_point now = Clock::now();
    for (const auto& [key, running] : running_) {
      if (now - running.since < join_within_) continue;
      if (std::shared_ptr<StepPipeline> p = running.pipeline.lock()) late.push_back(std::move(p));
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
  std::shared_ptr<StepPipeline> running;
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
