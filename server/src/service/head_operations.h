// The head operations of this process, free of gRPC and protobuf: create a head (from a seed, a
// safetensors file on the server, or uploaded tensors), snapshot its weights or gradients,
// describe, list, drop, zero its gradients, step its optimizer, save and restore its state —
// each with its one lifecycle log line.
//
// On a head group (group/head_group.h) each is this rank's part, shard-aware: it runs on this
// rank's rows, and the collectives it needs (the front's uploaded weights shared, a snapshot's
// rows gathered, dW summed over a mesh's replicas) happen inside it, in the same order on every
// rank. Running an operation on every rank and replica is replication/'s
// (ReplicatedHeadOperations, whose commands reach the other ranks' GroupFollower).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/checkpoint_dir.h"
#include "remotehead/core/head.h"
#include "remotehead/core/optimizer.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/head_mesh.h"
#include "remotehead/server/group/placement.h"
#include "remotehead/server/service/admission.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/server/service/state_store.h"
#include "service/head_requests.h"

namespace remotehead::server {

// What an optimizer step runs around its apply, under the head's lock, once the step's own
// checks passed (the version it expects, the optimizer's arguments). A mesh replica's step gets
// its sum over the replicas, its commit decision and its weight checksums this way
// (replication/replica_step.h), so this layer never asks whether there are replicas.
struct StepAround {
  // Before the apply: makes dW what the apply uses; returns what dW is set back to after the
  // apply (undefined tensors: dW left as the apply left it). A failure applies nothing.
  std::function<absl::StatusOr<core::GradientBuffers>(core::Head& head)> before;
  // After the apply, the head at its new version; a failure is the step's answer.
  std::function<absl::Status(const core::Head& head)> after;
};

class HeadOperations {
 public:
  // New heads live on `device` and hold their bytes in `admission`'s budget (reserved before
  // they are allocated, released when they are dropped); `event_log` (nullptr: silent) gets one
  // line per lifecycle event; files are read and written in `checkpoint_dir` only (nullptr:
  // file operations are FAILED_PRECONDITION). With `state_store`, heads' states can be saved
  // and restored, and DropHead deletes them. With `group`, this process is one rank of a head
  // group and its heads hold its rows; with `mesh`, one replica's rank of a mesh (head_mesh.h).
  HeadOperations(HeadRegistry* registry, AdmissionController* admission, torch::Device device,
                 std::ostream* event_log, std::shared_ptr<const core::CheckpointDir> checkpoint_dir,
                 StateStore* state_store = nullptr, HeadGroup* group = nullptr,
                 HeadMesh* mesh = nullptr)
      : registry_(registry),
        admission_(admission),
        device_(device),
        event_log_(event_log),
        checkpoint_dir_(std::move(checkpoint_dir)),
        state_store_(state_store),
        placement_(group, mesh) {}

