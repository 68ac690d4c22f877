#include "replication/replicated_head_operations.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "service/head_expectations.h"
#include "translate/group_commands.h"
#include "translate/head_commands.h"

namespace remotehead::server {
namespace {

namespace hc = head_command;

// The head a create or upload command makes (its undo drops it wherever it was made).
std::string CreatedHead(const v1::GroupCommand& command) {
  return command.has_create() ? command.create().head_id() : command.upload().head_id();
}

}  // namespace

absl::Status ReplicatedHeadOperations::RunOnEveryRank(const v1::GroupCommand& command,
                                                      const std::function<absl::Status()>& here,
                                                      bool creates, Reach reach) {
  if (reach == Reach::kReplica || !local_->placement().is_replica_front()) {
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
  // A replica lost meanwhile: the caller asks again once the mesh goes on without it.
  return mesh_->Restated(
      UndoFailedCreate(lane, command, creates, status, [&](const hc::UndoCreate& undo) {
        return RunInReplica(
            Encode(undo), [&] { return ApplyHeadCommand(*local_, undo).status(); }, false);
      }));
}

absl::Status ReplicatedHeadOperations::RunInReplica(const v1::GroupCommand& command,
                                                    const std::function<absl::Status()>& here,
                                                    bool creates) {
  if (group_ == nullptr) return here();
  ASSIGN_OR_RETURN(HeadGroup::Lane lane, group_->Enter());
  const absl::Status status = RunCommand(lane, command, here);
  // Some ranks may have created the head (another's budget refused it): undone everywhere.
  return UndoFailedCreate(lane, command, creates, status, [&](const hc::UndoCreate& undo) {
    return ApplyHeadCommand(*local_, undo).status();
  });
}

absl::Status ReplicatedHeadOperations::UndoFailedCreate(
    HeadGroup::Lane& lane, const v1::GroupCommand& command, bool creates,
    const absl::Status& status,
    const std::function<absl::Status(const hc::UndoCreate& undo)>& undo_here) {
  if (!creates || status.ok() || IsGroupFailure(status)) return status;
  const hc::UndoCreate undo{.id = CreatedHead(command)};
  const absl::Status undone = RunCommand(lane, Encode(undo), [&] { return undo_here(undo); });
  return undone.ok() ? status : undone;
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::CreateFromSeed(const std::string& id,
                                                                         const core::HeadInit& init,
                                                                         const HeadTraits& traits) {
  return Propose(hc::CreateFromSeed{.id = id, .init = init, .traits = traits}, /*creates=*/true);
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::CreateFromSafetensors(
    const std::string& id, const SafetensorsSource& source, const HeadTraits& traits) {
  return Propose(hc::CreateFromSafetensors{.id = id, .source = source, .traits = traits},
                 /*creates=*/true);
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::AddUploaded(const std::string& id,
                                                                      const torch::Tensor& weight,
                                                                      const torch::Tensor& bias,
                                                                      bool replace,
                                                                      const HeadTraits& traits) {
  const bool creates = !(replace && local_->Describe(id).ok());
  // Refused here before any rank is asked (each rank checks it again: all refuse alike).
  if (replace) RETURN_IF_ERROR(local_->CheckReplaceKeepsTraits(id, traits));
  return Propose(
      hc::Upload{.id = id, .weight = weight, .bias = bias, .replace = replace, .traits = traits},
      creates);
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
  ASSIGN_OR_RETURN(HeadSnapshot mine, Propose(hc::Gather{.id = id, .gradients = true},
                                              /*creates=*/false, Reach::kReplica));
  RETURN_IF_ERROR(mesh_->SumOnLeader(mine.matrix));
  if (mine.vector.defined()) RETURN_IF_ERROR(mesh_->SumOnLeader(mine.vector));
  torch::Tensor count = torch::tensor({mine.description.accumulated_micro_batches}, torch::kInt64);
  RETURN_IF_ERROR(mesh_->SumOnLeader(count));
  mine.description.accumulated_micro_batches = count.item<int64_t>();
  return mine;
}

absl::StatusOr<HeadSnapshot> ReplicatedHeadOperations::Snapshot(
    const std::string& id, std::optional<torch::ScalarType> dtype, bool gradients) {
  if (gradients && local_->placement().is_replica_front()) {
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
    RETURN_IF_ERROR(mesh_->Restated(RunCommand(lane, MeshGradientsCommand(id), [&] {
      summed = SumGradientsOnLeader(id);
      return summed.status();
    })));
    if (summed.ok() && dtype.has_value()) {
      summed->matrix = summed->matrix.to(*dtype);
      if (summed->vector.defined()) summed->vector = summed->vector.to(*dtype);
    }
    return summed;
  }
  return Propose(hc::Gather{.id = id, .dtype = dtype, .gradients = gradients}, /*creates=*/false,
                 Reach::kReplica);
}

absl::Status ReplicatedHeadOperations::Serving() const { return local_->placement().Serving(); }

absl::StatusOr<HeadSnapshot> ReplicatedHeadOperations::LookupEmbedding(
    const std::string& id, const torch::Tensor& ids, std::optional<torch::ScalarType> dtype,
    const std::string& ids_field) {
  RETURN_IF_ERROR(Serving());  // a training call
  ASSIGN_OR_RETURN(const HeadDescription head, local_->Describe(id));
  RETURN_IF_ERROR(CheckEmbeddingIds(ids, head.vocab_size, ids_field));
  return Propose(hc::EmbeddingLookup{.id = id, .ids = ids, .dtype = dtype}, /*creates=*/false,
                 Reach::kReplica);
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
  // The front's part is not last (as a step's commit is): every rank's part begins with the
  // front's broadcast of the rows. The checks above are every rank's, on the same log, so the
  // ranks commit alike. This replica's ranks only: dW is summed over replicas at the mesh's step.
  return Propose(hc::EmbeddingGradient{.id = id,
                                       .ids = ids,
                                       .rows = rows,
                                       .key = key,
                                       .expected_weight_version = expected_weight_version,
                                       .version_field = version_field},
                 /*creates=*/false, Reach::kReplica);
}

absl::Status ReplicatedHeadOperations::Drop(const std::string& id) {
  return Propose(hc::Drop{.id = id}).status();
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::ZeroGradients(const std::string& id) {
  return Propose(hc::ZeroGradients{.id = id});
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::OptimizerStep(
    const std::string& id, const OptimizerStepSpec& spec) {
  // A frozen head is refused before any rank is asked (each rank's entry refuses it too).
  ASSIGN_OR_RETURN(const HeadDescription head, local_->Describe(id));
  if (head.frozen) return HeadFrozenError(id, "head_id", "an optimizer step");
  return Propose(hc::OptimizerStep{.id = id, .spec = spec});
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::ReduceStep(const std::string& id,
                                                                     const OptimizerStepSpec& spec,
                                                                     const std::string& attempt,
                                                                     int epoch) {
  return Propose(hc::ReduceStep{.id = id, .spec = spec, .attempt = attempt, .epoch = epoch},
                 /*creates=*/false,
                 Reach::kReplica);
}

absl::StatusOr<HeadDescription> ReplicatedHeadOperations::StepOptimizer(
    const std::string& id, const std::optional<SyncStepRequest>& first,
    const OptimizerStepSpec& spec) {
  absl::StatusOr<HeadDescription> stepped = local_->placement().replicated()
                                                ? mesh_steps_.Step(id, first, spec)
                                                : OptimizerStep(id, spec);
  if (stepped.ok()) SaveAfterStep(id, stepped->weight_version);
  return stepped;
}

}  // namespace remotehead::server
