// A head's messages (head_messages.h): its info read from the wire, the requests that create it
// or step its optimizer, the token ids a request carries, and the head described before its rows
// are streamed.
#include "head_messages.h"

#include <algorithm>
#include <variant>

#include "absl/strings/str_cat.h"

namespace remotehead::client::internal {

absl::StatusOr<HeadInfo> FromWire(const v1::HeadInfo& wire) {
  HeadInfo info;
  info.head_id = wire.head_id();
  info.vocab_size = wire.vocab_size();
  info.hidden_size = wire.hidden_size();
  ASSIGN_OR_RETURN(info.dtype, BrokenResponse(wire::FromWireDtype(wire.dtype(), "info")));
  info.has_bias = wire.has_bias();
  info.device = wire.device();
  info.weight_version = wire.weight_version();
  info.accumulated_micro_batches = wire.accumulated_micro_batches();
  info.incarnation = wire.incarnation();
  info.state_id = wire.state_id();
  info.group_size = std::max(1, wire.group_size());
  for (const v1::ShardRange& shard : wire.shards()) {
    info.shards.emplace_back(shard.offset(), shard.rows());
  }
  info.frozen = wire.frozen();
  info.teacher_of.assign(wire.teacher_of().begin(), wire.teacher_of().end());
  if (wire.grad_dtype() != v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(info.grad_dtype,
                     BrokenResponse(wire::FromWireDtype(wire.grad_dtype(), "info.grad_dtype")));
  }
  return info;
}

// Token ids as the wire's repeated int64: INVALID_ARGUMENT naming `field` unless int64 [n].
absl::StatusOr<v1::CreateHeadRequest> ToCreateRequest(const std::string& head_id,
                                                      const InitSpec& init) {
  v1::CreateHeadRequest request;
  request.set_head_id(head_id);
  ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(init.dtype, "init.dtype"));
  request.set_dtype(dtype);
  v1::CreateHeadRequest::FromInit* wire_init = request.mutable_init();
  wire_init->set_vocab_size(init.vocab_size);
  wire_init->set_hidden_size(init.hidden_size);
  wire_init->set_bias(init.bias);
  wire_init->set_seed(init.seed);
  wire_init->set_init_std(init.init_std);
  request.set_frozen(init.frozen);
  RETURN_IF_ERROR(SetGradDtype(init.grad_dtype, "init.grad_dtype", &request));
  return request;
}

absl::StatusOr<v1::CreateHeadRequest> ToCreateRequest(const std::string& head_id,
                                                      const SafetensorsSource& source) {
  v1::CreateHeadRequest request;
  request.set_head_id(head_id);
  if (source.dtype.has_value()) {
    ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(*source.dtype, "source.dtype"));
    request.set_dtype(dtype);
  }
  request.mutable_safetensors()->set_path(source.path);
  request.mutable_safetensors()->set_weight_name(source.weight_name);
  request.mutable_safetensors()->set_bias_name(source.bias_name);
  request.set_frozen(source.frozen);
  RETURN_IF_ERROR(SetGradDtype(source.grad_dtype, "source.grad_dtype", &request));
  return request;
}

v1::OptimizerStepRequest ToOptimizerStepRequest(const std::string& head_id,
                                                const OptimizerStepOptions& options) {
  v1::OptimizerStepRequest request;
  request.set_head_id(head_id);
  if (const Sgd* sgd = std::get_if<Sgd>(&options.optimizer)) {
    request.mutable_sgd()->set_lr(sgd->lr);
    request.mutable_sgd()->set_momentum(sgd->momentum);
    request.mutable_sgd()->set_weight_decay(sgd->weight_decay);
  } else {
    const AdamW& adamw = std::get<AdamW>(options.optimizer);
    request.mutable_adamw()->set_lr(adamw.lr);
    request.mutable_adamw()->set_beta1(adamw.beta1);
    request.mutable_adamw()->set_beta2(adamw.beta2);
    request.mutable_adamw()->set_eps(adamw.eps);
    request.mutable_adamw()->set_weight_decay(adamw.weight_decay);
  }
  if (options.grad_scale.has_value()) request.set_grad_scale(*options.grad_scale);
  request.set_zero_gradients(options.zero_gradients);
  request.set_expected_incarnation(options.expected_incarnation);
  if (options.expected_weight_version.has_value()) {
    request.set_expected_weight_version(*options.expected_weight_version);
  }
  if (options.synchronous.has_value()) {
    v1::SynchronousStep* sync = request.mutable_synchronous();
    sync->set_step(options.synchronous->step);
    sync->set_rank(options.synchronous->rank);
    sync->set_world_size(options.synchronous->world_size);
  }
  return request;
}

absl::Status SetIds(const torch::Tensor& ids, const char* field,
                    google::protobuf::RepeatedField<int64_t>* out) {
  if (!ids.defined() || ids.dim() != 1 || ids.scalar_type() != torch::kLong) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected int64 token ids [n]; got ",
                                                   ids.defined() ? ShapeOf(ids) : "none"));
  }
  const torch::Tensor cpu = ids.cpu().contiguous();
  out->Add(cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel());
  return absl::OkStatus();
}

absl::StatusOr<HeadInfo> DescribeForStream(Stub& stub, const grpc::ClientContext& attempt_context,
                                           const std::string& head_id) {
  grpc::ClientContext context;
  context.set_deadline(attempt_context.deadline());
  v1::HeadRef ref;
  ref.set_head_id(head_id);
  v1::HeadInfo info;
  RETURN_IF_ERROR(FromGrpc(stub.DescribeHead(&context, ref, &info)));
  return FromWire(info);
}

}  // namespace remotehead::client::internal
