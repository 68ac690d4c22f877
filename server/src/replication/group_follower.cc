#include "replication/group_follower.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "translate/group_commands.h"
#include "translate/protocol.h"

namespace remotehead::server {

absl::Status GroupFollower::Run(const std::atomic<bool>& stop) {
  return FollowCommands(
      *group_, [this](const v1::GroupCommand& command) { return Follow(command); }, stop);
}

absl::Status GroupFollower::Follow(const v1::GroupCommand& command) {
  if (command.has_step_batch() || command.has_step_end()) return steps_.Follow(command);
  if (command.has_front()) {
    group_->set_front_address(command.front().address());
    return absl::OkStatus();
  }
  if (command.has_ping()) return absl::OkStatus();
  if (command.has_drain() || command.has_stop()) {
    if (drain_ == nullptr) return absl::FailedPreconditionError("no drain on this rank");
    return drain_->Follow(command);
  }
  return FollowHeadCommand(command);
}

absl::Status GroupFollower::FollowHeadCommand(const v1::GroupCommand& command) {
  switch (command.op_case()) {
    case v1::GroupCommand::kCreate: {
      const v1::CreateHeadRequest& create = command.create();
      ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> dtype,
                       OptionalDtype(create.dtype(), "dtype"));
      ASSIGN_OR_RETURN(const HeadTraits traits,
                       TraitsFromWire(create.frozen(), create.grad_dtype(), ""));
      if (create.has_init()) {
        return operations_
            ->CreateFromSeed(create.head_id(),
                             FromWire(create.init(), dtype.value_or(torch::kFloat)), traits)
            .status();
      }
      return operations_
          ->CreateFromSafetensors(create.head_id(), FromWire(create.safetensors(), dtype), traits)
          .status();
    }
    case v1::GroupCommand::kUpload: {
      const v1::GroupUpload& upload = command.upload();
      ASSIGN_OR_RETURN(torch::Tensor weight, EmptyTensor(upload.weight(), device_));
      torch::Tensor bias;
      if (upload.has_bias()) {
        ASSIGN_OR_RETURN(bias, EmptyTensor(upload.bias(), device_));
      }
      ASSIGN_OR_RETURN(const HeadTraits traits,
                       TraitsFromWire(upload.frozen(), upload.grad_dtype(), "header."));
      return operations_->Upload(upload.head_id(), weight, bias, upload.replace(), traits).status();
    }
    case v1::GroupCommand::kDrop:
      return operations_->Drop(command.drop().head_id());
    case v1::GroupCommand::kUndoCreate:
      return operations_->UndoCreate(command.undo_create().head_id());
    case v1::GroupCommand::kZeroGradients:
      return operations_->ZeroGradients(command.zero_gradients().head_id()).status();
    case v1::GroupCommand::kOptimizerStep: {
      ASSIGN_OR_RETURN(const OptimizerStepSpec spec, FromWire(command.optimizer_step()));
      return operations_->OptimizerStep(command.optimizer_step().head_id(), spec).status();
    }
    case v1::GroupCommand::kReduceStep: {
      ASSIGN_OR_RETURN(const OptimizerStepSpec spec, FromWire(command.reduce_step()));
      return operations_->ReduceStep(command.reduce_step().head_id(), spec).status();
    }
    case v1::GroupCommand::kSaveState:
      return operations_->SaveState(command.save_state().head_id(), command.save_state().state_id())
          .status();
    case v1::GroupCommand::kRestoreState: {
      const v1::GroupHeadState& restore = command.restore_state();
      return operations_->RestoreState(restore.head_id(), restore.state_id(), restore.check_only())
          .status();
    }
    case v1::GroupCommand::kGather: {
      const v1::GroupGather& gather = command.gather();
      ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> dtype,
                       OptionalDtype(gather.dtype(), "dtype"));
      return operations_->Snapshot(gather.head_id(), dtype, gather.gradients()).status();
    }
    case v1::GroupCommand::kEmbeddingLookup: {
      const v1::GroupEmbedding& lookup = command.embedding_lookup();
      ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> dtype,
                       OptionalDtype(lookup.dtype(), "dtype"));
      ASSIGN_OR_RETURN(torch::Tensor ids, EmptyTensor(lookup.ids(), device_));
      return operations_->LookupEmbedding(lookup.head_id(), ids, dtype).status();
    }
    case v1::GroupCommand::kEmbeddingGradient: {
      const v1::GroupEmbedding& gradient = command.embedding_gradient();
      ASSIGN_OR_RETURN(torch::Tensor ids, EmptyTensor(gradient.ids(), device_));
      ASSIGN_OR_RETURN(torch::Tensor rows, EmptyTensor(gradient.rows(), device_));
      return operations_
          ->AddEmbeddingGradient(gradient.head_id(), ids, rows, EmbeddingGradientKey(gradient),
                                 ExpectedWeightVersion(gradient), "header.expected_weight_version")
          .status();
    }
    default:
      return absl::InternalError(absl::StrCat(
          "head group: command ", static_cast<int>(command.op_case()), " is not a head operation"));
  }
}

}  // namespace remotehead::server
