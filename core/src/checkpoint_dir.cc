#include "remotehead/core/checkpoint_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {
namespace {

constexpr size_t kMaxPathBytes = 4096;

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

std::string Quoted(std::string_view s) { return absl::StrCat("\"", std::string(s), "\""); }

// The components of a path that CheckRelative accepted ("." and empty ones dropped).
std::vector<std::string> Components(std::string_view relative) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= relative.size()) {
    size_t end = relative.find('/', start);
    if (end == std::string_view::npos) end = relative.size();
    std::string_view part = relative.substr(start, end - start);
    if (!part.empty() && part != ".") parts.emplace_back(part);
    start = end + 1;
  }
  return parts;
}

const char* KindOf(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

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

Naming NameOf(std::string_view relative, std::string_view field, std::string_view shown) {
  if (shown.empty()) return {absl::StrCat(std::string(field), ": ", Quoted(relative)), false};
  return {absl::StrCat(std::string(field), ": ", std::string(shown)), true};
}

absl::Status SymlinkRefused(const Naming& naming, std::string_view prefix, bool last) {
  if (last) {
    return absl::PermissionDeniedError(
        absl::StrCat(naming.where,
                     ": expected a regular file; got a symbolic link (links in the checkpoint "
                     "directory are not followed)"));
  }
  return absl::PermissionDeniedError(
      absl::StrCat(naming.where, ": expected no symbolic links on the path; ", naming.Dir(prefix),
                   " is one (links in the checkpoint directory are not followed)"));
}

// The status for a failed open / stat of the component `name` of `parent`, reached as `prefix`
// (`last`: the file itself, else a directory on its path). ELOOP / ENOTDIR are told apart by
// looking at the component: a link, or something that is not a directory.
absl::Status OpenError(int err, int parent, const std::string& name, const Naming& naming,
                       std::string_view prefix, bool last) {
  struct stat st;
  if ((err == ELOOP || err == ENOTDIR) &&
      ::fstatat(parent, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISLNK(st.st_mode)) return SymlinkRefused(naming, prefix, last);
    if (err == ENOTDIR) {
      return absl::InvalidArgumentError(absl::StrCat(naming.where, ": expected ",
                                                     naming.Dir(prefix), " to be a directory; got ",
                                                     KindOf(st.st_mode)));
    }
  }
  const std::string what = last ? std::string("it") : naming.Dir(prefix);
  switch (err) {
    case ENOENT:
      return last ? absl::NotFoundError(
                        absl::StrCat(naming.where, ": no such file in the checkpoint directory"))
                  : absl::NotFoundError(absl::StrCat(naming.where, ": expected ", what,
                                                     " to be a directory in the checkpoint "
                                                     "directory; there is none"));
    case ELOOP:
      return SymlinkRefused(naming, prefix, last);
    case ENOTDIR:
      return absl::InvalidArgumentError(
          absl::StrCat(naming.where, ": expected ", what, " to be a directory"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(
          absl::StrCat(naming.where, ": the server may not open ", what, " (permission denied)"));
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(
          absl::StrCat(naming.where, ": expected shorter file names; got too long a one"));
    default:
      return absl::InternalError(
          absl::StrCat(naming.where, ": cannot open ", what, " (", std::strerror(err), ")"));
  }
}

absl::Status NotRegular(const Naming& naming, mode_t mode) {
  return absl::InvalidArgumentError(
      absl::StrCat(naming.where, ": expected a regular file; got ", KindOf(mode)));
}

// Opens the existing regular file `name` in `parent` for reading, without following a link and
// without blocking (a FIFO opened O_NONBLOCK for reading returns at once; it is then refused).
absl::StatusOr<CheckpointFile> OpenRegular(int parent, const std::string& name,
                                           const Naming& naming) {
  // Refuse what is not a regular file before opening it (opening a device can have effects)...
  struct stat st;
  if (::fstatat(parent, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return OpenError(errno, parent, name, naming, name, /*last=*/true);
  }
  if (S_ISLNK(st.st_mode)) return SymlinkRefused(naming, name, /*last=*/true);
  if (!S_ISREG(st.st_mode)) return NotRegular(naming, st.st_mode);
  const int fd =
      ::openat(parent, name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY);
  if (fd < 0) return OpenError(errno, parent, name, naming, name, /*last=*/true);
  FdCloser closer(fd);
  // ... and again after (it may have been replaced in between).
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(
        absl::StrCat(naming.where, ": cannot stat it (", std::strerror(errno), ")"));
  }
  if (!S_ISREG(st.st_mode)) return NotRegular(naming, st.st_mode);
  return CheckpointFile(closer.release(), static_cast<int64_t>(st.st_size), naming.where);
}

// A descriptor of the directory holding the last component of `relative` (already checked by
// CheckRelative), walked from `root` one component at a time without following links, and that
// last component.
absl::Status OpenParent(int root, std::string_view relative, const Naming& naming, int* parent_fd,
                        std::string* name) {
  const std::vector<std::string> parts = Components(relative);
  FdCloser current(::dup(root));
  if (current.get() < 0) {
    return absl::InternalError(absl::StrCat(
        naming.where, ": cannot open the checkpoint directory (", std::strerror(errno), ")"));
  }
  std::string prefix;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    prefix = prefix.empty() ? parts[i] : absl::StrCat(prefix, "/", parts[i]);
    const int next =
        ::openat(current.get(), parts[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) return OpenError(errno, current.get(), parts[i], naming, prefix, false);
    current.reset(next);
  }
  *name = parts.back();
  *parent_fd = current.release();
  return absl::OkStatus();
}

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

// A descriptor of the directory `relative` ("" : `root` itself), walked from `root` one
// component at a time without following links.
absl::StatusOr<int> OpenDirectory(int root, std::string_view relative, const Naming& naming) {
  // A new open file description ("."), not a dup: a listing reads from its own offset.
  FdCloser current(::openat(root, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (current.get() < 0) {
    return absl::InternalError(absl::StrCat(
        naming.where, ": cannot open the checkpoint directory (", std::strerror(errno), ")"));
  }
  std::string prefix;
  for (const std::string& part : Components(relative)) {
    prefix = prefix.empty() ? part : absl::StrCat(prefix, "/", part);
    const int next =
        ::openat(current.get(), part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) return OpenError(errno, current.get(), part, naming, prefix, false);
    current.reset(next);
  }
  return current.release();
}

// The temporary file a write of `name` creates beside it (what a crash may leave behind), and
// whether a name is one.
std::string TemporaryName(const std::string& name, uint64_t serial) {
  return absl::StrCat(".", name.substr(0, 128), ".tmp-", ::getpid(), "-", serial);
}
bool IsTemporaryName(std::string_view name) {
  const size_t tmp = name.rfind(".tmp-");
  if (name.empty() || name.front() != '.' || tmp == std::string_view::npos || tmp == 0) {
    return false;
  }
  const std::string_view tail = name.substr(tmp + 5);  // "<pid>-<serial>"
  const size_t dash = tail.find('-');
  auto digits = [](std::string_view d) {
    return !d.empty() && d.find_first_not_of("0123456789") == std::string_view::npos;
  };
  return dash != std::string_view::npos && digits(tail.substr(0, dash)) &&
         digits(tail.substr(dash + 1));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CheckpointFile

CheckpointFile::~CheckpointFile() {
  if (fd_ >= 0) ::close(fd_);
}

CheckpointFile::CheckpointFile(CheckpointFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_), where_(std::move(other.where_)) {}

absl::Status CheckpointFile::ReadAt(uint64_t offset, uint64_t bytes, void* dst) const {
  const uint64_t size = static_cast<uint64_t>(size_);
  if (offset > size || bytes > size - offset) {
    return absl::DataLossError(absl::StrCat(where_, ": expected ", bytes, " bytes at offset ",
                                            offset, "; the file has ", size, " bytes"));
  }
  char* out = static_cast<char*>(dst);
  while (bytes > 0) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(bytes, uint64_t{1} << 30));
    const ssize_t n = ::pread(fd_, out, want, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(
          absl::StrCat(where_, ": read failed (", std::strerror(errno), ")"));
    }
    if (n == 0) {
      return absl::DataLossError(
          absl::StrCat(where_, ": the file ended at byte ", offset, " while being read"));
    }
    out += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status CheckpointFile::Write(const void* data, uint64_t bytes) {
  const char* in = static_cast<const char*>(data);
  while (bytes > 0) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(bytes, uint64_t{1} << 30));
    const ssize_t n = ::write(fd_, in, want);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::InternalError(absl::StrCat(where_, ": write failed (",
                                              n < 0 ? std::strerror(errno) : "no progress", ")"));
    }
    in += n;
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// CheckpointDir

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

  // A new temporary file beside the target (its name shortened to stay below NAME_MAX).
  static std::atomic<uint64_t> counter{0};
  std::string temp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp = TemporaryName(name, counter++);
    fd = ::openat(parent.get(), temp.c_str(),
                  O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    const int err = errno;
    const std::string what = absl::StrCat(
        naming.where, ": cannot create a temporary file beside it (", std::strerror(err), ")");
    return err == EACCES || err == EPERM || err == EROFS ? absl::PermissionDeniedError(what)
                                                         : absl::InternalError(what);
  }
  CheckpointFile out(fd, 0, naming.where);
  auto fail = [&](absl::Status status) {
    ::unlinkat(parent.get(), temp.c_str(), 0);
    return status;
  };
  if (absl::Status s = write(out); !s.ok()) return fail(s);
  if (::fsync(out.fd()) != 0 || ::fstat(out.fd(), &st) != 0) {
    return fail(absl::InternalError(
        absl::StrCat(naming.where, ": cannot sync it (", std::strerror(errno), ")")));
  }
  const int64_t bytes = static_cast<int64_t>(st.st_size);
  // A new file must still be new: one created meanwhile is never replaced unchecked.
  int renamed = exists ? ::renameat(parent.get(), temp.c_str(), parent.get(), name.c_str())
                       : ::renameat2(parent.get(), temp.c_str(), parent.get(), name.c_str(),
                                     RENAME_NOREPLACE);
  if (renamed != 0 && !exists && (errno == EINVAL || errno == ENOSYS)) {
    // A file system without RENAME_NOREPLACE: the plain rename.
    renamed = ::renameat(parent.get(), temp.c_str(), parent.get(), name.c_str());
  }
  if (renamed != 0) {
    const int err = errno;
    if (err == EEXIST) {
      return fail(absl::AlreadyExistsError(
          absl::StrCat(naming.where, ": expected a new file; another one appeared meanwhile")));
    }
    return fail(absl::InternalError(
        absl::StrCat(naming.where, ": cannot rename into it (", std::strerror(err), ")")));
  }
  if (::fsync(parent.get()) != 0) {
    return absl::InternalError(absl::StrCat(
        naming.where, ": written, but syncing its directory failed (", std::strerror(errno), ")"));
  }
  return bytes;
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
