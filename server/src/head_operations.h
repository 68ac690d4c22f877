// The head operations of the service, free of gRPC and protobuf: create a head (from a seed, a
// safetensors file on the server, or uploaded tensors), save it, snapshot its weights or
// gradients, describe, list, drop, zero its gradients, step its optimizer — each with its one
// lifecycle log line. The RPC handlers (head_service.cc, stream_reactors.cc) translate
// protobuf ⇄ these types and statuses, and nothing else.
//
// On a head group (group/head_group.h) the same calls on the front run on every rank: each
// operation is a group command (built in group/group_commands.cc, the one home of their
// encoding) whose local part — the "…Here" methods, shard-aware — every rank runs on its own
// rows; the other ranks reach them through the group's follower (group/group_follower.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "head_requests.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/head.h"
#include "remotehead/core/optimizer.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/admission.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/head_registry.h"
#include "remotehead/server/state_store.h"

namespace remotehead::server {

class HeadOperations {
 public:
  // New heads live on `device` and hold their bytes in `admission`'s budget (reserved before
  // they are allocated, released when they are dropped); `event_log` (nullptr: silent) gets one
  // line per lifecycle event; files are read and written in `checkpoint_dir` only (nullptr:
  // file operations are FAILED_PRECONDITION). With `state_store`, OptimizerStep saves a head's
  // state every `checkpoint_every_steps` versions and DropHead deletes its states.
  // With `group`, this process is one rank of a head group: its heads hold its rows, and on
  // the front every operation runs on every rank. With `mesh`, the group (or this server) is
  // one replica of a mesh (head_mesh.h): on the leader every operation that changes the head
  // runs on every replica, another front refuses them (NOT_THE_LEADER), and the optimizer step
  // is the mesh's (MeshSteps, which calls ReduceStep on every replica).
  HeadOperations(HeadRegistry* registry, AdmissionController* admission, torch::Device device,
                 std::ostream* event_log, std::shared_ptr<const core::CheckpointDir> checkpoint_dir,
                 StateStore* state_store = nullptr, int checkpoint_every_steps = 0,
                 HeadGroup* group = nullptr, HeadMesh* mesh = nullptr)
      : registry_(registry),
        admission_(admission),
        device_(device),
        event_log_(event_log),
        checkpoint_dir_(std::move(checkpoint_dir)),
        state_store_(state_store),
        checkpoint_every_steps_(checkpoint_every_steps),
        group_(group),
        mesh_(mesh) {}

