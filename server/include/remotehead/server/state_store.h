// The durable training state of a server's heads (--state_dir): one file per saved state,
// written atomically (temporary file, fsync, rename, fsync of the directory) so that a crash
// while saving leaves the previous state intact; the newest state of each head is restored
// when the server starts. Layout: <dir>/<head id, %-escaped>/<state id>.safetensors, the
// format of core/head_state.h.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/head_state.h"

namespace remotehead::server {

class StateStore {
 public:
  // `dir` is created if missing. `keep`: states kept per head (older ones are deleted) — the
  // newest periodic ones and those a trainer checkpoint refers to alike, so keep at least as
  // many as the trainer keeps checkpoints.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& dir, int keep);

  // A fresh state id: ordered by creation time, unique.
  static std::string NewStateId();

  // Writes `state` (under state.head_id / state.state_id), then deletes the head's states
  // beyond `keep`.
  absl::Status Save(const core::HeadState& state);
  // INVALID_ARGUMENT for a malformed id, NOT_FOUND for no such state, DATA_LOSS (naming the
  // file) for a truncated or corrupted one.
  absl::StatusOr<core::HeadState> Load(const std::string& head_id,
                                       const std::string& state_id) const;
  // The newest state of every head in the directory: what a starting server restores.
  // DATA_LOSS naming the file if one of them cannot be loaded whole.
  absl::StatusOr<std::vector<core::HeadState>> LoadNewest() const;
  // Deletes every state of the head (it was dropped).
  void Remove(const std::string& head_id);

  const std::string& dir() const { return dir_; }

 private:
  StateStore(std::string dir, int keep) : dir_(std::move(dir)), keep_(keep) {}
  std::string HeadDir(const std::string& head_id) const;
  std::vector<std::string> StateIds(const std::string& head_dir) const;  // oldest first

  const std::string dir_;
  const int keep_;
  mutable std::mutex mu_;  // one writer at a time per store
};

}  // namespace remotehead::server
