// The one place where remotehead touches the server's file system on a client's behalf: a
// directory chosen by the operator (--checkpoint_dir), and the paths relative to it that clients
// name (CreateHead's safetensors.path, SaveWeights' path, a sharded checkpoint's shard names).
//
// - A path must be relative, non-empty and free of ".." components: anything else is refused
//   (INVALID_ARGUMENT) before the file system is touched, so nothing outside the directory can be
//   probed.
// - Paths are resolved one component at a time from a descriptor of the root with O_NOFOLLOW:
//   a symbolic link anywhere on the path is PERMISSION_DENIED, never followed.
// - Only regular files are opened (O_NONBLOCK, so a FIFO or a device never blocks a thread; it is
//   refused after fstat); a missing file is NOT_FOUND.
// - Writes are atomic: a temporary file in the target's directory (O_CREAT | O_EXCL, 0644), fsync,
//   renameat over the target, fsync of the directory. Any failure removes the temporary file and
//   leaves the previous target as it was. An existing target is replaced only if the caller's
//   check accepts it. A crash can leave the temporary file: RemoveTemporaryFiles cleans them.
//
// Every status names the caller's field (e.g. "safetensors.path") and the relative path; none
// carries bytes read from a file. An opened file is a CheckpointFile (checkpoint_file.h); the
// file-system operations below these rules are core/src/safe_file_ops.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/checkpoint_file.h"

namespace remotehead::core {

// An entry of a directory as lstat sees it (a link is a link, never what it points to).
struct DirEntry {
  enum class Kind { kRegular, kDirectory, kLink, kOther };
  std::string name;
  Kind kind = Kind::kOther;
};

class CheckpointDir {
 public:
  // Opens the operator's directory `root` (it may itself be reached through links: the operator
  // chose it). NOT_FOUND / INVALID_ARGUMENT / PERMISSION_DENIED if it is not an open-able
  // directory.
  static absl::StatusOr<std::shared_ptr<const CheckpointDir>> Open(const std::string& root);
  ~CheckpointDir();
  CheckpointDir(const CheckpointDir&) = delete;
  CheckpointDir& operator=(const CheckpointDir&) = delete;

  const std::string& root() const { return root_; }

  // INVALID_ARGUMENT naming `field` unless `relative` is a non-empty relative path without ".."
  // components, NUL bytes, or an excessive length, that names a file (not "." alone). Touches
  // nothing.
  static absl::Status CheckRelative(std::string_view relative, std::string_view field);

  // Opens the regular file `relative` for reading. Messages call it `field: "relative"`, or,
  // given `shown` (for a path read from a file, e.g. a shard named by an index), `field: shown`
  // and then never spell the path's components.
  absl::StatusOr<CheckpointFile> OpenForRead(std::string_view relative, std::string_view field,
                                             std::string_view shown = {}) const;

  // Writes `relative` atomically: `write` fills a new temporary file beside it, which then
  // replaces the target. If the target exists, it must be a regular file (not a link) that
  // `may_replace` accepts (given the target opened for reading); otherwise FAILED_PRECONDITION
  // naming `field`, and nothing is written. On any failure the temporary file is removed and
  // the target is left as it was. Returns the bytes written.
  absl::StatusOr<int64_t> WriteAtomically(
      std::string_view relative, std::string_view field,
      const std::function<absl::Status(const CheckpointFile& existing)>& may_replace,
      const std::function<absl::Status(CheckpointFile& out)>& write) const;

  // Creates the directory `relative` (its parent must exist) unless it is one already;
  // PERMISSION_DENIED for a link there, FAILED_PRECONDITION for another kind of file.
  absl::Status MakeDirectory(std::string_view relative, std::string_view field) const;
  // The entries of the directory `relative` ("" : the root itself), reached without links.
  absl::StatusOr<std::vector<DirEntry>> List(std::string_view relative,
                                             std::string_view field) const;
  // Removes the file (or link: never what it points to) `relative`; NOT_FOUND if it is gone.
  absl::Status Remove(std::string_view relative, std::string_view field) const;
  // Removes the directory `relative` with the files and links in it (not its subdirectories).
  absl::Status RemoveDirectory(std::string_view relative, std::string_view field) const;
  // Removes the temporary files that writes interrupted by a crash left in the directory
  // `relative` ("" : the root); returns how many.
  absl::StatusOr<int> RemoveTemporaryFiles(std::string_view relative, std::string_view field) const;

 private:
  CheckpointDir(int fd, std::string root) : fd_(fd), root_(std::move(root)) {}

  int fd_;
  std::string root_;
};

}  // namespace remotehead::core