  // `traits` (every creation): frozen (the head refuses dW and optimizer steps, HeadEntry) and
  // the dW accumulators' dtype.
  absl::StatusOr<HeadDescription> CreateFromSeed(const std::string& id, const core::HeadInit& init,
                                                 const HeadTraits& traits);
  absl::StatusOr<HeadDescription> CreateFromSafetensors(const std::string& id,
                                                        const SafetensorsSource& source,
                                                        const HeadTraits& traits);
  // A head made of uploaded W [V, D] (and b [V]); with `replace`, new weights for the existing
  // head `id` (HeadEntry::ReplaceWeights; INVALID_ARGUMENT naming header.frozen /
  // header.grad_dtype unless `traits` are the head's), or a new head if there is none. `weight` /
  // `bias`: the whole head's, on the front; on the other ranks tensors of the same shape that the
  // front's values are shared into.
  absl::StatusOr<HeadDescription> Upload(const std::string& id, torch::Tensor weight,
                                         torch::Tensor bias, bool replace,
                                         const HeadTraits& traits);
  // A replace of head `id` (with `traits`) keeps the head's frozen flag and gradient dtype (an
  // unset one is the head's): INVALID_ARGUMENT naming header.frozen / header.grad_dtype
  // otherwise (OK when there is no such head: the upload creates it).
  absl::Status CheckReplaceKeepsTraits(const std::string& id, const HeadTraits& traits) const;
  // Reserves the bytes of the heads already in the registry that hold none (those loaded or
  // restored at start, optimizer state included); RESOURCE_EXHAUSTED if they do not fit.
  absl::Status ReserveLoadedHeads();
  // INVALID_ARGUMENT naming `field` for an id this server could not keep (with --state_dir:
  // one whose states could not be saved), before anything is allocated for it.
  absl::Status CheckNewHeadId(const std::string& id, const std::string& field) const;
  // The weights (or, with `gradients`, dW / db) in `dtype` (unset: as stored): on a group the
  // whole head on the front (its rows gathered from every rank), nothing on the other ranks.
  absl::StatusOr<HeadSnapshot> Snapshot(const std::string& id,
                                        std::optional<torch::ScalarType> dtype, bool gradients);
  // Writes `snapshot` (a whole head's weights) to a safetensors file `path` (relative to the
  // checkpoint directory; written atomically, replacing only a checkpoint remotehead wrote)
  // under the given tensor names (empty: lm_head.weight / lm_head.bias); returns the bytes
  // written.
  absl::StatusOr<int64_t> WriteCheckpoint(const std::string& id, const HeadSnapshot& snapshot,
                                          const std::string& path, const std::string& weight_name,
                                          const std::string& bias_name);
  // FAILED_PRECONDITION without a checkpoint directory, INVALID_ARGUMENT for a `path` that is not
  // a relative path inside it (core::CheckpointDir::CheckRelative); both name `path`.
  absl::Status CheckCheckpointPath(const std::string& path) const;
  absl::StatusOr<HeadDescription> Describe(const std::string& id) const;
  std::vector<HeadDescription> List() const;
  absl::Status Drop(const std::string& id);
  absl::Status UndoCreate(const std::string& id);  // drops it if this rank has it
  absl::StatusOr<HeadDescription> ZeroGradients(const std::string& id);
  // The optimizer step on this rank's rows, with `around` run under the head's lock around the
  // apply (replication/replica_step.h supplies a mesh replica's; empty: a plain step).
  absl::StatusOr<HeadDescription> OptimizerStep(const std::string& id,
                                                const OptimizerStepSpec& spec,
                                                const StepAround& around = {});
  // Where this process sits (alone, a group's rank, a mesh's), with its collectives.
  Placement& placement() { return placement_; }
  // Durable training state (head_state_operations.cc): FAILED_PRECONDITION without a state
  // store. This rank's shard of head `id` saved as `state_id`; restored from it (with
  // `check_only`, only loaded and checked against the head).
  absl::StatusOr<StateStore*> Store() const;
  absl::StatusOr<HeadDescription> SaveState(const std::string& id, const std::string& state_id);
  absl::StatusOr<HeadDescription> RestoreState(const std::string& id, const std::string& state_id,
                                               bool check_only);
  // This rank's state of head `id` (recorded as the head's state `state_id`, which a save and a
  // mesh replica's heal give); FAILED_PRECONDITION naming `field` unless `state` holds this
  // rank's rows of its head; `state` installed as a new head (its bytes reserved, named with
  // `field_prefix`), whole: W, b, optimizer state, version, traits.
  absl::StatusOr<core::HeadState> CaptureOwnState(const std::string& id,
                                                  const std::string& state_id);
  absl::Status CheckOwnRows(const core::HeadState& state, const std::string& field) const;
  absl::StatusOr<HeadDescription> InstallState(const core::HeadState& state,
                                               const std::string& field_prefix);

