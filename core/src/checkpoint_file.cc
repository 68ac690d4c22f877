#include "remotehead/core/checkpoint_file.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace remotehead::core {

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

}  // namespace remotehead::core
