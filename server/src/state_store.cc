#include "remotehead/server/state_store.h"

#include <algorithm>
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
#include "remotehead/core/checkpoint_dir.h"
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
  // Atomically, by the one writer of files that must survive a crash (core::CheckpointDir):
  // a crash during a save leaves the previous states intact.
  ASSIGN_OR_RETURN(const std::shared_ptr<const core::CheckpointDir> dir,
                   core::CheckpointDir::Open(head_dir));
  RETURN_IF_ERROR(
      dir->WriteAtomically(
             state.state_id + kSuffix, "state_id",
             [](const core::CheckpointFile&) { return absl::OkStatus(); },
             [&](core::CheckpointFile& out) { return out.Write(bytes.data(), bytes.size()); })
          .status());
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
