// What a server started with --state_dir restores: every head's newest state that every process
// of its head group or mesh saved (a server on its own: its newest state). On a group each rank
// keeps its shard's states in a directory of its own (RankStateDir), under state ids the front
// chose for all of them (HeadOperations::SaveState), so a state is whole where every rank has
// a file of that id: a rank killed during a save, or pruning, leaves a state that some ranks
// lack, and the ranks then agree on the newest one they all have. The ranks exchange what
// they hold, and then whether they could load it, over the group's collectives: one rank that
// cannot start refuses the start of every rank, naming itself.
#pragma once

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "group/join.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/server/state_store.h"

namespace remotehead::server {

// The directory of this process's states: `dir` for a server on its own, `dir`/rank-<g> for
// global rank g of a group or mesh (so that ranks given the same --state_dir, as torchrun
// gives them, never share files).
std::string RankStateDir(const std::string& dir, const GroupConfig& config);

// Restores into `registry` (on `device`, with this rank's rows) every head's newest state that
// every process of `cluster` holds, and says so on `log`; a head with no such state is left out
// and named. DATA_LOSS / FAILED_PRECONDITION naming the rank and the file when a rank cannot
// load the chosen state (corrupt, or saved by another layout of the group), on every rank.
absl::Status RestoreHeadsAtStart(const StateStore& store, const Cluster& cluster,
                                 const torch::Device& device, HeadRegistry* registry,
                                 std::ostream& log);

}  // namespace remotehead::server
