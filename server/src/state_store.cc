#include "remotehead/server/state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

namespace fs = std::filesystem;
constexpr char kSuffix[] = ".safetensors";

// A head id as one file name: letters, digits, '_', '-' as they are, everything else %XX (so
// "/", "." and ".." never reach the file system as themselves).
std::string EscapeId(const std::string& id) {
  std::string out;
  for (const unsigned char c : id) {
    if (absl::ascii_isalnum(c) || c == '_' || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  return out;
}

// 20 decimal digits of nanoseconds since the epoch, '-', 16 hex digits of randomness.
bool IsStateId(const std::string& id) {
  if (id.size() != 37 || id[20] != '-') return false;
  for (size_t i = 0; i < id.size(); ++i) {
    if (i == 20) continue;
    if (i < 20 ? !absl::ascii_isdigit(id[i]) : !absl::ascii_isxdigit(id[i])) return false;
  }
  return true;
}

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Writes `bytes` as `dir`/`name`, atomically: a crash leaves the old file or the new one.
absl::Status WriteAtomically(const std::string& dir, const std::string& name,
                             const std::string& bytes) {
  const std::string target = absl::StrCat(dir, "/", name);
  const std::string temp = absl::StrCat(target, ".tmp-", ::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", temp);
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = Errno("cannot write", temp);
      ::close(fd);
      ::unlink(temp.c_str());
      return s;
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    absl::Status s = Errno("cannot sync", temp);
    ::unlink(temp.c_str());
    return s;
  }
  if (::rename(temp.c_str(), target.c_str()) != 0) {
    absl::Status s = Errno("cannot rename to", target);
    ::unlink(temp.c_str());
    return s;
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno("cannot open", dir);
  const int synced = ::fsync(dfd);
  ::close(dfd);
  if (synced != 0) return Errno("cannot sync", dir);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& dir, int keep) {
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state_keep: expected >= 1 states per head; got ", keep));
  }
  std::error_code error;
  fs::create_directories(dir, error);
  if (error || !fs::is_directory(dir)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state_dir: expected a directory the server can create and write; got \"",
                     dir, "\"", error ? absl::StrCat(" (", error.message(), ")") : std::string()));
  }
  return std::unique_ptr<StateStore>(new StateStore(dir, keep));
}

std::string StateStore::NewStateId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  return absl::StrFormat("%020d-%016x", now, rng());
}

std::string StateStore::HeadDir(const std::string& head_id) const {
  return absl::StrCat(dir_, "/", EscapeId(head_id));
}

std::vector<std::string> StateStore::StateIds(const std::string& head_dir) const {
  std::vector<std::string> ids;
  std::error_code error;
  for (const auto& file : fs::directory_iterator(head_dir, error)) {
    const std::string name = file.path().filename().string();
    if (!absl::EndsWith(name, kSuffix)) continue;  // temporary files of an interrupted save
    const std::string id = name.substr(0, name.size() - std::strlen(kSuffix));
    if (IsStateId(id)) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());  // the ids begin with their creation time
  return ids;
}

absl::Status StateStore::Save(const core::HeadState& state) {
  ASSIGN_OR_RETURN(const std::string bytes, core::EncodeHeadState(state));
  std::lock_guard<std::mutex> lock(mu_);
  const std::string head_dir = HeadDir(state.head_id);
  std::error_code error;
  fs::create_directories(head_dir, error);
  if (error) {
    return absl::InternalError(absl::StrCat("cannot create ", head_dir, ": ", error.message()));
  }
  RETURN_IF_ERROR(WriteAtomically(head_dir, state.state_id + kSuffix, bytes));
  std::vector<std::string> ids = StateIds(head_dir);
  for (size_t i = 0; i + keep_ < ids.size(); ++i) {
    fs::remove(absl::StrCat(head_dir, "/", ids[i], kSuffix), error);
  }
  return absl::OkStatus();
}

absl::StatusOr<core::HeadState> StateStore::Load(const std::string& head_id,
                                                 const std::string& state_id) const {
  if (!IsStateId(state_id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state_id: expected an id from SaveHeadState (20 digits, '-', 16 hex digits); got \"",
        state_id, "\""));
  }
  const std::string path = absl::StrCat(HeadDir(head_id), "/", state_id, kSuffix);
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<std::string> bytes = ReadFile(path);
  if (!bytes.ok()) {
    return absl::NotFoundError(absl::StrCat("state_id: expected a state of head \"", head_id,
                                            "\" kept in --state_dir; got \"", state_id,
                                            "\", which is not there (never saved, or deleted "
                                            "beyond --state_keep)"));
  }
  ASSIGN_OR_RETURN(core::HeadState state, core::DecodeHeadState(*bytes, path));
  if (state.head_id != head_id || state.state_id != state_id) {
    return absl::DataLossError(absl::StrCat(path, ": expected the state \"", state_id,
                                            "\" of head \"", head_id, "\"; got another"));
  }
  return state;
}

absl::StatusOr<std::vector<core::HeadState>> StateStore::LoadNewest() const {
  std::vector<core::HeadState> states;
  std::error_code error;
  for (const auto& head_dir : fs::directory_iterator(dir_, error)) {
    if (!head_dir.is_directory()) continue;
    const std::vector<std::string> ids = StateIds(head_dir.path().string());
    if (ids.empty()) continue;
    const std::string path = absl::StrCat(head_dir.path().string(), "/", ids.back(), kSuffix);
    ASSIGN_OR_RETURN(const std::string bytes, ReadFile(path));
    ASSIGN_OR_RETURN(core::HeadState state, core::DecodeHeadState(bytes, path));
    if (EscapeId(state.head_id) != head_dir.path().filename().string()) {
      return absl::DataLossError(
          absl::StrCat(path, ": expected a state of the head this directory is named after"));
    }
    states.push_back(std::move(state));
  }
  return states;
}

void StateStore::Remove(const std::string& head_id) {
  std::lock_guard<std::mutex> lock(mu_);
  std::error_code error;
  fs::remove_all(HeadDir(head_id), error);
}

}  // namespace remotehead::server
