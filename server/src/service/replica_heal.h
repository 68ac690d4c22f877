// The heal of a mesh replica admitted again (remotehead/server/group/head_mesh.h), this rank's
// part: every rank of every serving replica runs it, as the mesh command hc::Heal, on the rows
// of its shard (replica_heal.cc says how).
#pragma once

#include "absl/status/status.h"
#include "service/head_operations.h"

namespace remotehead::server {

// The leader's replica's rank sends every head's sealed state to its shard peers of `epoch`;
// replica `admitted`'s verifies and installs them; every replica compares. DATA_LOSS /
// PERMISSION_DENIED on the joiner for a state that does not verify; DATA_LOSS (REPLICAS_DIVERGED)
// everywhere if the replicas' heads differ afterwards.
absl::Status HealReplica(HeadOperations& operations, int epoch, int admitted);

}  // namespace remotehead::server
