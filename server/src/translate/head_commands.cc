#include "translate/head_commands.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "translate/group_commands.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

namespace hc = head_command;

// A creation's traits into its request's fields.
void TraitsToWire(const HeadTraits& traits, v1::CreateHeadRequest* create) {
  create->set_frozen(traits.frozen);
  if (traits.grad_dtype.has_value()) create->set_grad_dtype(GroupWireDtype(*traits.grad_dtype));
}

v1::OptimizerStepRequest StepToWire(const std::string& id, const OptimizerStepSpec& spec) {
  v1::OptimizerStepRequest step;
  step.set_head_id(id);
  step.set_grad_scale(spec.grad_scale);
  step.set_zero_gradients(spec.zero_gradients);
  if (spec.expected_weight_version.has_value()) {
    step.set_expected_weight_version(*spec.expected_weight_version);
  }
  if (const auto* sgd = std::get_if<core::SgdOptions>(&spec.optimizer)) {
    step.mutable_sgd()->set_lr(sgd->lr);
    step.mutable_sgd()->set_momentum(sgd->momentum);
    step.mutable_sgd()->set_weight_decay(sgd->weight_decay);
  } else {
    const auto& adamw = std::get<core::AdamWOptions>(spec.optimizer);
    v1::OptimizerStepRequest::AdamW* o = step.mutable_adamw();
    o->set_lr(adamw.lr);
    o->set_beta1(adamw.beta1);
    o->set_beta2(adamw.beta2);
    o->set_eps(adamw.eps);
    o->set_weight_decay(adamw.weight_decay);
  }
  return step;
}

// Each command into its log entry: its one encoding (Encode visits them).
void EncodeInto(const hc::CreateFromSeed& c, v1::GroupCommand* command) {
  v1::CreateHeadRequest* create = command->mutable_create();
  create->set_head_id(c.id);
  TraitsToWire(c.traits, create);
  create->set_dtype(GroupWireDtype(c.init.dtype));
  v1::CreateHeadRequest::FromInit* from = create->mutable_init();
  from->set_vocab_size(c.init.vocab_size);
  from->set_hidden_size(c.init.hidden_size);
  from->set_bias(c.init.bias);
  from->set_seed(c.init.seed);
  from->set_init_std(c.init.init_std);
}

void EncodeInto(const hc::CreateFromSafetensors& c, v1::GroupCommand* command) {
  v1::CreateHeadRequest* create = command->mutable_create();
  create->set_head_id(c.id);
  TraitsToWire(c.traits, create);
  if (c.source.dtype.has_value()) create->set_dtype(GroupWireDtype(*c.source.dtype));
  v1::CreateHeadRequest::FromSafetensors* from = create->mutable_safetensors();
  from->set_path(c.source.path);
  from->set_weight_name(c.source.weight_name);
  from->set_bias_name(c.source.bias_name);
}

void EncodeInto(const hc::Upload& c, v1::GroupCommand* command) {
  v1::GroupUpload* upload = command->mutable_upload();
  upload->set_head_id(c.id);
  upload->set_replace(c.replace);
  upload->set_frozen(c.traits.frozen);
  if (c.traits.grad_dtype.has_value()) upload->set_grad_dtype(GroupWireDtype(*c.traits.grad_dtype));
  *upload->mutable_weight() = DescribeTensor("weight", c.weight);
  if (c.bias.defined()) *upload->mutable_bias() = DescribeTensor("bias", c.bias);
}

void EncodeInto(const hc::EmbeddingLookup& c, v1::GroupCommand* command) {
  v1::GroupEmbedding* lookup = command->mutable_embedding_lookup();
  lookup->set_head_id(c.id);
  *lookup->mutable_ids() = DescribeTensor("ids", c.ids);
  if (c.dtype.has_value()) lookup->set_dtype(GroupWireDtype(*c.dtype));
}

void EncodeInto(const hc::EmbeddingGradient& c, v1::GroupCommand* command) {
  v1::GroupEmbedding* gradient = command->mutable_embedding_gradient();
  gradient->set_head_id(c.id);
  *gradient->mutable_ids() = DescribeTensor("ids", c.ids);
  *gradient->mutable_rows() = DescribeTensor("rows", c.rows);
  gradient->mutable_gradient_id()->set_trainer(c.key.trainer);
  gradient->mutable_gradient_id()->set_step(c.key.step);
  gradient->mutable_gradient_id()->set_micro_batch(c.key.micro_batch);
  if (c.expected_weight_version.has_value()) {
    gradient->set_expected_weight_version(*c.expected_weight_version);
  }
}

