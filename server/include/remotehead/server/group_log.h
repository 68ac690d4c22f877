// The ordered command log of a head group, kept in the group's store: rank 0 (the front) appends
// commands, every other rank takes them in order, executes them and replies with a status. It
// is how every rank executes the same operations in the same order, so that the collectives
// inside them pair up.
//
// Keys (under the group's command prefix): "cmd/<seq>" holds command <seq>, "reply/<seq>/<rank>"
// a rank's reply. The front removes both once every reply is in.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/process_group.h"

namespace remotehead::server {

struct GroupReply {
  absl::Status status;
  std::string payload;
};

class GroupLog {
 public:
  explicit GroupLog(ProcessGroup* group) : group_(group) {}

  // Front: appends `command`; returns its sequence number (0, 1, 2, … in append order).
  absl::StatusOr<int64_t> Append(const std::string& command);
  // Front: every other rank's reply to command `seq`, by rank (index r - 1 for rank r), waiting
  // up to the group's timeout in all. A rank that does not reply in time makes it UNAVAILABLE
  // naming the rank and the command; otherwise, once every reply is in, the first rank that
  // replied with an error makes it that error, prefixed with the rank.
  absl::StatusOr<std::vector<std::string>> AwaitReplies(int64_t seq);

  // Other ranks: the next command, waiting up to `wait`; DEADLINE_EXCEEDED if none came in time
  // (the caller may check for shutdown and ask again), UNAVAILABLE if the store (served by rank
  // 0) is gone.
  absl::StatusOr<std::string> Next(std::chrono::milliseconds wait);
  // Other ranks: the reply to the command that Next() last returned.
  absl::Status Reply(const GroupReply& reply);

  int64_t next_seq() const { return next_; }

 private:
  ProcessGroup* group_;
  int64_t next_ = 0;  // front: the next command's seq; other ranks: the next one to take
};

// A reply as stored: the status code, the message and the payload (what tests and the front
// decode; exposed for tests).
std::string EncodeReply(const GroupReply& reply);
absl::StatusOr<GroupReply> DecodeReply(const std::string& bytes);

}  // namespace remotehead::server
