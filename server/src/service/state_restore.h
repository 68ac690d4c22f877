// What a server started with --state_dir restores: every head's newest state that every process
// of its head group or mesh saved (a server on its own: its newest state). On a group each rank
// keeps its shard's states in a directory of its own (RankStateDir), under state ids the front
// chose for all of them (HeadOperations::SaveState), so a state is whole where every rank has
// a file of that id: a rank killed during a save, or pruning, leaves a state that some ranks
// lack, and the ranks then agree on the newest one they all have. The ranks exchange what
// they hold, and then whether they could load it, over the group's collectives: one rank that
// cannot start refuses the start of every rank, naming itself.
#pragma once

#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "group/join.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/server/service/state_store.h"

namespace remotehead::server {

// The directory of this process's states: `dir` for a server on its own, `dir`/rank-<g> for
// global rank g of a group or mesh (so that ranks given the same --state_dir, as torchrun
// gives them, never share files).
std::string RankStateDir(const std::string& dir, const GroupConfig& config);

// The flags of the durable state.
struct StateDirOptions {
  std::string dir;          // --state_dir; empty: no durable state
  int keep = 5;             // --state_keep
  std::string secret_file;  // --state_secret_file; empty: the group's secret, if any
};

// This process's state store (nullptr without --state_dir), in its RankStateDir. Its states are
// sealed under the secret of --state_secret_file if given, else under the group's secret
// (GroupConfig::secret, --group_secret_file) on a head group or mesh: a state secret of its own
// wins, so that the group's secret can be rotated without refusing every saved state. Says on
// `log` which key seals them, or that none does and which flag would. INVALID_ARGUMENT naming
// the flag for --state_secret_file without --state_dir; ReadSecretFile's errors for its file;
// StateStore::Open's for the directory.
absl::StatusOr<std::unique_ptr<StateStore>> OpenStateStore(const StateDirOptions& options,
                                                           const GroupConfig& config,
                                                           std::ostream& log);

// Restores into `registry` (on `device`, with this rank's rows) every head's newest state that
// every process of `cluster` holds, and says so on `log`; a head with no such state is left out
// and named. DATA_LOSS / PERMISSION_DENIED / FAILED_PRECONDITION naming the rank and the file
// when a rank cannot load the chosen state (corrupt; not verifying under the state secret; saved
// by another layout of the group), on every rank.
absl::Status RestoreHeadsAtStart(const StateStore& store, const Cluster& cluster,
                                 const torch::Device& device, HeadRegistry* registry,
                                 std::ostream& log);

}  // namespace remotehead::server
