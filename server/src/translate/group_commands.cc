#include "translate/group_commands.h"

#include <variant>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"
#include "translate/protocol.h"

namespace remotehead::server {
namespace {

// Head dtypes and the wire's: every dtype a head or a batch tensor can have has a wire value.
v1::DType WireDtype(torch::ScalarType dtype) {
  return wire::ToWireDtype(dtype, "dtype").value_or(v1::DTYPE_UNSPECIFIED);
}

// A creation's traits into its request's fields.
void TraitsToWire(const HeadTraits& traits, v1::CreateHeadRequest* create) {
  create->set_frozen(traits.frozen);
  if (traits.grad_dtype.has_value()) create->set_grad_dtype(WireDtype(*traits.grad_dtype));
}

}  // namespace

v1::GroupCommand CreateCommand(const std::string& id, const core::HeadInit& init,
                               const HeadTraits& traits) {
  v1::GroupCommand command;
  v1::CreateHeadRequest* create = command.mutable_create();
  create->set_head_id(id);
  TraitsToWire(traits, create);
  create->set_dtype(WireDtype(init.dtype));
  v1::CreateHeadRequest::FromInit* from = create->mutable_init();
  from->set_vocab_size(init.vocab_size);
  from->set_hidden_size(init.hidden_size);
  from->set_bias(init.bias);
  from->set_seed(init.seed);
  from->set_init_std(init.init_std);
  return command;
}

v1::GroupCommand CreateCommand(const std::string& id, const SafetensorsSource& source,
                               const HeadTraits& traits) {
  v1::GroupCommand command;
  v1::CreateHeadRequest* create = command.mutable_create();
  create->set_head_id(id);
  TraitsToWire(traits, create);
  if (source.dtype.has_value()) create->set_dtype(WireDtype(*source.dtype));
  v1::CreateHeadRequest::FromSafetensors* from = create->mutable_safetensors();
  from->set_path(source.path);
  from->set_weight_name(source.weight_name);
  from->set_bias_name(source.bias_name);
  return command;
}

v1::GroupCommand UploadCommand(const std::string& id, const torch::Tensor& weight,
                               const torch::Tensor& bias, bool replace, const HeadTraits& traits) {
  v1::GroupCommand command;
  v1::GroupUpload* upload = command.mutable_upload();
  upload->set_head_id(id);
  upload->set_replace(replace);
  upload->set_frozen(traits.frozen);
  if (traits.grad_dtype.has_value()) upload->set_grad_dtype(WireDtype(*traits.grad_dtype));
  *upload->mutable_weight() = DescribeTensor("weight", weight);
  if (bias.defined()) *upload->mutable_bias() = DescribeTensor("bias", bias);
  return command;
}

v1::GroupCommand UndoCreateCommand(const std::string& id) {
  v1::GroupCommand command;
  command.mutable_undo_create()->set_head_id(id);
  return command;
}

v1::GroupCommand HeadCommand(HeadCommandKind kind, const std::string& id) {
  v1::GroupCommand command;
  switch (kind) {
    case HeadCommandKind::kDrop:
      command.mutable_drop()->set_head_id(id);
      break;
    case HeadCommandKind::kZeroGradients:
      command.mutable_zero_gradients()->set_head_id(id);
      break;
  }
  return command;
}

v1::GroupCommand SaveStateCommand(const std::string& id, const std::string& state_id) {
  v1::GroupCommand command;
  command.mutable_save_state()->set_head_id(id);
  command.mutable_save_state()->set_state_id(state_id);
  return command;
}

v1::GroupCommand RestoreStateCommand(const std::string& id, const std::string& state_id,
                                     bool check_only) {
  v1::GroupCommand command;
  v1::GroupHeadState* restore = command.mutable_restore_state();
  restore->set_head_id(id);
  restore->set_state_id(state_id);
  restore->set_check_only(check_only);
  return command;
}

v1::GroupCommand OptimizerStepCommand(const std::string& id, const OptimizerStepSpec& spec) {
  v1::GroupCommand command;
  v1::OptimizerStepRequest* step = command.mutable_optimizer_step();
  step->set_head_id(id);
  step->set_grad_scale(spec.grad_scale);
  step->set_zero_gradients(spec.zero_gradients);
  if (spec.expected_weight_version.has_value()) {
    step->set_expected_weight_version(*spec.expected_weight_version);
  }
  if (const auto* sgd = std::get_if<core::SgdOptions>(&spec.optimizer)) {
    step->mutable_sgd()->set_lr(sgd->lr);
    step->mutable_sgd()->set_momentum(sgd->momentum);
    step->mutable_sgd()->set_weight_decay(sgd->weight_decay);
  } else {
    const auto& adamw = std::get<core::AdamWOptions>(spec.optimizer);
    v1::OptimizerStepRequest::AdamW* o = step->mutable_adamw();
    o->set_lr(adamw.lr);
    o->set_beta1(adamw.beta1);
    o->set_beta2(adamw.beta2);
    o->set_eps(adamw.eps);
    o->set_weight_decay(adamw.weight_decay);
  }
  return command;
}

v1::GroupCommand ReduceStepCommand(const std::string& id, const OptimizerStepSpec& spec) {
  v1::GroupCommand command;
  *command.mutable_reduce_step() = OptimizerStepCommand(id, spec).optimizer_step();
  return command;
}

v1::GroupCommand GatherCommand(const std::string& id, std::optional<torch::ScalarType> dtype,
                               bool gradients) {
  v1::GroupCommand command;
  v1::GroupGather* gather = command.mutable_gather();
  gather->set_head_id(id);
  gather->set_gradients(gradients);
  if (dtype.has_value()) gather->set_dtype(WireDtype(*dtype));
  return command;
}

v1::GroupCommand MeshGradientsCommand(const std::string& id) {
  v1::GroupCommand command = GatherCommand(id, std::nullopt, /*gradients=*/true);
  command.mutable_gather()->set_over_replicas(true);
  return command;
}

v1::GroupCommand EmbeddingLookupCommand(const std::string& id, const torch::Tensor& ids,
                                        std::optional<torch::ScalarType> dtype) {
  v1::GroupCommand command;
  v1::GroupEmbedding* lookup = command.mutable_embedding_lookup();
  lookup->set_head_id(id);
  *lookup->mutable_ids() = DescribeTensor("ids", ids);
  if (dtype.has_value()) lookup->set_dtype(WireDtype(*dtype));
  return command;
}

v1::GroupCommand EmbeddingGradientCommand(const std::string& id, const torch::Tensor& ids,
                                          const torch::Tensor& rows, const GradientKey& key,
                                          std::optional<int64_t> expected_weight_version) {
  v1::GroupCommand command;
  v1::GroupEmbedding* gradient = command.mutable_embedding_gradient();
  gradient->set_head_id(id);
  *gradient->mutable_ids() = DescribeTensor("ids", ids);
  *gradient->mutable_rows() = DescribeTensor("rows", rows);
  gradient->mutable_gradient_id()->set_trainer(key.trainer);
  gradient->mutable_gradient_id()->set_step(key.step);
  gradient->mutable_gradient_id()->set_micro_batch(key.micro_batch);
  if (expected_weight_version.has_value()) {
    gradient->set_expected_weight_version(*expected_weight_version);
  }
  return command;
}

GradientKey EmbeddingGradientKey(const v1::GroupEmbedding& embedding) {
  return GradientKey{.trainer = embedding.gradient_id().trainer(),
                     .step = embedding.gradient_id().step(),
                     .micro_batch = embedding.gradient_id().micro_batch(),
                     .use = GradientUse::kEmbedding};
}

v1::GroupTensor DescribeTensor(const std::string& name, const torch::Tensor& t) {
  v1::GroupTensor spec;
  spec.set_name(name);
  spec.set_dtype(WireDtype(t.scalar_type()));
  for (const int64_t d : t.sizes()) spec.add_shape(d);
  return spec;
}

absl::StatusOr<torch::Tensor> EmptyTensor(const v1::GroupTensor& spec, torch::Device device) {
  ASSIGN_OR_RETURN(const torch::ScalarType dtype,
                   wire::FromWireDtype(spec.dtype(), absl::StrCat("tensor ", spec.name())));
  return torch::empty(std::vector<int64_t>(spec.shape().begin(), spec.shape().end()),
                      torch::TensorOptions().dtype(dtype).device(device));
}

std::string CommandName(const v1::GroupCommand& command) {
  const google::protobuf::FieldDescriptor* op =
      v1::GroupCommand::descriptor()->FindFieldByNumber(command.op_case());
  return op != nullptr ? op->name() : "unknown";
}

HeadGroup::Command ToLog(const v1::GroupCommand& command) {
  return {.name = CommandName(command), .bytes = command.SerializeAsString()};
}

absl::Status RunCommand(HeadGroup::Lane& lane, const v1::GroupCommand& command,
                        const std::function<absl::Status()>& local, bool local_last) {
  return lane.Run(ToLog(command), local, local_last);
}

absl::Status FollowCommands(HeadGroup& group,
                            const std::function<absl::Status(const v1::GroupCommand&)>& run,
                            const std::atomic<bool>& stop) {
  return group.Follow(
      [&](const std::string& bytes) {
        v1::GroupCommand command;
        if (!command.ParseFromString(bytes)) {
          return absl::DataLossError(
              absl::StrCat("head group: a command that does not parse (", bytes.size(), " bytes)"));
        }
        return group.Timed(CommandName(command), [&] { return run(command); });
      },
      stop);
}

}  // namespace remotehead::server
