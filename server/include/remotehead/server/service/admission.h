// Bounded admission: a request runs only when its estimated memory fits the server's budget and
// fewer than `max_active` requests are running; otherwise it waits in a FIFO queue of at most
// `max_queued` requests, and beyond that it is refused with RESOURCE_EXHAUSTED. Overload thus
// gets a clear status instead of an out-of-memory crash, and a refused request touched nothing.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace remotehead::server {

struct AdmissionOptions {
  int64_t memory_budget_bytes = 0;  // 0 = unlimited
  int max_active = 0;               // requests computing at once; 0 = unlimited
  int max_queued = 64;              // requests waiting for admission
};

struct AdmissionStats {
  int64_t bytes_in_use = 0;  // admitted requests and long-lived reservations
  int64_t head_bytes = 0;    // the heads: weights, gradients, optimizer state (ReserveHead)
  int active = 0;
  int queued = 0;
};

class AdmissionController {
 public:
  explicit AdmissionController(AdmissionOptions options) : options_(options) {}

  // A fresh identity for Admit / Reserve / Release.
  uint64_t NewTicket();

  // Admits `ticket` for `bytes`: at once (on_admitted runs before Admit returns) or, when the
  // budget or the active limit is reached, once earlier requests release capacity (on_admitted
  // then runs on the releasing thread, under the controller's lock: it must not call back into
  // the controller). RESOURCE_EXHAUSTED, naming `breakdown` (what the bytes are for), when the
  // request can never fit the budget or the queue is full.
  absl::Status Admit(uint64_t ticket, int64_t bytes, const std::string& breakdown,
                     std::function<void()> on_admitted);

  // Long-lived bytes that are not a running request (e.g. inputs retained for a Backward):
  // taken now or refused with RESOURCE_EXHAUSTED, never queued.
  absl::Status Reserve(uint64_t ticket, int64_t bytes, const std::string& breakdown);

  // More bytes for an admitted request or a head whose needs grew (inputs a request retains, a
  // head's optimizer state): taken now or refused with RESOURCE_EXHAUSTED naming `breakdown`,
  // never queued. Negative `bytes` give some back (always OK).
  absl::Status Grow(uint64_t ticket, int64_t bytes, const std::string& breakdown);

  // A head's weights and gradients, held for as long as the head exists: they count against
  // the budget like everything else (a request never fits unless it fits beside the heads).
  // RESOURCE_EXHAUSTED naming `breakdown` when they do not fit.
  absl::Status ReserveHead(uint64_t ticket, int64_t bytes, const std::string& breakdown);

  // Frees an admitted request's or a reservation's bytes, or withdraws a queued request;
  // unknown tickets are ignored, so a caller may release unconditionally.
  void Release(uint64_t ticket);

  AdmissionStats Stats() const;

 private:
  struct Waiting {
    uint64_t ticket;
    int64_t bytes;
    std::function<void()> on_admitted;
  };
  bool FitsLocked(int64_t bytes, bool counts_as_active) const;
  // The one refusal of bytes the budget has no room for: RESOURCE_EXHAUSTED (resource memory)
  // saying `bytes` (`more`: " more" for a growth) for `breakdown` and, after "got", `in_use`.
  // "… already in use": what the budget holds now, for a refusal.
  std::string InUseLocked() const;
  absl::Status OverBudget(int64_t bytes, absl::string_view more, const std::string& breakdown,
                          const std::string& in_use) const;
  void AdmitWaitingLocked();

  const AdmissionOptions options_;
  mutable std::mutex mu_;
  uint64_t next_ticket_ = 1;
  int64_t bytes_in_use_ = 0;
  int64_t head_bytes_ = 0;
  int active_ = 0;
  struct Held {
    int64_t bytes;
    bool active;        // a running request (false: a reservation)
    bool head = false;  // counted in head_bytes_ (ReserveHead)
  };
  std::map<uint64_t, Held> held_;
  std::deque<Waiting> waiting_;
};

}  // namespace remotehead::server
