#include "remotehead/core/checkpoint_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "safe_file_ops.h"

namespace remotehead::core {
namespace {

using safe_file_ops::Components;
using safe_file_ops::FdCloser;
using safe_file_ops::IsTemporaryName;
using safe_file_ops::KindOf;
using safe_file_ops::NameOf;
using safe_file_ops::Naming;
using safe_file_ops::OpenDirectory;
using safe_file_ops::OpenError;
using safe_file_ops::OpenParent;
using safe_file_ops::OpenRegular;
using safe_file_ops::Quoted;
using safe_file_ops::ReplaceAtomically;
using safe_file_ops::SymlinkRefused;

constexpr size_t kMaxPathBytes = 4096;

// A path checked (CheckRelative), the directory holding its last component (walked without
// links) and that component: where every operation on one entry starts.
struct Located {
  Naming naming;
  FdCloser parent;
  std::string name;
};

absl::StatusOr<Located> Locate(int root, std::string_view relative, std::string_view field) {
  RETURN_IF_ERROR(CheckpointDir::CheckRelative(relative, field));
  Naming naming = NameOf(relative, field, {});
  int parent = -1;
  std::string name;
  RETURN_IF_ERROR(OpenParent(root, relative, naming, &parent, &name));
  return Located{std::move(naming), FdCloser(parent), std::move(name)};
}

}  // namespace

absl::StatusOr<std::shared_ptr<const CheckpointDir>> CheckpointDir::Open(const std::string& root) {
  if (root.empty()) {
    return absl::InvalidArgumentError("checkpoint directory: expected a directory; got \"\"");
  }
  const int fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string what =
        absl::StrCat("checkpoint directory ", Quoted(root), ": cannot open it as a directory (",
                     std::strerror(err), ")");
    if (err == ENOENT) return absl::NotFoundError(what);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(what);
    return absl::InvalidArgumentError(what);
  }
  return std::shared_ptr<const CheckpointDir>(new CheckpointDir(fd, root));
}

CheckpointDir::~CheckpointDir() { ::close(fd_); }

absl::Status CheckpointDir::CheckRelative(std::string_view relative, std::string_view field) {
  const std::string f(field);
  if (relative.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ": expected a file path relative to the checkpoint directory; got \"\""));
  }
  if (relative.size() > kMaxPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat(f, ": expected a path of at most ",
                                                   kMaxPathBytes, " bytes; got ", relative.size(),
                                                   " bytes"));
  }
  if (relative.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ": expected a path without NUL bytes; got one with a NUL byte"));
  }
  if (relative.front() == '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        f, ": expected a path relative to the checkpoint directory; got the absolute path ",
        Quoted(relative)));
  }
  size_t start = 0;
  while (start <= relative.size()) {
    size_t end = relative.find('/', start);
    if (end == std::string_view::npos) end = relative.size();
    if (relative.substr(start, end - start) == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat(f, ": expected a path inside the checkpoint directory (no \"..\"); got ",
                       Quoted(relative)));
    }
    start = end + 1;
  }
  if (Components(relative).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ": expected a file path relative to the checkpoint directory; got ",
                     Quoted(relative), ", the directory itself"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointFile> CheckpointDir::OpenForRead(std::string_view relative,
                                                          std::string_view field,
                                                          std::string_view shown) const {
  RETURN_IF_ERROR(CheckRelative(relative, field));
  const Naming naming = NameOf(relative, field, shown);
  int parent = -1;
  std::string name;
  RETURN_IF_ERROR(OpenParent(fd_, relative, naming, &parent, &name));
  FdCloser closer(parent);
  return OpenRegular(parent, name, naming);
}

absl::StatusOr<int64_t> CheckpointDir::WriteAtomically(
    std::string_view relative, std::string_view field,
    const std::function<absl::Status(const CheckpointFile& existing)>& may_replace,
    const std::function<absl::Status(CheckpointFile& out)>& write) const {
  ASSIGN_OR_RETURN(const Located at, Locate(fd_, relative, field));
  const Naming& naming = at.naming;
  const FdCloser& parent = at.parent;
  const std::string& name = at.name;

  // What is there now: nothing, or a regular file that the caller agrees to replace.
  bool exists = true;
  struct stat st;
  if (::fstatat(parent.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno != ENOENT) return OpenError(errno, parent.get(), name, naming, name, true);
    exists = false;
  } else if (S_ISLNK(st.st_mode)) {
    return SymlinkRefused(naming, name, /*last=*/true);
  } else if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(naming.where, ": expected a new file or a checkpoint to replace; got ",
                     KindOf(st.st_mode)));
  } else {
    ASSIGN_OR_RETURN(CheckpointFile existing, OpenRegular(parent.get(), name, naming));
    RETURN_IF_ERROR(may_replace(existing));
  }
  return ReplaceAtomically(parent.get(), name, naming, exists, write);
}

