// The one apply path of a head command (translate/head_commands.h): the front runs its own part
// of every head command it logs through it, and every other rank runs the command it decoded
// from the log through it (GroupFollower), so the two cannot drift apart. It is this rank's
// part only: the command's other ranks are the log's (ReplicatedHeadOperations proposes).
#pragma once

#include "absl/status/statusor.h"
#include "service/head_operations.h"
#include "translate/head_commands.h"

namespace remotehead::server {

absl::StatusOr<HeadCommandResult> ApplyHeadCommand(HeadOperations& operations,
                                                   const HeadCommand& command);

}  // namespace remotehead::server
