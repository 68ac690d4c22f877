#include "replication/replicated_head_operations.h"

#include "absl/strings/str_cat.h"
#include "head_expectations.h"
#include "remotehead/core/status_macros.h"
#include "translate/group_commands.h"

namespace remotehead::server {
namespace {

// The head a create or upload command makes (its undo drops it wherever it was made).
std::string CreatedHead(const v1::GroupCommand& command) {
  return command.has_create() ? command.create().head_id() : command.upload().head_id();
}

}  // namespace

absl::Status ReplicatedHeadOperations::RunOnEveryRank(const v1::GroupCommand& command,
                                                      const std::function<absl::Status()>& here,
                                                      bool creates, Reach reach) {
  if (reach == Reach::kReplica || mesh_ == nullptr || !mesh_->is_front()) {
    return RunInReplica(command, here, creates);
  }
  if (!mesh_->is_leader()) {
    return mesh_->NotTheLeader(absl::StrCat("the operation \"", CommandName(command), "\""));
  }
  RETURN_IF_ERROR(Serving());  // what changes every replica: never on a mesh that is down
  // Every replica's front runs the same command on its own replica (MeshFollower).
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, mesh_->fronts()->Enter());
  const absl::Status status =
      RunCommand(lane, command, [&] { return RunInReplica(command, here, /*creates=*/false); });
  return UndoFailedCreate(lane, command, creates, status, [&](const v1::GroupCommand& undo) {
    return RunInReplica(
        undo, [&] { return local_->UndoCreate(CreatedHead(command)); }, false);
  });
}

absl::Status ReplicatedHeadOperations::RunInReplica(const v1::GroupCommand& command,
                                                    const std::function<absl::Status()>& here,
                                                    bool creates) {
  if (group_ == nullptr) return here();
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, group_->Enter());
  const absl::Status status = RunCommand(lane, command, here);
  // Some ranks may have created the head (another's budget refused it): undone everywhere.
  return UndoFailedCreate(lane, command, creates, status, [&](const v1::GroupCommand&) {
    return local_->UndoCreate(CreatedHead(command));
  });
}

