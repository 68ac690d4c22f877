// A head group's ranks other than the front: the one follower that takes every command of the
// group's log (HeadGroup::Follow) and runs it on this rank — a head command
// (translate/head_commands.h) decoded once and applied through ApplyHeadCommand, as the front
// applies its own part; a request's engine call or end (group_steps.h) through
// GroupStepFollower; the front's address (front_address.h) into the group; the drain's commands
// (cluster_drain.h) to `drain` (nullptr: refused, as in tests that run no drain).
#pragma once

#include <atomic>

#include "absl/status/status.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/v1/head_group.pb.h"
#include "replication/cluster_drain.h"
#include "replication/group_steps.h"
#include "service/head_operations.h"

namespace remotehead::server {

class GroupFollower {
 public:
  GroupFollower(HeadOperations* operations, HeadRegistry* registry, HeadGroup* group,
                torch::Device device, ClusterDrain* drain = nullptr)
      : operations_(operations),
        group_(group),
        device_(device),
        drain_(drain),
        steps_(registry, group, device) {}

  // Follows the group's log until `stop` or the group fails (a rank other than the front).
  absl::Status Run(const std::atomic<bool>& stop);
  // Runs one command of the log on this rank.
  absl::Status Follow(const v1::GroupCommand& command);

 private:
  absl::Status FollowHeadCommand(const v1::GroupCommand& command);

  HeadOperations* const operations_;
  HeadGroup* const group_;
  const torch::Device device_;
  ClusterDrain* const drain_;
  GroupStepFollower steps_;  // the front's requests, each with this rank's scratch dW
};

}  // namespace remotehead::server
