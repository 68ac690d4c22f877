// An open regular file of the operator's checkpoint directory (checkpoint_dir.h), apart from the
// directory itself: CheckpointDir opens it (for reading, or as the temporary file of an atomic
// write), and the readers and writers of its contents (checkpoint.h, the server's state store)
// use only this. Messages name the caller's field and the relative path, never the file's bytes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"

namespace remotehead::core {

// An open regular file (owned descriptor) inside a CheckpointDir.
class CheckpointFile {
 public:
  // `where`: how messages about the file begin, e.g. `safetensors.path: "model.safetensors"`.
  CheckpointFile(int fd, int64_t size, std::string where)
      : fd_(fd), size_(size), where_(std::move(where)) {}
  ~CheckpointFile();
  CheckpointFile(CheckpointFile&& other) noexcept;
  CheckpointFile& operator=(CheckpointFile&&) = delete;
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;

  // The file's size when it was opened (fstat).
  int64_t size() const { return size_; }
  // The field and the path (`field: "relative"`): how messages about this file begin.
  const std::string& where() const { return where_; }

  // Reads exactly `bytes` bytes at `offset` (pread, retried on short reads). DATA_LOSS if the
  // file ends before: offset + bytes is checked against size() without overflow.
  absl::Status ReadAt(uint64_t offset, uint64_t bytes, void* dst) const;
  // Appends `bytes` bytes at the current position (write, retried on short writes).
  absl::Status Write(const void* data, uint64_t bytes);

  int fd() const { return fd_; }

 private:
  int fd_;
  int64_t size_;
  std::string where_;
};

}  // namespace remotehead::core
