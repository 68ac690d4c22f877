#include "remotehead/server/service/state_store.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

namespace fs = std::filesystem;
using core::DirEntry;
constexpr char kSuffix[] = ".safetensors";
constexpr size_t kMaxFileName = 255;  // NAME_MAX of Linux file systems

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

std::string StateFile(const std::string& head_dir, const std::string& state_id) {
  return absl::StrCat(head_dir, "/", state_id, kSuffix);
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& dir, int keep,
                                                             core::StateSecret secret) {
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state_keep: expected >= 1 states per head; got ", keep));
  }
  std::error_code error;
  fs::create_directories(dir, error);
  auto root = core::CheckpointDir::Open(dir);
  if (error || !root.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--state_dir: expected a directory the server can create and write; got \"", dir, "\"",
        error ? absl::StrCat(" (", error.message(), ")")
              : absl::StrCat(" (", root.status().message(), ")")));
  }
  std::unique_ptr<StateStore> store(new StateStore(dir, keep, std::move(secret), *std::move(root)));
  // Saves interrupted by a crash left their temporary files (each a whole head): gone now.
  ASSIGN_OR_RETURN(const std::vector<DirEntry> heads, store->root_->List("", "--state_dir"));
  for (const DirEntry& head : heads) {
    if (head.kind != DirEntry::Kind::kDirectory) continue;
    const absl::StatusOr<int> removed =
        store->root_->RemoveTemporaryFiles(head.name, "--state_dir");
    if (removed.ok()) store->removed_temporary_files_ += *removed;
  }
  return store;
}

std::string StateStore::NewStateId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  return absl::StrFormat("%020d-%016x", now, rng());
}

absl::Status StateStore::CheckHeadId(const std::string& head_id, const std::string& field) {
  const size_t escaped = EscapeId(head_id).size();
  if (escaped <= kMaxFileName) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": expected an id whose states can be saved in --state_dir: at most ", kMaxFileName,
      " bytes once escaped for a file name (letters, digits, '_' and '-' count 1 byte, any "
      "other byte 3); got ",
      head_id.size(), " bytes that escape to ", escaped));
}

absl::StatusOr<std::vector<std::string>> StateStore::StateIds(const std::string& head_dir) const {
  ASSIGN_OR_RETURN(const std::vector<DirEntry> entries, root_->List(head_dir, "--state_dir"));
  std::vector<std::string> ids;
  for (const DirEntry& file : entries) {
    // Temporary files of a save in progress (or a crashed one) are not states. A state that
    // is not a regular file is listed: reading it refuses it, naming it.
    if (!absl::EndsWith(file.name, kSuffix)) continue;
    const std::string id = file.name.substr(0, file.name.size() - std::strlen(kSuffix));
    if (IsStateId(id)) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());  // the ids begin with their creation time
  return ids;
}

absl::StatusOr<core::HeadState> StateStore::Read(const std::string& relative,
                                                 const std::string& field,
                                                 const std::string& source) const {
  // Never through a link, never a FIFO or a device (checked before it is opened), never blocking.
  ASSIGN_OR_RETURN(const core::CheckpointFile file, root_->OpenForRead(relative, field));
  std::string bytes(static_cast<size_t>(file.size()), '\0');
  RETURN_IF_ERROR(file.ReadAt(0, bytes.size(), bytes.data()));
  return core::DecodeHeadState(bytes, source, secret_);
}