absl::Status CheckpointDir::MakeDirectory(std::string_view relative, std::string_view field) const {
  ASSIGN_OR_RETURN(const Located at, Locate(fd_, relative, field));
  const Naming& naming = at.naming;
  const FdCloser& parent = at.parent;
  const std::string& name = at.name;
  if (::mkdirat(parent.get(), name.c_str(), 0755) == 0 || errno == EEXIST) {
    struct stat st;
    if (::fstatat(parent.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      return OpenError(errno, parent.get(), name, naming, relative, /*last=*/false);
    }
    if (S_ISLNK(st.st_mode)) return SymlinkRefused(naming, relative, /*last=*/false);
    if (!S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(naming.where, ": expected a directory; got ", KindOf(st.st_mode)));
    }
    return absl::OkStatus();
  }
  return OpenError(errno, parent.get(), name, naming, relative, /*last=*/false);
}

absl::StatusOr<std::vector<DirEntry>> CheckpointDir::List(std::string_view relative,
                                                          std::string_view field) const {
  if (!relative.empty()) RETURN_IF_ERROR(CheckRelative(relative, field));
  const Naming naming = NameOf(relative, field, {});
  ASSIGN_OR_RETURN(const int dir_fd, OpenDirectory(fd_, relative, naming));
  DIR* dir = ::fdopendir(dir_fd);
  if (dir == nullptr) {
    ::close(dir_fd);
    return absl::InternalError(
        absl::StrCat(naming.where, ": cannot list it (", std::strerror(errno), ")"));
  }
  std::vector<DirEntry> entries;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    DirEntry entry{.name = name};
    if (::fstatat(::dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      entry.kind = S_ISREG(st.st_mode)   ? DirEntry::Kind::kRegular
                   : S_ISDIR(st.st_mode) ? DirEntry::Kind::kDirectory
                   : S_ISLNK(st.st_mode) ? DirEntry::Kind::kLink
                                         : DirEntry::Kind::kOther;
    }
    entries.push_back(std::move(entry));
  }
  ::closedir(dir);  // closes dir_fd too
  return entries;
}

absl::Status CheckpointDir::Remove(std::string_view relative, std::string_view field) const {
  ASSIGN_OR_RETURN(const Located at, Locate(fd_, relative, field));
  if (::unlinkat(at.parent.get(), at.name.c_str(), 0) != 0) {
    return OpenError(errno, at.parent.get(), at.name, at.naming, relative, /*last=*/true);
  }
  return absl::OkStatus();
}

absl::Status CheckpointDir::RemoveDirectory(std::string_view relative,
                                            std::string_view field) const {
  ASSIGN_OR_RETURN(const std::vector<DirEntry> entries, List(relative, field));
  for (const DirEntry& e : entries) {
    if (e.kind == DirEntry::Kind::kDirectory) continue;
    RETURN_IF_ERROR(Remove(absl::StrCat(std::string(relative), "/", e.name), field));
  }
  ASSIGN_OR_RETURN(const Located at, Locate(fd_, relative, field));
  if (::unlinkat(at.parent.get(), at.name.c_str(), AT_REMOVEDIR) != 0) {
    return OpenError(errno, at.parent.get(), at.name, at.naming, relative, /*last=*/false);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CheckpointDir::RemoveTemporaryFiles(std::string_view relative,
                                                        std::string_view field) const {
  ASSIGN_OR_RETURN(const std::vector<DirEntry> entries, List(relative, field));
  int removed = 0;
  for (const DirEntry& e : entries) {
    if (e.kind != DirEntry::Kind::kRegular || !IsTemporaryName(e.name)) continue;
    const std::string path =
        relative.empty() ? e.name : absl::StrCat(std::string(relative), "/", e.name);
    if (Remove(path, field).ok()) ++removed;
  }
  return removed;
}

}  // namespace remotehead::core
