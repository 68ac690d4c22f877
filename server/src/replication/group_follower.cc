#include "replication/group_follower.h"

#include "remotehead/core/status_macros.h"
#include "replication/apply_head_command.h"
#include "translate/group_commands.h"
#include "translate/head_commands.h"

namespace remotehead::server {

absl::Status GroupFollower::Run(const std::atomic<bool>& stop) {
  return FollowCommands(
      *group_, [this](const v1::GroupCommand& command) { return Follow(command); }, stop);
}

absl::Status GroupFollower::Follow(const v1::GroupCommand& command) {
  if (command.has_step_batch() || command.has_step_end()) return steps_.Follow(command);
  if (command.has_front()) {
    group_->set_front_address(command.front().address());
    return absl::OkStatus();
  }
  if (command.has_ping()) return absl::OkStatus();
  if (command.has_drain() || command.has_stop()) {
    if (drain_ == nullptr) return absl::FailedPreconditionError("no drain on this rank");
    return drain_->Follow(command);
  }
  return FollowHeadCommand(command);
}

absl::Status GroupFollower::FollowHeadCommand(const v1::GroupCommand& command) {
  ASSIGN_OR_RETURN(const HeadCommand decoded, DecodeHeadCommand(command, device_));
  return ApplyHeadCommand(*operations_, decoded).status();
}

}  // namespace remotehead::server