  // `frozen` (every creation): the head refuses dW and optimizer steps (HeadEntry), on every
  // rank of a group or mesh alike.
  absl::StatusOr<HeadDescription> CreateFromSeed(const std::string& id, const core::HeadInit& init,
                                                 bool frozen = false);
  absl::StatusOr<HeadDescription> CreateFromSafetensors(const std::string& id,
                                                        const SafetensorsSource& source,
                                                        bool frozen = false);
  // A head made of uploaded W [V, D] (and b [V]); with `replace`, new weights for the existing
  // head `id` (HeadEntry::ReplaceWeights; INVALID_ARGUMENT naming header.frozen unless `frozen`
  // is the head's), or a new head if there is none.
  absl::StatusOr<HeadDescription> AddUploaded(const std::string& id, const torch::Tensor& weight,
                                              const torch::Tensor& bias, bool replace,
                                              bool frozen = false);
  // A replace of head `id` (with `frozen`) keeps the head's frozen flag: INVALID_ARGUMENT
  // naming header.frozen otherwise (OK when there is no such head: the upload creates it).
  absl::Status CheckReplaceKeepsFrozen(const std::string& id, bool frozen) const;
  // Reserves the bytes of the heads already in the registry that hold none (those loaded or
  // restored at start, optimizer state included); RESOURCE_EXHAUSTED if they do not fit.
  absl::Status ReserveLoadedHeads();
  // Writes the weights (and bias) to a safetensors file `path` (relative to the checkpoint
  // directory; written atomically, replacing only a checkpoint remotehead wrote) under the given
  // tensor names (empty: lm_head.weight / lm_head.bias); returns the bytes written.
  absl::StatusOr<int64_t> Save(const std::string& id, const std::string& path,
                               const std::string& weight_name, const std::string& bias_name);
  // The weights (or, with `gradients`, dW / db) in `dtype` (unset: as stored).
  // INVALID_ARGUMENT naming `field` for an id this server could not keep (with --state_dir:
  // one whose states could not be saved), before anything is allocated for it.
  absl::Status CheckNewHeadId(const std::string& id, const std::string& field) const;
  absl::StatusOr<HeadSnapshot> Snapshot(const std::string& id,
                                        std::optional<torch::ScalarType> dtype, bool gradients);
  absl::StatusOr<HeadDescription> Describe(const std::string& id) const;
  std::vector<HeadDescription> List() const;
  absl::Status Drop(const std::string& id);
  absl::StatusOr<HeadDescription> ZeroGradients(const std::string& id);
  absl::StatusOr<HeadDescription> OptimizerStep(const std::string& id,
                                                const OptimizerStepSpec& spec);
  // On a mesh: this replica's part of the mesh's step, on every rank of the replica: dW summed
  // over the replicas (HeadMesh::SumOverReplicas), then the step.
  absl::StatusOr<HeadDescription> ReduceStep(const std::string& id, const OptimizerStepSpec& spec);
  // Durable training state: FAILED_PRECONDITION without a state store. On a head group or a
  // mesh every rank saves (restores) its own shard under one state id, chosen here: a state is
  // whole only where every rank has it (state_restore.h). A restore is checked on every rank
  // before any rank applies it, so a rank that lacks the file changes nothing anywhere.
  absl::StatusOr<HeadDescription> SaveState(const std::string& id);
  absl::StatusOr<HeadDescription> RestoreState(const std::string& id, const std::string& state_id);
  // After an optimizer step that brought head `id` to `version`: its state saved every
  // --checkpoint_every_steps versions. On a mesh only the leader saves (for every replica, in
  // the mesh's log); a failed save is logged, never the step's failure (the step happened: a
  // retrying client would step twice).
  void SaveAfterStep(const std::string& id, int64_t version);
  // At shutdown: saves every head's state, each on its own; INTERNAL naming every head not
  // saved. Nothing on a head group or a mesh: its ranks stop each on its own signal, so no
  // state could be saved by all of them (theirs are saved at steps and on request).
  absl::Status SaveAllStates();

  // The local parts of the operations: what every rank of a head group runs on its own rows
  // (the front within the operations above; the other ranks for the commands of the group's
  // log, group/group_follower.h).
  absl::StatusOr<HeadDescription> CreateFromSeedHere(const std::string& id,
                                                     const core::HeadInit& init, bool frozen);
  absl::StatusOr<HeadDescription> CreateFromSafetensorsHere(const std::string& id,
                                                            const SafetensorsSource& source,
                                                            bool frozen);
  // `weight` / `bias`: the whole head's, on the front; on the other ranks tensors of the same
  // shape that the front's values are shared into.
  absl::StatusOr<HeadDescription> UploadHere(const std::string& id, torch::Tensor weight,
                                             torch::Tensor bias, bool replace, bool frozen);
  absl::StatusOr<HeadSnapshot> SnapshotHere(const std::string& id,
                                            std::optional<torch::ScalarType> dtype, bool gradients);
  absl::Status DropHere(const std::string& id);
  absl::Status UndoCreateHere(const std::string& id);  // drops it if this rank has it
  absl::StatusOr<HeadDescription> ZeroGradientsHere(const std::string& id);
  absl::StatusOr<HeadDescription> OptimizerStepHere(const std::string& id,
                                                    const OptimizerStepSpec& spec) {
    return StepHere(id, spec, /*over_replicas=*/false);
  }
  absl::StatusOr<HeadDescription> ReduceStepHere(const std::string& id,
                                                 const OptimizerStepSpec& spec) {
    return StepHere(id, spec, /*over_replicas=*/true);
  }
  // This rank's shard of head `id` saved as `state_id`; restored from it (with `check_only`,
  // only loaded and checked against the head).
  absl::StatusOr<HeadDescription> SaveStateHere(const std::string& id, const std::string& state_id);
  absl::StatusOr<HeadDescription> RestoreStateHere(const std::string& id,
                                                   const std::string& state_id, bool check_only);

