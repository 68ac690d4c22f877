// The file-system operations that CheckpointDir (checkpoint_dir.h) is built on, kept apart from
// its paths and their checks so that each rule of the directory has one implementation: entries
// reached from a directory descriptor one component at a time with O_NOFOLLOW, regular files
// opened without blocking, files replaced atomically (temporary file, fsync, rename, fsync of the
// directory), and the statuses that say what was found instead. Private to the checkpoint code;
// its messages speak of "the checkpoint directory".
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/checkpoint_file.h"

namespace remotehead::core::safe_file_ops {

// Closes a descriptor at the end of a scope unless released.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  FdCloser(FdCloser&& other) noexcept : fd_(other.release()) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

// `s` in double quotes, as messages show a path.
std::string Quoted(std::string_view s);

// The components of a path that CheckpointDir::CheckRelative accepted ("." and empty ones
// dropped).
std::vector<std::string> Components(std::string_view relative);

// What lstat found, as messages say it: "a regular file", "a symbolic link", "a FIFO", ...
const char* KindOf(mode_t mode);

// How messages name the file being opened: `field: "relative"`, or, for a path read from a file
// (a shard named by an index), `field: <description>` and never the path's components.
struct Naming {
  std::string where;  // how every message begins
  bool hide_path;
  // A directory on the path: "a/b", or "a directory on its path".
  std::string Dir(std::string_view prefix) const {
    return hide_path ? "a directory on its path" : Quoted(prefix);
  }
};

// `field: "relative"`, or `field: shown` when `shown` is not empty.
Naming NameOf(std::string_view relative, std::string_view field, std::string_view shown);

// PERMISSION_DENIED for a symbolic link at `prefix` (`last`: the file itself, else a directory
// on its path): links in the checkpoint directory are never followed.
absl::Status SymlinkRefused(const Naming& naming, std::string_view prefix, bool last);

// The status for a failed open / stat of the component `name` of `parent`, reached as `prefix`
// (`last`: the file itself, else a directory on its path). ELOOP / ENOTDIR are told apart by
// looking at the component: a link, or something that is not a directory.
absl::Status OpenError(int err, int parent, const std::string& name, const Naming& naming,
                       std::string_view prefix, bool last);

// Opens the existing regular file `name` in `parent` for reading, without following a link and
// without blocking (a FIFO opened O_NONBLOCK for reading returns at once; it is then refused).
absl::StatusOr<CheckpointFile> OpenRegular(int parent, const std::string& name,
                                           const Naming& naming);

// A descriptor of the directory holding the last component of `relative` (already checked by
// CheckRelative), walked from `root` one component at a time without following links, and that
// last component.
absl::Status OpenParent(int root, std::string_view relative, const Naming& naming, int* parent_fd,
                        std::string* name);

// A descriptor of the directory `relative` ("" : `root` itself), walked from `root` one
// component at a time without following links.
absl::StatusOr<int> OpenDirectory(int root, std::string_view relative, const Naming& naming);

// Puts a new file that `write` fills in place of the entry `name` of `parent` (`exists`: there is
// one, already accepted by the caller; otherwise there must still be none): a temporary file
// beside it (O_CREAT | O_EXCL, 0644), fsync, renameat over the target, fsync of the directory.
// Any failure before the rename removes the temporary file and leaves the target as it was.
// Returns the bytes written.
absl::StatusOr<int64_t> ReplaceAtomically(
    int parent, const std::string& name, const Naming& naming, bool exists,
    const std::function<absl::Status(CheckpointFile& out)>& write);

// Whether `name` is a temporary file that ReplaceAtomically creates (what a crash may leave).
bool IsTemporaryName(std::string_view name);

}  // namespace remotehead::core::safe_file_ops