void EncodeInto(const hc::Drop& c, v1::GroupCommand* command) {
  command->mutable_drop()->set_head_id(c.id);
}

void EncodeInto(const hc::UndoCreate& c, v1::GroupCommand* command) {
  command->mutable_undo_create()->set_head_id(c.id);
}

void EncodeInto(const hc::ZeroGradients& c, v1::GroupCommand* command) {
  command->mutable_zero_gradients()->set_head_id(c.id);
}

void EncodeInto(const hc::OptimizerStep& c, v1::GroupCommand* command) {
  *command->mutable_optimizer_step() = StepToWire(c.id, c.spec);
}

void EncodeInto(const hc::Heal& c, v1::GroupCommand* command) {
  command->mutable_heal()->set_epoch(c.epoch);
  command->mutable_heal()->set_replica(c.replica);
}

void EncodeInto(const hc::ReduceStep& c, v1::GroupCommand* command) {
  *command->mutable_reduce_step()->mutable_step() = StepToWire(c.id, c.spec);
  command->mutable_reduce_step()->set_attempt(c.attempt);
  command->mutable_reduce_step()->set_epoch(c.epoch);
}

void EncodeInto(const hc::SaveState& c, v1::GroupCommand* command) {
  command->mutable_save_state()->set_head_id(c.id);
  command->mutable_save_state()->set_state_id(c.state_id);
}

void EncodeInto(const hc::RestoreState& c, v1::GroupCommand* command) {
  v1::GroupHeadState* restore = command->mutable_restore_state();
  restore->set_head_id(c.id);
  restore->set_state_id(c.state_id);
  restore->set_check_only(c.check_only);
}

void EncodeInto(const hc::Gather& c, v1::GroupCommand* command) {
  v1::GroupGather* gather = command->mutable_gather();
  gather->set_head_id(c.id);
  gather->set_gradients(c.gradients);
  if (c.dtype.has_value()) gather->set_dtype(GroupWireDtype(*c.dtype));
}

absl::StatusOr<HeadCommand> DecodeCreate(const v1::CreateHeadRequest& create) {
  ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> dtype,
                   OptionalDtype(create.dtype(), "dtype"));
  ASSIGN_OR_RETURN(HeadTraits traits, TraitsFromWire(create.frozen(), create.grad_dtype(), ""));
  if (create.has_init()) {
    return hc::CreateFromSeed{.id = create.head_id(),
                              .init = FromWire(create.init(), dtype.value_or(torch::kFloat)),
                              .traits = std::move(traits)};
  }
  return hc::CreateFromSafetensors{.id = create.head_id(),
                                   .source = FromWire(create.safetensors(), dtype),
                                   .traits = std::move(traits)};
}

absl::StatusOr<HeadCommand> DecodeUpload(const v1::GroupUpload& upload, torch::Device device) {
  hc::Upload c{.id = upload.head_id(), .replace = upload.replace()};
  ASSIGN_OR_RETURN(c.weight, EmptyTensor(upload.weight(), device));
  if (upload.has_bias()) {
    ASSIGN_OR_RETURN(c.bias, EmptyTensor(upload.bias(), device));
  }
  ASSIGN_OR_RETURN(c.traits, TraitsFromWire(upload.frozen(), upload.grad_dtype(), "header."));
  return c;
}

absl::StatusOr<HeadCommand> DecodeEmbeddingGradient(const v1::GroupEmbedding& gradient,
                                                    torch::Device device) {
  hc::EmbeddingGradient c;
  c.id = gradient.head_id();
  c.key.trainer = gradient.gradient_id().trainer();
  c.key.step = gradient.gradient_id().step();
  c.key.micro_batch = gradient.gradient_id().micro_batch();
  c.key.use = GradientUse::kEmbedding;
  c.expected_weight_version = ExpectedWeightVersion(gradient);
  ASSIGN_OR_RETURN(c.ids, EmptyTensor(gradient.ids(), device));
  ASSIGN_OR_RETURN(c.rows, EmptyTensor(gradient.rows(), device));
  return c;
}

}  // namespace

v1::GroupCommand Encode(const HeadCommand& command) {
  v1::GroupCommand encoded;
  std::visit([&](const auto& c) { EncodeInto(c, &encoded); }, command);
  return encoded;
}

