#include "remotehead/server/service/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/memory_stats.h"

namespace remotehead::server {
namespace {

// RESOURCE_EXHAUSTED with its reason; `resource` is "memory" or "queue".
absl::Status Exhausted(const char* resource, const std::string& message) {
  return core::WithReason(absl::ResourceExhaustedError(message), core::reason::kResourceExhausted,
                          {{"resource", resource}});
}

}  // namespace

uint64_t AdmissionController::NewTicket() {
  std::lock_guard<std::mutex> lock(mu_);
  return next_ticket_++;
}

bool AdmissionController::FitsLocked(int64_t bytes, bool counts_as_active) const {
  if (counts_as_active && options_.max_active > 0 && active_ >= options_.max_active) return false;
  return options_.memory_budget_bytes <= 0 ||
         bytes <= options_.memory_budget_bytes - head_bytes_ - bytes_in_use_;
}

absl::Status AdmissionController::OverBudget(int64_t bytes, absl::string_view more,
                                             const std::string& breakdown,
                                             const std::string& in_use) const {
  return Exhausted("memory", absl::StrCat("admission: expected ", core::FormatMiB(bytes), more,
                                          " (", breakdown, ") to fit the memory budget of ",
                                          core::FormatMiB(options_.memory_budget_bytes),
                                          " (--memory_budget_bytes); got ", in_use));
}

std::string AdmissionController::InUseLocked() const {
  return absl::StrCat(core::FormatMiB(bytes_in_use_ + head_bytes_), " already in use");
}

absl::Status AdmissionController::Admit(uint64_t ticket, int64_t bytes,
                                        const std::string& breakdown,
                                        std::function<void()> on_admitted) {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.memory_budget_bytes > 0 && bytes > options_.memory_budget_bytes - head_bytes_) {
    return Exhausted(
        "memory",
        absl::StrCat("admission: expected a request within the server's memory budget of ",
                     core::FormatMiB(options_.memory_budget_bytes), " (--memory_budget_bytes)",
                     head_bytes_ > 0 ? absl::StrCat(" less the ", core::FormatMiB(head_bytes_),
                                                    " its heads hold")
                                     : std::string(),
                     "; got one needing ", core::FormatMiB(bytes), " (", breakdown,
                     "). Send fewer rows per request, a smaller "
                     "chunking.memory_budget_bytes, or no weight gradient"));
  }
  // FIFO: a request never overtakes one already waiting.
  if (waiting_.empty() && FitsLocked(bytes, /*counts_as_active=*/true)) {
    held_[ticket] = {bytes, true};
    bytes_in_use_ += bytes;
    ++active_;
    on_admitted();
    return absl::OkStatus();
  }
  if (static_cast<int>(waiting_.size()) >= options_.max_queued) {
    return Exhausted(
        "queue",
        absl::StrCat("admission: expected at most ", options_.max_queued,
                     " queued requests (--max_queued_requests); got one more while ", active_,
                     " run and ", core::FormatMiB(bytes_in_use_), " are in use. Retry later"));
  }
  waiting_.push_back({ticket, bytes, std::move(on_admitted)});
  return absl::OkStatus();
}

absl::Status AdmissionController::Reserve(uint64_t ticket, int64_t bytes,
                                          const std::string& breakdown) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!FitsLocked(bytes, /*counts_as_active=*/false)) {
    return OverBudget(bytes, "", breakdown, InUseLocked());
  }
  held_[ticket] = {bytes, false};
  bytes_in_use_ += bytes;
  return absl::OkStatus();
}

absl::Status AdmissionController::Grow(uint64_t ticket, int64_t bytes,
                                       const std::string& breakdown) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = held_.find(ticket);
  if (it == held_.end()) {
    return absl::InternalError(absl::StrCat("admission: ticket ", ticket, " is not admitted"));
  }
  if (bytes > 0 && !FitsLocked(bytes, /*counts_as_active=*/false)) {
    return OverBudget(bytes, " more", breakdown, InUseLocked());
  }
  it->second.bytes += bytes;
  (it->second.head ? head_bytes_ : bytes_in_use_) += bytes;
  if (bytes < 0) AdmitWaitingLocked();
  return absl::OkStatus();
}

absl::Status AdmissionController::ReserveHead(uint64_t ticket, int64_t bytes,
                                              const std::string& breakdown) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!FitsLocked(bytes, /*counts_as_active=*/false)) {
    return OverBudget(bytes, "", breakdown,
                      absl::StrCat(core::FormatMiB(head_bytes_), " held by heads and ",
                                   core::FormatMiB(bytes_in_use_), " by requests already"));
  }
  held_[ticket] = {bytes, false, true};
  head_bytes_ += bytes;
  return absl::OkStatus();
}

void AdmissionController::Release(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = held_.find(ticket); it != held_.end()) {
    (it->second.head ? head_bytes_ : bytes_in_use_) -= it->second.bytes;
    if (it->second.active) --active_;
    held_.erase(it);
    AdmitWaitingLocked();
    return;
  }
  std::erase_if(waiting_, [ticket](const Waiting& w) { return w.ticket == ticket; });
  AdmitWaitingLocked();  // the withdrawn request may have been the one blocking the queue
}

void AdmissionController::AdmitWaitingLocked() {
  while (!waiting_.empty() && FitsLocked(waiting_.front().bytes, /*counts_as_active=*/true)) {
    Waiting w = std::move(waiting_.front());
    waiting_.pop_front();
    held_[w.ticket] = {w.bytes, true};
    bytes_in_use_ += w.bytes;
    ++active_;
    w.on_admitted();
  }
}

AdmissionStats AdmissionController::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {.bytes_in_use = bytes_in_use_,
          .head_bytes = head_bytes_,
          .active = active_,
          .queued = static_cast<int>(waiting_.size())};
}

}  // namespace remotehead::server
