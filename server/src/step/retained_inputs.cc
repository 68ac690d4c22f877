#include "step/retained_inputs.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace remotehead::server {
namespace {

// 128 random bits: a handle cannot be guessed by another trainer.
std::string NewHandle() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%016x%016x", rng(), rng());
}

}  // namespace

RetainedInputStore::RetainedInputStore(AdmissionController* admission, double max_seconds)
    : admission_(admission), max_seconds_(max_seconds), sweeper_([this] { Sweep(); }) {}

RetainedInputStore::~RetainedInputStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  sweeper_.join();
  for (const auto& [handle, entry] : entries_) admission_->Release(entry.ticket);
}

void RetainedInputStore::Sweep() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    DropExpiredLocked();
    if (entries_.empty()) {
      changed_.wait(lock);
      continue;
    }
    auto next = entries_.begin()->second.expires;
    for (const auto& [handle, entry] : entries_) next = std::min(next, entry.expires);
    changed_.wait_until(lock, next);
  }
}

absl::StatusOr<std::string> RetainedInputStore::Put(RetainedInputs inputs, double seconds) {
  const int64_t bytes = inputs.batch.nbytes();
  const uint64_t ticket = admission_->NewTicket();
  absl::Status reserved = admission_->Reserve(
      ticket, bytes,
      absl::StrCat("inputs retained for a Backward, ", inputs.batch.rows(), " rows"));
  if (!reserved.ok()) return reserved;
  const auto lifetime = std::chrono::duration<double>(std::min(seconds, max_seconds_));
  std::lock_guard<std::mutex> lock(mu_);
  DropExpiredLocked();
  std::string handle = NewHandle();
  entries_[handle] = {std::make_shared<const RetainedInputs>(std::move(inputs)),
                      std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(lifetime),
                      ticket};
  changed_.notify_all();  // the sweeper may need to wake earlier
  return handle;
}

absl::StatusOr<std::shared_ptr<const RetainedInputs>> RetainedInputStore::Get(
    const std::string& handle) {
  std::lock_guard<std::mutex> lock(mu_);
  DropExpiredLocked();
  auto it = entries_.find(handle);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "header.inputs_handle: expected a live handle from a Forward with "
        "retain_inputs_seconds > 0; got \"",
        handle, "\", which is unknown, expired or already released by a successful Backward"));
  }
  return it->second.inputs;
}

void RetainedInputStore::Release(const std::string& handle) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = entries_.find(handle); it != entries_.end()) {
    admission_->Release(it->second.ticket);
    entries_.erase(it);
  }
}

void RetainedInputStore::DropExpiredLocked() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.expires <= now) {
      admission_->Release(it->second.ticket);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace remotehead::server
