// A head operation as the service runs it: on this process alone, on every rank of a head group,
// or on every replica of a mesh. Each operation that changes or reads a head on several ranks is
// a head command (translate/head_commands.h) appended to the group's log by the front, which
// proposes it; every rank applies its own part through ApplyHeadCommand (the front here, the
// other ranks through their GroupFollower), so the two paths are one. On a mesh, what changes the
// head is a command of the mesh's log: the leader takes it, every replica's front runs it on its
// own replica (MeshFollower), another front refuses it (NOT_THE_LEADER); the optimizer step is the
// mesh's (MeshSteps).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "replication/apply_head_command.h"
#include "replication/mesh_steps.h"
#include "service/head_operations.h"
#include "service/head_requests.h"
#include "service/sync_steps.h"
#include "translate/head_commands.h"

namespace remotehead::v1 {
class GroupCommand;
}

namespace remotehead::server {

class ReplicatedHeadOperations {
 public:
  // `local`: this process's part of every operation. `group` / `mesh`: as HeadOperations'
  // (nullptr: none). With a state store, an optimizer step saves the head's state every
  // `checkpoint_every_steps` versions. `mesh_wait`: how long a replica's front waits for its own
  // trainers once the leader's step came (MeshSteps).
  ReplicatedHeadOperations(HeadOperations* local, HeadGroup* group, HeadMesh* mesh,
                           int checkpoint_every_steps, std::chrono::milliseconds mesh_wait)
      : local_(local),
        group_(group),
        mesh_(mesh),
        checkpoint_every_steps_(checkpoint_every_steps),
        mesh_steps_(this, mesh, group, mesh_wait) {
    // The leader heals a replica admitted again (head_mesh.h) through this process's operations
    // (any front may come to lead).
    if (mesh_ != nullptr && mesh_->is_front()) {
      mesh_->set_healer([this](const MeshEpoch& admitted) { return HealReplica(admitted); });
    }
  }
  ~ReplicatedHeadOperations() {
    if (mesh_ != nullptr) mesh_->set_healer(nullptr);
  }
  ReplicatedHeadOperations(const ReplicatedHeadOperations&) = delete;
  ReplicatedHeadOperations& operator=(const ReplicatedHeadOperations&) = delete;

  HeadOperations& local() { return *local_; }
  // OK while the group or mesh this process is part of works; else UNAVAILABLE with its verdict
  // (HeadGroup::Serving): the answer to every operation that trains or changes a head.
  absl::Status Serving() const;
  MeshSteps& mesh_steps() { return mesh_steps_; }

  absl::StatusOr<HeadDescription> CreateFromSeed(const std::string& id, const core::HeadInit& init,
                                                 const HeadTraits& traits = {});
  absl::StatusOr<HeadDescription> CreateFromSafetensors(const std::string& id,
                                                        const SafetensorsSource& source,
                                                        const HeadTraits& traits = {});
  // HeadOperations::Upload on every rank (a replace's traits are checked before any rank is
  // asked).
  absl::StatusOr<HeadDescription> AddUploaded(const std::string& id, const torch::Tensor& weight,
                                              const torch::Tensor& bias, bool replace,
                                              const HeadTraits& traits = {});
  // The whole head (gathered from every rank of this replica) written to `path`
  // (HeadOperations::WriteCheckpoint); returns the bytes written.
  absl::StatusOr<int64_t> Save(const std::string& id, const std::string& path,
                               const std::string& weight_name, const std::string& bias_name);
  // This replica's weights (every replica's). dW: on a mesh, the mesh's — every replica's
  // summed, what its next step applies, with accumulated_micro_batches counting every
  // replica's — taken by the leader only (another front refuses it, NOT_THE_LEADER); elsewhere
  // this replica's.
  absl::StatusOr<HeadSnapshot> Snapshot(const std::string& id,
                                        std::optional<torch::ScalarType> dtype, bool gradients);
  // A front of a mesh: its replica's dW (gathered from its ranks, fp32) summed with every other
  // replica's on the leader (MeshGradientsCommand); the leader's is the sum.
  absl::StatusOr<HeadSnapshot> SumGradientsOnLeader(const std::string& id);
  // Tied embeddings, on every rank of this replica (its weights are every replica's; its dW its
  // own trainers' part, summed over the replicas at the mesh's step). `ids` are checked against
  // the head first (INVALID_ARGUMENT naming `ids_field`), the gradient's `rows` too
  // (`rows_field`), before any rank is asked.
  absl::StatusOr<HeadSnapshot> LookupEmbedding(const std::string& id, const torch::Tensor& ids,
                                               std::optional<torch::ScalarType> dtype,
                                               const std::string& ids_field);
  absl::StatusOr<EmbeddingGradientOutcome> AddEmbeddingGradient(
      const std::string& id, const torch::Tensor& ids, const torch::Tensor& rows,
      const GradientKey& key, std::optional<int64_t> expected_weight_version,
      const std::string& ids_field, const std::string& rows_field,
      const std::string& version_field);
  absl::Status Drop(const std::string& id);
  absl::StatusOr<HeadDescription> ZeroGradients(const std::string& id);
  absl::StatusOr<HeadDescription> OptimizerStep(const std::string& id,
                                                const OptimizerStepSpec& spec);
  // On a mesh: this replica's part of the mesh's step `attempt` of epoch `epoch`, on every rank
  // of the replica (replica_step.h: the sum over the replicas, the decision, the apply).
  absl::StatusOr<HeadDescription> ReduceStep(const std::string& id, const OptimizerStepSpec& spec,
                                             const std::string& attempt, int epoch);
  // An optimizer step agreed by this server's trainers (`first`: a synchronous step's first
  // rank; unset: one caller's): on a mesh, the mesh's step (every replica, dW summed over
  // them); then the head's state saved if one is due (SaveAfterStep).
  absl::StatusOr<HeadDescription> StepOptimizer(const std::string& id,
                                                const std::optional<SyncStepRequest>& first,
                                                const OptimizerStepSpec& spec);

