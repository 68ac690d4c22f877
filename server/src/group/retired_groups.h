// The cross-replica groups of the epochs a mesh left (head_mesh.h): aborted at once (NCCL's
// communicators, so that a collective still in flight on them fails now, not at NCCL's timeout),
// kept so that a call still holding one finds it valid, and closed — destroyed, Gloo's
// connections (to a lost process too) with them — at a later epoch change once a group timeout
// has passed since they retired: every call on them has ended by then. Epoch 0's are kept for the
// process's life: they hold the first rendezvous's store connection (on global rank 0, the store
// itself); a later epoch's have a connection of their own.
#pragma once

#include <chrono>
#include <ostream>
#include <vector>

#include "remotehead/server/group/head_mesh.h"

namespace remotehead::server {

class RetiredGroups {
 public:
  // One epoch's groups, retired at `at`.
  struct Entry {
    EpochGroups groups;
    int epoch = 0;
    std::chrono::steady_clock::time_point at;
  };

  // `patience`: how long after retiring a group may still be in use (the group's timeout).
  explicit RetiredGroups(std::chrono::milliseconds patience) : patience_(patience) {}

  // `left`, the groups of `epoch`, aborted and kept. The groups retired more than `patience`
  // ago come back, to Close outside any lock (Gloo joins its threads).
  std::vector<Entry> Retire(EpochGroups left, int epoch);
  // Destroys `expired` (what Retire gave back), saying so on `log`.
  static void Close(std::vector<Entry> expired, std::ostream& log);

 private:
  const std::chrono::milliseconds patience_;
  std::vector<Entry> kept_;
};

}  // namespace remotehead::server
