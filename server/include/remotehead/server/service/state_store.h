// The durable training state of a server's heads (--state_dir): one file per saved state,
// written atomically (temporary file, fsync, rename, fsync of the directory) so that a crash
// while saving leaves the previous state intact; the newest state of each head is restored
// when the server starts. Layout: <dir>/<head id, %-escaped>/<state id>.safetensors, the
// format of core/head_state.h.
//
// With a state secret (state_restore.h's OpenStateStore: --state_secret_file, else a head
// group's secret) every state is sealed when saved and must verify when loaded: a state that
// whoever can write the directory planted — forged, sealed under another secret, or saved
// unsealed — is refused (PERMISSION_DENIED naming the file), at start and on RestoreHeadState
// alike. Without one the checksum only detects damage.
//
// Inside the directory, the rules of --checkpoint_dir apply (core::CheckpointDir): no symbolic
// link is followed (a head's directory or a state that is a link is refused, for reading and
// for writing), only regular files are opened, and they are checked before they are opened (a
// FIFO never blocks a start or a restore). Temporary files that crashed saves left are removed
// when the store opens. Messages name files relative to the directory, never by the server's
// absolute path.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/head_state.h"

namespace remotehead::server {

class StateStore {
 public:
  // `dir` is created if missing (it may itself be reached through links: the operator chose
  // it). `keep`: states kept per head (older ones are deleted) — the newest periodic ones and
  // those a trainer checkpoint refers to alike, so keep at least as many as the trainer keeps
  // checkpoints.
  // `secret`: the key states are sealed and verified with (core::StateSecret; empty: none).
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& dir, int keep,
                                                          core::StateSecret secret);

  // A fresh state id: ordered by creation time, unique.
  static std::string NewStateId();
  // INVALID_ARGUMENT naming `field` for a head id whose states could not be saved: its
  // directory's name (the id %-escaped) would exceed a file name's 255 bytes.
  static absl::Status CheckHeadId(const std::string& head_id, const std::string& field);

  // Writes `state` (under state.head_id / state.state_id), then deletes the head's states
  // beyond `keep`.
  absl::Status Save(const core::HeadState& state);
  // INVALID_ARGUMENT for a malformed id, NOT_FOUND for no such state, DATA_LOSS (naming the
  // file) for a truncated or corrupted one, PERMISSION_DENIED (naming the file) for one that
  // does not verify under the state secret.
  absl::StatusOr<core::HeadState> Load(const std::string& head_id,
                                       const std::string& state_id) const;
  // INVALID_ARGUMENT naming state_id unless it is an id NewStateId could have made.
  static absl::Status CheckStateId(const std::string& state_id);
  // Every head's state ids, oldest first, by the head's directory (its id, %-escaped): what a
  // starting server chooses from (state_restore.h). PERMISSION_DENIED naming the entry for a
  // link.
  absl::StatusOr<std::map<std::string, std::vector<std::string>>> Listing() const;
  // The state `state_id` of the head directory `head_dir` (a name from Listing), read as a
  // start reads it: DATA_LOSS naming the file by its path if it cannot be loaded whole or is
  // not the state its names say; PERMISSION_DENIED naming it if it does not verify under the
  // state secret; PERMISSION_DENIED / INVALID_ARGUMENT naming a link or a file that is not a
  // regular one.
  absl::StatusOr<core::HeadState> LoadAtStart(const std::string& head_dir,
                                              const std::string& state_id) const;
  // Deletes every state of the head (it was dropped).
  void Remove(const std::string& head_id);

  const std::string& dir() const { return dir_; }
  // Whether states are sealed (a state secret was given).
  bool sealed() const { return !secret_.secret.empty(); }
  // Temporary files of interrupted saves that Open removed.
  int removed_temporary_files() const { return removed_temporary_files_; }

 private:
  StateStore(std::string dir, int keep, core::StateSecret secret,
             std::shared_ptr<const core::CheckpointDir> root)
      : dir_(std::move(dir)), keep_(keep), secret_(std::move(secret)), root_(std::move(root)) {}
  // The states in the head directory `head_dir` (relative), oldest first.
  absl::StatusOr<std::vector<std::string>> StateIds(const std::string& head_dir) const;
  // The state in the file `relative`; `field` begins the messages of a file that cannot be
  // opened, `source` names it in those of one that cannot be decoded.
  absl::StatusOr<core::HeadState> Read(const std::string& relative, const std::string& field,
                                       const std::string& source) const;

  const std::string dir_;
  const int keep_;
  const core::StateSecret secret_;
  const std::shared_ptr<const core::CheckpointDir> root_;
  int removed_temporary_files_ = 0;
  mutable std::mutex mu_;  // one writer at a time per store
};

}  // namespace remotehead::server