v1::GroupCommand MeshGradientsCommand(const std::string& id) {
  v1::GroupCommand command = Encode(hc::Gather{.id = id, .gradients = true});
  command.mutable_gather()->set_over_replicas(true);
  return command;
}

bool IsHeadCommand(const v1::GroupCommand& entry) {
  switch (entry.op_case()) {
    case v1::GroupCommand::kCreate:
    case v1::GroupCommand::kUpload:
    case v1::GroupCommand::kDrop:
    case v1::GroupCommand::kUndoCreate:
    case v1::GroupCommand::kZeroGradients:
    case v1::GroupCommand::kOptimizerStep:
    case v1::GroupCommand::kReduceStep:
    case v1::GroupCommand::kHeal:
    case v1::GroupCommand::kSaveState:
    case v1::GroupCommand::kRestoreState:
    case v1::GroupCommand::kEmbeddingLookup:
    case v1::GroupCommand::kEmbeddingGradient:
      return true;
    case v1::GroupCommand::kGather:
      return !entry.gather().over_replicas();  // that one is the mesh's (MeshFollower)
    default:
      return false;
  }
}

absl::StatusOr<HeadCommand> DecodeHeadCommand(const v1::GroupCommand& entry, torch::Device device) {
  if (!IsHeadCommand(entry)) {
    return absl::InternalError(
        absl::StrCat("head group: command \"", CommandName(entry), "\" is not a head operation"));
  }
  switch (entry.op_case()) {
    case v1::GroupCommand::kCreate:
      return DecodeCreate(entry.create());
    case v1::GroupCommand::kUpload:
      return DecodeUpload(entry.upload(), device);
    case v1::GroupCommand::kDrop:
      return hc::Drop{.id = entry.drop().head_id()};
    case v1::GroupCommand::kUndoCreate:
      return hc::UndoCreate{.id = entry.undo_create().head_id()};
    case v1::GroupCommand::kZeroGradients:
      return hc::ZeroGradients{.id = entry.zero_gradients().head_id()};
    case v1::GroupCommand::kOptimizerStep: {
      ASSIGN_OR_RETURN(OptimizerStepSpec spec, FromWire(entry.optimizer_step()));
      return hc::OptimizerStep{.id = entry.optimizer_step().head_id(), .spec = std::move(spec)};
    }
    case v1::GroupCommand::kReduceStep: {
      const v1::GroupReduceStep& reduce = entry.reduce_step();
      ASSIGN_OR_RETURN(OptimizerStepSpec spec, FromWire(reduce.step()));
      return hc::ReduceStep{.id = reduce.step().head_id(),
                            .spec = std::move(spec),
                            .attempt = reduce.attempt(),
                            .epoch = reduce.epoch()};
    }
    case v1::GroupCommand::kHeal:
      return hc::Heal{.epoch = entry.heal().epoch(), .replica = entry.heal().replica()};
    case v1::GroupCommand::kSaveState:
      return hc::SaveState{.id = entry.save_state().head_id(),
                           .state_id = entry.save_state().state_id()};
    case v1::GroupCommand::kRestoreState:
      return hc::RestoreState{.id = entry.restore_state().head_id(),
                              .state_id = entry.restore_state().state_id(),
                              .check_only = entry.restore_state().check_only()};
    case v1::GroupCommand::kGather: {
      ASSIGN_OR_RETURN(const std::optional<torch::ScalarType> dtype,
                       OptionalDtype(entry.gather().dtype(), "dtype"));
      return hc::Gather{
          .id = entry.gather().head_id(), .dtype = dtype, .gradients = entry.gather().gradients()};
    }
    case v1::GroupCommand::kEmbeddingLookup: {
      const v1::GroupEmbedding& lookup = entry.embedding_lookup();
      hc::EmbeddingLookup c{.id = lookup.head_id()};
      ASSIGN_OR_RETURN(c.dtype, OptionalDtype(lookup.dtype(), "dtype"));
      ASSIGN_OR_RETURN(c.ids, EmptyTensor(lookup.ids(), device));
      return c;
    }
    case v1::GroupCommand::kEmbeddingGradient:
      return DecodeEmbeddingGradient(entry.embedding_gradient(), device);
    default:
      return absl::InternalError("unreachable: IsHeadCommand took it");
  }
}

}  // namespace remotehead::server