absl::Status StateStore::Save(const core::HeadState& state) {
  RETURN_IF_ERROR(CheckHeadId(state.head_id, "head_id"));
  ASSIGN_OR_RETURN(const std::string bytes, core::EncodeHeadState(state, secret_));
  std::lock_guard<std::mutex> lock(mu_);
  const std::string head_dir = EscapeId(state.head_id);
  RETURN_IF_ERROR(root_->MakeDirectory(head_dir, "head state"));
  // Atomically, by the one writer of files that must survive a crash (core::CheckpointDir):
  // a crash during a save leaves the previous states intact.
  RETURN_IF_ERROR(
      root_
          ->WriteAtomically(
              StateFile(head_dir, state.state_id), "head state",
              [](const core::CheckpointFile&) { return absl::OkStatus(); },
              [&](core::CheckpointFile& out) { return out.Write(bytes.data(), bytes.size()); })
          .status());
  ASSIGN_OR_RETURN(const std::vector<std::string> ids, StateIds(head_dir));
  for (size_t i = 0; i + keep_ < ids.size(); ++i) {
    root_->Remove(StateFile(head_dir, ids[i]), "head state").IgnoreError();
  }
  return absl::OkStatus();
}

absl::Status StateStore::CheckStateId(const std::string& state_id) {
  if (IsStateId(state_id)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "state_id: expected an id from SaveHeadState (20 digits, '-', 16 hex digits); got \"",
      state_id, "\""));
}

absl::StatusOr<core::HeadState> StateStore::Load(const std::string& head_id,
                                                 const std::string& state_id) const {
  RETURN_IF_ERROR(CheckStateId(state_id));
  // No lock: saves publish whole files by rename and a pruned file stays readable while open.
  // A client's request: files are named relative to the directory, never by the server's path.
  const std::string relative = StateFile(EscapeId(head_id), state_id);
  absl::StatusOr<core::HeadState> state =
      Read(relative, "state_id", absl::StrCat("--state_dir file \"", relative, "\""));
  if (absl::IsNotFound(state.status())) {
    return absl::NotFoundError(absl::StrCat("state_id: expected a state of head \"", head_id,
                                            "\" kept in --state_dir; got \"", state_id,
                                            "\", which is not there (never saved, or deleted "
                                            "beyond --state_keep)"));
  }
  if (!state.ok()) return state.status();
  if (state->head_id != head_id || state->state_id != state_id) {
    return absl::DataLossError(absl::StrCat("state_id: expected the state \"", state_id,
                                            "\" of head \"", head_id, "\"; got another"));
  }
  return state;
}

absl::StatusOr<std::map<std::string, std::vector<std::string>>> StateStore::Listing() const {
  std::map<std::string, std::vector<std::string>> listing;
  ASSIGN_OR_RETURN(const std::vector<DirEntry> heads, root_->List("", "--state_dir"));
  for (const DirEntry& head_dir : heads) {
    if (head_dir.kind == DirEntry::Kind::kLink) {
      return absl::PermissionDeniedError(absl::StrCat(
          "--state_dir: \"", head_dir.name,
          "\" is a symbolic link; links in the state directory are never followed (a head's "
          "states must be files in it)"));
    }
    if (head_dir.kind != DirEntry::Kind::kDirectory) continue;  // not a head's
    ASSIGN_OR_RETURN(std::vector<std::string> ids, StateIds(head_dir.name));
    if (!ids.empty()) listing[head_dir.name] = std::move(ids);
  }
  return listing;
}

absl::StatusOr<core::HeadState> StateStore::LoadAtStart(const std::string& head_dir,
                                                        const std::string& state_id) const {
  // The operator's start: the file by its whole path.
  const std::string relative = StateFile(head_dir, state_id);
  ASSIGN_OR_RETURN(core::HeadState state,
                   Read(relative, "--state_dir", absl::StrCat(dir_, "/", relative)));
  if (EscapeId(state.head_id) != head_dir || state.state_id != state_id) {
    return absl::DataLossError(absl::StrCat("--state_dir: \"", relative,
                                            "\": expected the state this file is named after, "
                                            "of the head its directory is named after"));
  }
  return state;
}

void StateStore::Remove(const std::string& head_id) {
  std::lock_guard<std::mutex> lock(mu_);
  root_->RemoveDirectory(EscapeId(head_id), "head state").IgnoreError();
}

}  // namespace remotehead::server
