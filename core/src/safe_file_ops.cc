#include "safe_file_ops.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core::safe_file_ops {
namespace {

absl::Status NotRegular(const Naming& naming, mode_t mode) {
  return absl::InvalidArgumentError(
      absl::StrCat(naming.where, ": expected a regular file; got ", KindOf(mode)));
}

// The temporary file a write of `name` creates beside it (its name shortened to stay below
// NAME_MAX): IsTemporaryName recognises it.
std::string TemporaryName(const std::string& name, uint64_t serial) {
  return absl::StrCat(".", name.substr(0, 128), ".tmp-", ::getpid(), "-", serial);
}

// A new temporary file beside `name` in `parent` (O_CREAT | O_EXCL, 0644); its name in `temp`.
absl::StatusOr<CheckpointFile> CreateTemporary(int parent, const std::string& name,
                                               const Naming& naming, std::string* temp) {
  static std::atomic<uint64_t> counter{0};
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    *temp = TemporaryName(name, counter++);
    fd = ::openat(parent, temp->c_str(),
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
  return CheckpointFile(fd, 0, naming.where);
}

// Renames `temp` over `name` in `parent`: 0, or the errno. A new file (!exists) must still be
// new: one created meanwhile is never replaced unchecked.
int RenameOver(int parent, const std::string& temp, const std::string& name, bool exists) {
  int renamed = exists ? ::renameat(parent, temp.c_str(), parent, name.c_str())
                       : ::renameat2(parent, temp.c_str(), parent, name.c_str(), RENAME_NOREPLACE);
  if (renamed != 0 && !exists && (errno == EINVAL || errno == ENOSYS)) {
    // A file system without RENAME_NOREPLACE: the plain rename.
    renamed = ::renameat(parent, temp.c_str(), parent, name.c_str());
  }
  return renamed == 0 ? 0 : errno;
}

}  // namespace

std::string Quoted(std::string_view s) { return absl::StrCat("\"", std::string(s), "\""); }

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

absl::StatusOr<int64_t> ReplaceAtomically(
    int parent, const std::string& name, const Naming& naming, bool exists,
    const std::function<absl::Status(CheckpointFile& out)>& write) {
  std::string temp;
  ASSIGN_OR_RETURN(CheckpointFile out, CreateTemporary(parent, name, naming, &temp));
  auto fail = [&](absl::Status status) {
    ::unlinkat(parent, temp.c_str(), 0);
    return status;
  };
  if (absl::Status s = write(out); !s.ok()) return fail(s);
  struct stat st;
  if (::fsync(out.fd()) != 0 || ::fstat(out.fd(), &st) != 0) {
    return fail(absl::InternalError(
        absl::StrCat(naming.where, ": cannot sync it (", std::strerror(errno), ")")));
  }
  const int64_t bytes = static_cast<int64_t>(st.st_size);
  if (const int err = RenameOver(parent, temp, name, exists); err != 0) {
    if (err == EEXIST) {
      return fail(absl::AlreadyExistsError(
          absl::StrCat(naming.where, ": expected a new file; another one appeared meanwhile")));
    }
    return fail(absl::InternalError(
        absl::StrCat(naming.where, ": cannot rename into it (", std::strerror(err), ")")));
  }
  if (::fsync(parent) != 0) {
    return absl::InternalError(absl::StrCat(
        naming.where, ": written, but syncing its directory failed (", std::strerror(errno), ")"));
  }
  return bytes;
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

}  // namespace remotehead::core::safe_file_ops