  // Durable training state (head_states.cc): FAILED_PRECONDITION without a state store. On a
  // head group or a mesh every rank saves (restores) its own shard under one state id, chosen
  // here: a state is whole only where every rank has it (state_restore.h). A restore is checked
  // on every rank before any rank applies it, so a rank that lacks the file changes nothing.
  absl::StatusOr<HeadDescription> SaveState(const std::string& id);
  absl::StatusOr<HeadDescription> RestoreState(const std::string& id, const std::string& state_id);
  // After an optimizer step that brought head `id` to `version`: its state saved every
  // --checkpoint_every_steps versions. On a mesh only the leader saves (for every replica, in
  // the mesh's log); a failed save is logged, never the step's failure (the step happened: a
  // retrying client would step twice).
  void SaveAfterStep(const std::string& id, int64_t version);
  // A server on its own at shutdown: saves every head's state, each on its own; INTERNAL naming
  // every head not saved. Nothing on a head group or a mesh, whose drain saves them
  // (cluster_drain.h).
  absl::Status SaveAllStates();
  // A command that is no head operation (the drain's, cluster_drain.h) on every rank of every
  // replica, as RunOnEveryRank runs one: `here` is this process's part. The leader's (or a
  // group's front's); NOT_THE_LEADER on another front.
  absl::Status RunEverywhere(const v1::GroupCommand& command,
                             const std::function<absl::Status()>& here) {
    return RunOnEveryRank(command, here);
  }

  // Which ranks an operation runs on: every rank of every replica (what changes the head), or
  // every rank of this replica only (what reads it, this replica's part of a mesh's step).
  enum class Reach { kMesh, kReplica };
  // The proposer: `command` run on this process alone, or, on a group's front, logged for every
  // rank (a failed creation is undone on every rank, so that no rank keeps a head the others
  // lack); on a mesh with kMesh, on the leader, as a command of the mesh's log that every
  // replica runs so, and on another front NOT_THE_LEADER. This process's part is applied through
  // ApplyHeadCommand, exactly as every other rank applies the logged command; its result is
  // returned. A new replicated operation needs no method here: its handler proposes its
  // command (translate/head_commands.h), after the checks that refuse it before any rank is
  // asked.
  template <typename Command>
  absl::StatusOr<typename Command::Result> Propose(const Command& command, bool creates = false,
                                                   Reach reach = Reach::kMesh) {
    absl::StatusOr<typename Command::Result> result = absl::UnknownError("not run");
    const absl::Status status = RunOnEveryRank(
        Encode(command),
        [&]() -> absl::Status {
          absl::StatusOr<HeadCommandResult> applied = ApplyHeadCommand(*local_, command);
          if (!applied.ok()) return applied.status();
          result = std::get<typename Command::Result>(*std::move(applied));
          return absl::OkStatus();
        },
        creates, reach);
    if (!status.ok()) return status;
    return result;
  }

 private:
  // Runs `here` (this process's part of `command`) on this process alone or on every rank
  // `reach` names, as Propose describes.
  absl::Status RunOnEveryRank(const v1::GroupCommand& command,
                              const std::function<absl::Status()>& here, bool creates = false,
                              Reach reach = Reach::kMesh);
  absl::Status RunInReplica(const v1::GroupCommand& command,
                            const std::function<absl::Status()>& here, bool creates);
  // The leader's: the heal of the replica `admitted` admitted, a command of the new epoch's log
  // run on every rank of every serving replica (HeadOperations::Heal), while every call that
  // trains is answered MESH_RECONFIGURING (so not through RunOnEveryRank, which refuses then).
  absl::Status HealReplica(const MeshEpoch& admitted);
  // After `command` ran on `lane`'s group with `status`: a creation that failed for a reason of
  // its own (not the transport's) undone on every rank (`undo_here`: this process's part of the
  // undo command, given the undo); returns `status`, or the undo's failure.
  absl::Status UndoFailedCreate(
      HeadGroup::Lane& lane, const v1::GroupCommand& command, bool creates,
      const absl::Status& status,
      const std::function<absl::Status(const head_command::UndoCreate& undo)>& undo_here);

  HeadOperations* const local_;
  HeadGroup* const group_;
  HeadMesh* const mesh_;
  const int checkpoint_every_steps_;
  MeshSteps mesh_steps_;  // a mesh's optimizer steps (unused off a mesh)
};

}  // namespace remotehead::server