  // Tied embeddings (head_embedding_operations.cc), this rank's part. `ids`: int64 [n], checked
  // by the caller (CheckEmbeddingIds) — on a group the front's, and on the other ranks an empty
  // tensor of that shape that the front's ids are shared into (the gradient's `rows` too).
  // The rows W[ids] in `dtype` (unset: the head's), on the CPU, at the version they were read at
  // (description.weight_version): on a group each rank reads the rows it holds and the front
  // sums them (Megatron's vocab-parallel embedding); nothing on the other ranks.
  absl::StatusOr<HeadSnapshot> LookupEmbedding(const std::string& id, torch::Tensor ids,
                                               std::optional<torch::ScalarType> dtype);
  // dW[ids] += rows on this rank's rows, exactly once under `key` (use kEmbedding): the same
  // accumulator, window and ledger as the head's steps. FAILED_PRECONDITION naming
  // `version_field` unless the head is at `expected_weight_version` (when set), and for a frozen
  // head.
  absl::StatusOr<EmbeddingGradientOutcome> AddEmbeddingGradient(
      const std::string& id, torch::Tensor ids, torch::Tensor rows, const GradientKey& key,
      std::optional<int64_t> expected_weight_version, const std::string& version_field);

  // One line of the lifecycle log.
  void LogEvent(const std::string& line) const;

 private:
  // This rank's rows of a head of `vocab_size` rows, and every rank's (empty off a group).
  struct Rows {
    int64_t offset = 0;
    int64_t rows = 0;
    std::vector<core::ShardRange> shards;
  };
  absl::StatusOr<Rows> RowsOf(int64_t vocab_size, const std::string& field) const;
  // On a group: the front's uploaded W (and b) shared into every rank's `weight` / `bias`,
  // which are then narrowed to this rank's rows.
  absl::StatusOr<Rows> ShareUploadedRows(torch::Tensor* weight, torch::Tensor* bias);
  // The uploaded W (and b), on this device, written by `share` (Placement::Share: the front's
  // into every rank's; Placement::ShareFromLeader: the leader's into every replica front's) into
  // `weight` / `bias`.
  using ShareFn = absl::Status (Placement::*)(std::vector<torch::Tensor>&);
  absl::Status ShareUploaded(ShareFn share, torch::Tensor* weight, torch::Tensor* bias);

  // A head in a log line: id, shape, dtype, device, version (and "frozen").
  static std::string Summary(const HeadDescription& d);
  // Reserves the bytes of head `id` of this shape (core::HeadMemoryBytes) before it is
  // allocated; returns the admission ticket. INVALID_ARGUMENT (sizes, named with
  // `field_prefix`) or RESOURCE_EXHAUSTED (budget).
  absl::StatusOr<uint64_t> ReserveHead(const std::string& id, int64_t vocab_size,
                                       int64_t hidden_size, torch::ScalarType dtype, bool bias,
                                       std::optional<torch::ScalarType> grad_dtype,
                                       const std::string& field_prefix);
  // Grows or shrinks `entry`'s reservation with its optimizer state (`why` names the state in
  // a refusal). Heads registered without a reservation are not counted.
  HeadEntry::ResizeState ResizeOf(const HeadEntry& entry, const std::string& why);
  // Registers `head` under `id` holding `ticket`; releases the ticket if that fails.
  absl::StatusOr<std::shared_ptr<HeadEntry>> AddReserved(
      const std::string& id, absl::StatusOr<std::unique_ptr<core::Head>> head, uint64_t ticket,
      std::vector<core::ShardRange> shards, bool frozen);
  // core::HeadOptions for a head of `traits` on this device.
  core::HeadOptions HeadOptionsOf(const HeadTraits& traits) const {
    return {.device = device_, .grad_dtype = traits.grad_dtype};
  }

  // The first row of this rank's shard of a head described as `d` (0 when it is whole here).
  int64_t OwnOffset(const HeadDescription& d) const;
  // The checkpoint directory, or FAILED_PRECONDITION naming `field` when there is none.
  absl::StatusOr<const core::CheckpointDir*> CheckpointDirFor(const std::string& field) const;

  HeadRegistry* registry_;
  AdmissionController* admission_;
  const torch::Device device_;
  std::ostream* event_log_;
  const std::shared_ptr<const core::CheckpointDir> checkpoint_dir_;
  StateStore* state_store_;
  // Alone, a head group's rank or a mesh's: the shards and the collectives of every operation.
  Placement placement_;
};

}  // namespace remotehead::server