absl::Status ReplicatedHeadOperations::UndoFailedCreate(
    HeadGroup::Lane& lane, const v1::GroupCommand& command, bool creates,
    const absl::Status& status,
    const std::function<absl::Status(const v1::GroupCommand& undo)>& undo_here) {
  if (!creates || status.ok() || IsGroupFailure(status)) return status;
  const v1::GroupCommand undo = UndoCreateCommand(CreatedHead(command));
  const absl::Status undone = RunCommand(lane, undo, [&] { return undo_here(undo); });
  return undone.ok() ? status : undone;
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::CreateFromSeed(const std::string& id,
                                                                         const core::HeadInit& init,
                                                                         const HeadTraits& traits) {
  return OnEveryRank<HeadDescription>(
      CreateCommand(id, init, traits), [&] { return local_->CreateFromSeed(id, init, traits); },
      /*creates=*/true);
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::CreateFromSafetensors(
    const std::string& id, const SafetensorsSource& source, const HeadTraits& traits) {
  return OnEveryRank<HeadDescription>(
      CreateCommand(id, source, traits),
      [&] { return local_->CreateFromSafetensors(id, source, traits); }, /*creates=*/true);
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::AddUploaded(const std::string& id,
                                                                      const torch::Tensor& weight,
                                                                      const torch::Tensor& bias,
                                                                      bool replace,
                                                                      const HeadTraits& traits) {
  const bool creates = !(replace && local_->Describe(id).ok());
  // Refused here before any rank is asked (each rank checks it again: all refuse alike).
  if (replace) RETURN_IF_ERROR(local_->CheckReplaceKeepsTraits(id, traits));
  return OnEveryRank<HeadDescription>(
      UploadCommand(id, weight, bias, replace, traits),
      [&] { return local_->Upload(id, weight, bias, replace, traits); }, creates);
}

absl::StatusOr<int64_t> ReplicatedHeadOperations::Save(const std::string& id,
                                                       const std::string& path,
                                                       const std::string& weight_name,
                                                       const std::string& bias_name) {
  RETURN_IF_ERROR(local_->CheckCheckpointPath(path));
  // The whole head (gathered from every rank on a group).
  ASSIGN_OR_RETURN(const HeadSnapshot snapshot, Snapshot(id, std::nullopt, /*gradients=*/false));
  return local_->WriteCheckpoint(id, snapshot, path, weight_name, bias_name);
}

absl::StatusOr<HeadSnapshot> ReplicatedHeadOperations::SumGradientsOnLeader(const std::string& id) {
  ASSIGN_OR_RETURN(HeadSnapshot mine, OnEveryRank<HeadSnapshot>(
                                          GatherCommand(id, std::nullopt, /*gradients=*/true),
                                          [&] { return local_->Snapshot(id, std::nullopt, true); },
                                          false, Reach::kReplica));
  RETURN_IF_ERROR(mesh_->SumOnLeader(mine.matrix));
  if (mine.vector.defined()) RETURN_IF_ERROR(mesh_->SumOnLeader(mine.vector));
  torch::Tensor count = torch::tensor({mine.description.accumulated_micro_batches}, torch::kInt64);
  RETURN_IF_ERROR(mesh_->SumOnLeader(count));
  mine.description.accumulated_micro_batches = count.item<int64_t>();
  return mine;
}

absl::StatusOr<HeadSnapshot> ReplicatedHeadOperations::Snapshot(
    const std::string& id, std::optional<torch::ScalarType> dtype, bool gradients) {
  if (gradients && mesh_ != nullptr && mesh_->is_front()) {
    // Every replica's dW, summed: never one replica's part presented as the head's.
    if (!mesh_->is_leader()) {
      return mesh_->NotTheLeader(
          "FetchGradients (it reads the mesh's dW: every replica's, summed on the leader)");
    }
    RETURN_IF_ERROR(Serving());
    // A mesh command whose every front runs it as its own (not relayed to its replica's ranks,
    // as RunOnEveryRank does): each gathers its replica's dW through its replica's log.
    ASSIGN_OR_RETURN(HeadGroup::Lane lane, mesh_->fronts()->Enter());
    absl::StatusOr<HeadSnapshot> summed = absl::UnknownError("not run");
    RETURN_IF_ERROR(RunCommand(lane, MeshGradientsCommand(id), [&] {
      summed = SumGradientsOnLeader(id);
      return summed.status();
    }));
    if (summed.ok() && dtype.has_value()) {
      summed->matrix = summed->matrix.to(*dtype);
      if (summed->vector.defined()) summed->vector = summed->vector.to(*dtype);
    }
    return summed;
  }
  return OnEveryRank<HeadSnapshot>(
      GatherCommand(id, dtype, gradients), [&] { return local_->Snapshot(id, dtype, gradients); },
      false, Reach::kReplica);
}

absl::Status ReplicatedHeadOperations::Serving() const {
  if (group_ != nullptr) return group_->Serving();
  if (mesh_ != nullptr && mesh_->fronts() != nullptr) return mesh_->fronts()->Serving();
  return absl::OkStatus();
}

absl::StatusOr<HeadSnapshot> ReplicatedHeadOperations::LookupEmbedding(
    const std::string& id, const torch::Tensor& ids, std::optional<torch::ScalarType> dtype,
    const std::string& ids_field) {
  RETURN_IF_ERROR(Serving());  // a training call
  ASSIGN_OR_RETURN(const HeadDescription head, local_->Describe(id));
  RETURN_IF_ERROR(CheckEmbeddingIds(ids, head.vocab_size, ids_field));
  return OnEveryRank<HeadSnapshot>(
      EmbeddingLookupCommand(id, ids, dtype),
      [&] { return local_->LookupEmbedding(id, ids, dtype); }, false, Reach::kReplica);
}

absl::StatusOr<EmbeddingGradientOutcome> ReplicatedHeadOperations::AddEmbeddingGradient(
    const std::string& id, const torch::Tensor& ids, const torch::Tensor& rows,
    const GradientKey& key, std::optional<int64_t> expected_weight_version,
    const std::string& ids_field, const std::string& rows_field, const std::string& version_field) {
  RETURN_IF_ERROR(Serving());  // dW that could never be applied
  ASSIGN_OR_RETURN(const HeadDescription head, local_->Describe(id));
  RETURN_IF_ERROR(CheckEmbeddingIds(ids, head.vocab_size, ids_field));
  // Refused on every topology before any rank is asked (the reactor checks it first too).
  RETURN_IF_ERROR(CheckEmbeddingGradientIds(ids, ids_field));
  RETURN_IF_ERROR(CheckEmbeddingRows(rows, ids.size(0), head.hidden_size, rows_field));
  // Refused here before any rank is asked (each rank's part refuses them too).
  if (head.frozen) return HeadFrozenError(id, "header.gradient_id", "accumulating dW");
  RETURN_IF_ERROR(CheckWeightVersion(expected_weight_version, version_field, head));
  absl::StatusOr<EmbeddingGradientOutcome> outcome = absl::UnknownError("not run");
  const absl::Status status = RunInReplica(
      EmbeddingGradientCommand(id, ids, rows, key, expected_weight_version),
      [&] {
        outcome = local_->AddEmbeddingGradient(id, ids, rows, key, expected_weight_version,
                                               version_field);
        return outcome.status();
      },
      // The front's part is not last (as a step's commit is): every rank's part begins with the
      // front's broadcast of the rows. The checks above are every rank's, on the same log, so
      // the ranks commit alike.
      /*creates=*/false);
  if (!status.ok()) return status;
  return outcome;
}

absl::Status ReplicatedHeadOperations::Drop(const std::string& id) {
  return RunOnEveryRank(HeadCommand(HeadCommandKind::kDrop, id), [&] { return local_->Drop(id); });
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::ZeroGradients(const std::string& id) {
  return OnEveryRank<HeadDescription>(HeadCommand(HeadCommandKind::kZeroGradients, id),
                                      [&] { return local_->ZeroGradients(id); });
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::OptimizerStep(
    const std::string& id, const OptimizerStepSpec& spec) {
  // A frozen head is refused before any rank is asked (each rank's entry refuses it too).
  ASSIGN_OR_RETURN(const HeadDescription head, local_->Describe(id));
  if (head.frozen) return HeadFrozenError(id, "head_id", "an optimizer step");
  return OnEveryRank<HeadDescription>(OptimizerStepCommand(id, spec),
                                      [&] { return local_->OptimizerStep(id, spec); });
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::ReduceStep(
    const std::string& id, const OptimizerStepSpec& spec) {
  return OnEveryRank<HeadDescription>(
      ReduceStepCommand(id, spec), [&] { return local_->ReduceStep(id, spec); }, false,
      Reach::kReplica);
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::StepOptimizer(
    const std::string& id, const std::optional<SyncStepRequest>& first,
    const OptimizerStepSpec& spec) {
  absl::StatusOr<HeadDescription> stepped =
      mesh_ != nullptr ? mesh_steps_.Step(id, first, spec) : OptimizerStep(id, spec);
  if (stepped.ok()) SaveAfterStep(id, stepped->weight_version);
  return stepped;
}

}  // namespace remotehead::server
