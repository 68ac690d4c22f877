// The durable training state of the heads (--state_dir): HeadOperations' saves and restores, on
// this process or on every rank of a head group or mesh (head_operations.h).
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "group/group_commands.h"
#include "head_operations.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {

void HeadOperations::SaveAfterStep(const std::string& id, int64_t version) {
  if (state_store_ == nullptr || checkpoint_every_steps_ <= 0 ||
      version % checkpoint_every_steps_ != 0) {
    return;
  }
  if (mesh_ != nullptr && !mesh_->is_leader()) return;  // the leader saves every replica's
  if (const auto saved = SaveState(id); !saved.ok()) {
    LogEvent(absl::StrCat("head state NOT saved: \"", id, "\": ", saved.status().ToString()));
  }
}

absl::StatusOr<StateStore*> HeadOperations::Store() const {
  if (state_store_ == nullptr) {
    return absl::FailedPreconditionError(
        "head state: expected a server started with --state_dir; got none");
  }
  return state_store_;
}

int64_t HeadOperations::OwnOffset(const HeadDescription& d) const {
  return group_ != nullptr ? d.shards.at(static_cast<size_t>(group_->rank())).offset : 0;
}

absl::StatusOr<HeadDescription> HeadOperations::SaveState(const std::string& id) {
  RETURN_IF_ERROR(Store().status());
  RETURN_IF_ERROR(registry_->Get(id).status());
  const std::string state_id = StateStore::NewStateId();
  return OnEveryRank<HeadDescription>(SaveStateCommand(id, state_id),
                                      [&] { return SaveStateHere(id, state_id); });
}

absl::StatusOr<HeadDescription> HeadOperations::SaveStateHere(const std::string& id,
                                                              const std::string& state_id) {
  ASSIGN_OR_RETURN(StateStore* const store, Store());
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  core::HeadState state = entry->CaptureState(state_id);
  const HeadDescription d = entry->Describe();
  // Which rows of which head this is: a restore at start checks them against its own.
  state.vocab_size = d.vocab_size;
  state.vocab_offset = OwnOffset(d);
  RETURN_IF_ERROR(store->Save(state));
  LogEvent(absl::StrCat("head state saved: \"", id, "\" version ", state.weight_version, " as ",
                        state.state_id));
  return d;
}

absl::StatusOr<HeadDescription> HeadOperations::RestoreState(const std::string& id,
                                                             const std::string& state_id) {
  RETURN_IF_ERROR(Store().status());
  RETURN_IF_ERROR(StateStore::CheckStateId(state_id));
  RETURN_IF_ERROR(registry_->Get(id).status());
  if (group_ != nullptr || mesh_ != nullptr) {
    RETURN_IF_ERROR(RunOnEveryRank(RestoreStateCommand(id, state_id, /*check_only=*/true), [&] {
      return RestoreStateHere(id, state_id, /*check_only=*/true).status();
    }));
  }
  return OnEveryRank<HeadDescription>(RestoreStateCommand(id, state_id, /*check_only=*/false),
                                      [&] { return RestoreStateHere(id, state_id, false); });
}

absl::StatusOr<HeadDescription> HeadOperations::RestoreStateHere(const std::string& id,
                                                                 const std::string& state_id,
                                                                 bool check_only) {
  ASSIGN_OR_RETURN(StateStore* const store, Store());
  ASSIGN_OR_RETURN(auto entry, registry_->Get(id));
  ASSIGN_OR_RETURN(const core::HeadState state, store->Load(id, state_id));
  const HeadDescription before = entry->Describe();
  RETURN_IF_ERROR(core::CheckHeadStateRows(state, before.vocab_size, OwnOffset(before)));
  if (check_only) {
    RETURN_IF_ERROR(
        entry->Read([&](const core::Head& head) { return core::CheckHeadStateFits(state, head); }));
    return before;
  }
  RETURN_IF_ERROR(entry->RestoreState(
      state, /*at_start=*/false,
      ResizeOf(*entry, absl::StrCat("the optimizer state of head \"", id, "\" in ", state_id))));
  const HeadDescription d = entry->Describe();
  LogEvent(absl::StrCat("head state restored: ", Summary(d), " from ", state_id));
  return d;
}

absl::Status HeadOperations::SaveAllStates() {
  if (state_store_ == nullptr) return absl::OkStatus();
  if (group_ != nullptr || mesh_ != nullptr) {
    LogEvent(
        "head states not saved at shutdown: a head group's are saved at its steps "
        "(--checkpoint_every_steps) and on request");
    return absl::OkStatus();
  }
  // Each head on its own: one that cannot be saved never keeps the others from being saved.
  const auto entries = registry_->List();
  std::vector<std::string> failed;
  for (const auto& entry : entries) {
    if (const auto saved = SaveState(entry->id()); !saved.ok()) {
      LogEvent(
          absl::StrCat("head state NOT saved: \"", entry->id(), "\": ", saved.status().ToString()));
      failed.push_back(absl::StrCat("\"", entry->id(), "\" (", saved.status().message(), ")"));
    }
  }
  if (failed.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(failed.size(), " of ", entries.size(),
                                          " head states not saved: ", absl::StrJoin(failed, "; ")));
}
}  // namespace remotehead::server
