// What a lost process or store is called: the verdicts that name it (liveness.h), and whether an
// address shows its process gone. Kept apart from the beats that find the loss.
#pragma once

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

// Whether `address` ("host:port", "[v6]:port") refuses a TCP connection: nothing listens there,
// so the process that did is gone (killed, crashed). A process that is only stopped or slow
// still has its port accepted by the kernel; an address that does not answer at all (another
// machine gone) is not "refused" either: both wait for the group's timeout.
bool Refuses(const std::string& address);

// A duration as the verdicts print it, to a tenth of a second ("2.3s").
std::string Tenths(std::chrono::milliseconds d);

// The process lost, as liveness found it.
struct LostProcess {
  int global_rank = -1;
  std::string described;  // Liveness::Describe's words for it
  std::string address;    // where it served ("" if it never said)
  // How long its beat has been stopped; negative: the store it serves (global rank 0's) cannot
  // be reached.
  std::chrono::milliseconds since{0};
};

// The verdict of `config`'s group or mesh that `lost` is lost: UNAVAILABLE, reason
// GROUP_UNAVAILABLE, metadata rank (this process's), lost_rank, lost_replica, lost_shard,
// lost_address; `first_seen`: the failure that showed it first ("" if none).
absl::Status LostProcessVerdict(const GroupConfig& config, const LostProcess& lost,
                                const std::string& first_seen);
// The verdict that the store's own process (--group_store_external) cannot be reached: no
// replica is named (none is to evict); metadata rank, lost_store (its address).
absl::Status LostStoreVerdict(const GroupConfig& config, const std::string& first_seen);

}  // namespace remotehead::server