 private:
  // This rank's rows of a head of `vocab_size` rows, and every rank's (empty off a group).
  struct Rows {
    int64_t offset = 0;
    int64_t rows = 0;
    std::vector<core::ShardRange> shards;
  };
  absl::StatusOr<Rows> RowsOf(int64_t vocab_size, const std::string& field) const;
  // Which ranks an operation runs on: every rank of every replica (what changes the head), or
  // every rank of this replica only (what reads it, this replica's part of a mesh's step).
  enum class Reach { kMesh, kReplica };
  // Runs `here` on this process alone, or, on a group's front, as `command` on every rank (a
  // failed creation is undone on every rank, so that no rank keeps a head the others lack),
  // and returns what `here` returned on this process. On a mesh with kMesh: on the leader, as
  // a command of the mesh's log that every replica runs so; on another front, NOT_THE_LEADER.
  template <typename T>
  absl::StatusOr<T> OnEveryRank(const v1::GroupCommand& command,
                                const std::function<absl::StatusOr<T>()>& here,
                                bool creates = false, Reach reach = Reach::kMesh) {
    absl::StatusOr<T> result = absl::UnknownError("not run");
    const absl::Status status = RunOnEveryRank(
        command,
        [&] {
          result = here();
          return result.status();
        },
        creates, reach);
    if (!status.ok()) return status;
    return result;
  }
  absl::Status RunOnEveryRank(const v1::GroupCommand& command,
                              const std::function<absl::Status()>& here, bool creates = false,
                              Reach reach = Reach::kMesh);
  absl::Status RunInReplica(const v1::GroupCommand& command,
                            const std::function<absl::Status()>& here, bool creates);
  // The optimizer step on this rank's rows; `over_replicas`: dW summed over a mesh's replicas
  // first (this replica's own dW is what stays accumulated if the step does not zero it).
  absl::StatusOr<HeadDescription> StepHere(const std::string& id, const OptimizerStepSpec& spec,
                                           bool over_replicas);
  // dW (and db) summed over the mesh's replicas, in place; returns this replica's own when
  // `keep_own` (a step that does not zero dW puts them back after it).
  absl::StatusOr<core::GradientBuffers> SumGradientsOverReplicas(core::Head& head, bool keep_own);
  // On a group: the front's uploaded W (and b) shared into every rank's `weight` / `bias`,
  // which are then narrowed to this rank's rows.
  absl::StatusOr<Rows> ShareUploadedRows(torch::Tensor* weight, torch::Tensor* bias);
  // `group`'s front's W (and b), on this device, written into every member's `weight` / `bias`
  // (a group's ranks; a mesh's replica fronts).
  absl::Status ShareUploaded(HeadGroup& group, torch::Tensor* weight, torch::Tensor* bias);

  void LogEvent(const std::string& line) const;
  // A head in a log line: id, shape, dtype, device, version (and "frozen").
  static std::string Summary(const HeadDescription& d);
  // Reserves the bytes of head `id` of this shape (core::HeadMemoryBytes) before it is
  // allocated; returns the admission ticket. INVALID_ARGUMENT (sizes, named with
  // `field_prefix`) or RESOURCE_EXHAUSTED (budget).
  absl::StatusOr<uint64_t> ReserveHead(const std::string& id, int64_t vocab_size,
                                       int64_t hidden_size, torch::ScalarType dtype, bool bias,
                                       const std::string& field_prefix);
  // Grows or shrinks `entry`'s reservation with its optimizer state (`why` names the state in
  // a refusal). Heads registered without a reservation are not counted.
  HeadEntry::ResizeState ResizeOf(const HeadEntry& entry, const std::string& why);
  // Registers `head` under `id` holding `ticket`; releases the ticket if that fails.
  absl::StatusOr<std::shared_ptr<HeadEntry>> AddReserved(
      const std::string& id, absl::StatusOr<std::unique_ptr<core::Head>> head, uint64_t ticket,
      std::vector<core::ShardRange> shards, bool frozen);

  absl::StatusOr<StateStore*> Store() const;
  // The first row of this rank's shard of a head described as `d` (0 off a group).
  int64_t OwnOffset(const HeadDescription& d) const;
  // The checkpoint directory, or FAILED_PRECONDITION naming `field` when there is none.
  absl::StatusOr<const core::CheckpointDir*> CheckpointDirFor(const std::string& field) const;

  HeadRegistry* registry_;
  AdmissionController* admission_;
  const torch::Device device_;
  std::ostream* event_log_;
  const std::shared_ptr<const core::CheckpointDir> checkpoint_dir_;
  StateStore* state_store_;
  const int checkpoint_every_steps_;
  HeadGroup* const group_;
  HeadMesh* const mesh_;
};

}  // namespace remotehead::server
