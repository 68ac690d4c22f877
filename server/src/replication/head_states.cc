// The training state of the heads on every rank of a head group or mesh
// (replicated_head_operations.h): durable (--state_dir) — one state id for every rank's shard, a
// restore checked everywhere before it is applied anywhere, saves after steps and at shutdown —
// and sent to a mesh replica admitted again (the heal). Each rank's own part is HeadOperations'
// (head_state_operations.cc; service/replica_heal.cc).
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/status_macros.h"
#include "replication/apply_head_command.h"
#include "replication/replicated_head_operations.h"
#include "translate/group_commands.h"
#include "translate/head_commands.h"

namespace remotehead::server {

void ReplicatedHeadOperations::SaveAfterStep(const std::string& id, int64_t version) {
  if (!local_->Store().ok() || checkpoint_every_steps_ <= 0 ||
      version % checkpoint_every_steps_ != 0) {
    return;
  }
  const Placement& placement = local_->placement();
  // On a mesh the leader saves every replica's.
  if (placement.replicated() && !placement.leads_cluster()) return;
  if (const auto saved = SaveState(id); !saved.ok()) {
    local_->LogEvent(
        absl::StrCat("head state NOT saved: \"", id, "\": ", saved.status().ToString()));
  }
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::SaveState(const std::string& id) {
  RETURN_IF_ERROR(local_->Store().status());
  RETURN_IF_ERROR(local_->Describe(id).status());
  const std::string state_id = StateStore::NewStateId();
  return Propose(head_command::SaveState{.id = id, .state_id = state_id});
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::RestoreState(
    const std::string& id, const std::string& state_id) {
  RETURN_IF_ERROR(local_->Store().status());
  RETURN_IF_ERROR(StateStore::CheckStateId(state_id));
  RETURN_IF_ERROR(local_->Describe(id).status());
  if (local_->placement().in_cluster()) {
    RETURN_IF_ERROR(
        Propose(head_command::RestoreState{.id = id, .state_id = state_id, .check_only = true})
            .status());
  }
  return Propose(head_command::RestoreState{.id = id, .state_id = state_id});
}

absl::Status ReplicatedHeadOperations::HealReplica(const MeshEpoch& admitted) {
  const head_command::Heal heal{.epoch = admitted.number, .replica = admitted.admitted};
  const v1::GroupCommand command = Encode(heal);
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, mesh_->fronts()->Enter());
  RETURN_IF_ERROR(RunCommand(lane, command, [&] {
    return RunInReplica(
        command, [&] { return ApplyHeadCommand(*local_, heal).status(); }, /*creates=*/false);
  }));
  if (!local_->Store().ok()) return absl::OkStatus();
  // With --state_dir, a new state of every head on every member, the admitted replica's
  // included: a restart of the whole mesh finds one state that all of them hold.
  for (const HeadDescription& head : local_->List()) {
    const head_command::SaveState save{.id = head.id, .state_id = StateStore::NewStateId()};
    const v1::GroupCommand saving = Encode(save);
    if (const absl::Status saved = RunCommand(
            lane, saving,
            [&] {
              return RunInReplica(
                  saving, [&] { return ApplyHeadCommand(*local_, save).status(); }, false);
            });
        !saved.ok()) {
      local_->LogEvent(absl::StrCat("head state NOT saved after the heal: \"", head.id,
                                    "\": ", saved.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status ReplicatedHeadOperations::SaveAllStates() {
  if (!local_->Store().ok()) return absl::OkStatus();
  if (local_->placement().in_cluster()) return absl::OkStatus();  // the drain's to save
  // Each head on its own: one that cannot be saved never keeps the others from being saved.
  const std::vector<HeadDescription> heads = local_->List();
  std::vector<std::string> failed;
  for (const HeadDescription& head : heads) {
    if (const auto saved = SaveState(head.id); !saved.ok()) {
      local_->LogEvent(
          absl::StrCat("head state NOT saved: \"", head.id, "\": ", saved.status().ToString()));
      failed.push_back(absl::StrCat("\"", head.id, "\" (", saved.status().message(), ")"));
    }
  }
  if (failed.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(failed.size(), " of ", heads.size(),
                                          " head states not saved: ", absl::StrJoin(failed, "; ")));
}

}  // namespace remotehead::server
