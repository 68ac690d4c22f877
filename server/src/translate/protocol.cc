#include "translate/protocol.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"
#include "service/head_expectations.h"

namespace remotehead::server {

absl::Status ToWire(const HeadDescription& d, v1::HeadInfo* info) {
  info->set_head_id(d.id);
  info->set_vocab_size(d.vocab_size);
  info->set_hidden_size(d.hidden_size);
  ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(d.dtype, "head.dtype"));
  info->set_dtype(dtype);
  ASSIGN_OR_RETURN(const v1::DType grad_dtype, wire::ToWireDtype(d.grad_dtype, "head.grad_dtype"));
  info->set_grad_dtype(grad_dtype);
  info->set_has_bias(d.has_bias);
  info->set_device(d.device);
  info->set_weight_version(d.weight_version);
  info->set_accumulated_micro_batches(d.accumulated_micro_batches);
  info->set_incarnation(ServerIncarnation());
  info->set_state_id(d.state_id);
  info->set_group_size(d.shards.empty() ? 1 : static_cast<int32_t>(d.shards.size()));
  for (const core::ShardRange& range : d.shards) {
    v1::ShardRange* shard = info->add_shards();
    shard->set_offset(range.offset);
    shard->set_rows(range.rows);
  }
  info->set_frozen(d.frozen);
  for (const std::string& student : d.teacher_of) info->add_teacher_of(student);
  return absl::OkStatus();
}

namespace {

v1::OutputKind ToWire(core::OutputKind kind) {
  switch (kind) {
    case core::OutputKind::kPerToken:
      return v1::OUTPUT_KIND_PER_TOKEN;
    case core::OutputKind::kLogits:
      return v1::OUTPUT_KIND_LOGITS;
    case core::OutputKind::kSample:
      return v1::OUTPUT_KIND_SAMPLE;
  }
  return v1::OUTPUT_KIND_UNSPECIFIED;
}

void ToWire(const core::ParamSpec& spec, bool common, v1::FunctionParameter* param) {
  param->set_name(spec.name);
  param->set_default_value(spec.default_value);
  param->set_min_value(spec.min_value);
  param->set_max_value(spec.max_value);
  param->set_help(spec.help);
  param->set_common(common);
}

}  // namespace

absl::Status ToWire(const core::FunctionRegistry& registry, v1::ListFunctionsResponse* response) {
  for (const core::TransformFunction* fn : registry.Functions()) {
    v1::FunctionDescription* d = response->add_functions();
    d->set_name(fn->name);
    d->set_help(fn->help);
    d->set_needs_targets(fn->needs_targets);
    for (const std::string& name : fn->required_aux) d->add_required_aux(name);
    for (const std::string& name : fn->optional_aux) d->add_optional_aux(name);
    for (const core::ParamSpec& spec : fn->params) ToWire(spec, false, d->add_params());
    for (const core::ParamSpec& spec : core::FunctionRegistry::CommonParams()) {
      ToWire(spec, true, d->add_params());
    }
    d->set_output_kind(ToWire(fn->output));
    // The rule of core::OutputDtype, read off it: the dtype on a float32 head (the logits'
    // default dtype), and whether a float64 head changes it.
    const torch::ScalarType usual = core::OutputDtype(fn->output, torch::kFloat, torch::kFloat);
    ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(usual, "output_dtype"));
    d->set_output_dtype(dtype);
    d->set_output_float64_on_float64_heads(
        core::OutputDtype(fn->output, torch::kDouble, torch::kFloat) == torch::kDouble);
    d->set_differentiable(fn->output == core::OutputKind::kPerToken);
    d->set_vocab_decomposable(fn->vocab_decomposable);
    d->set_needs_teacher(fn->needs_teacher);
    d->set_ignored_rows_contribute_nothing(fn->ignored_rows_contribute_nothing);
    // Aux inputs of k values per row (a sparse teacher's top-k), and those of an integer dtype,
    // in the order the function lists its aux.
    std::vector<std::string> aux = fn->required_aux;
    aux.insert(aux.end(), fn->optional_aux.begin(), fn->optional_aux.end());
    for (const std::string& name : aux) {
      const core::AuxKind kind = fn->aux_kind(name);
      if (kind == core::AuxKind::kTopkIds || kind == core::AuxKind::kTopkValues) {
        d->add_topk_aux(name);
      }
      if (kind == core::AuxKind::kTopkIds || kind == core::AuxKind::kPerTokenIds) {
        d->add_integral_aux(name);
      }
    }
    for (const core::ExtraSpec& extra : fn->extras) {
      v1::FunctionExtra* e = d->add_extras();
      e->set_name(extra.name);
      e->set_help(extra.help);
      e->set_when_param(extra.when_param);
      e->set_when_aux(extra.when_aux);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<torch::ScalarType>> OptionalDtype(v1::DType dtype,
                                                               const std::string& field) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return std::nullopt;
  ASSIGN_OR_RETURN(const torch::ScalarType t, wire::FromWireDtype(dtype, field));
  return t;
}

absl::StatusOr<HeadTraits> TraitsFromWire(bool frozen, v1::DType grad_dtype,
                                          const std::string& field_prefix) {
  HeadTraits traits{.frozen = frozen};
  ASSIGN_OR_RETURN(traits.grad_dtype,
                   OptionalDtype(grad_dtype, absl::StrCat(field_prefix, "grad_dtype")));
  return traits;
}

core::HeadInit FromWire(const v1::CreateHeadRequest::FromInit& init, torch::ScalarType dtype) {
  core::HeadInit head_init{.vocab_size = init.vocab_size(),
                           .hidden_size = init.hidden_size(),
                           .dtype = dtype,
                           .bias = init.bias(),
                           .seed = init.seed()};
  if (init.init_std() != 0) head_init.init_std = init.init_std();
  return head_init;
}

SafetensorsSource FromWire(const v1::CreateHeadRequest::FromSafetensors& src,
                           std::optional<torch::ScalarType> dtype) {
  SafetensorsSource source{.path = src.path(), .bias_name = src.bias_name(), .dtype = dtype};
  if (!src.weight_name().empty()) source.weight_name = src.weight_name();
  return source;
}

absl::StatusOr<OptimizerStepSpec> FromWire(const v1::OptimizerStepRequest& request) {
  OptimizerStepSpec spec{.grad_scale = request.has_grad_scale() ? request.grad_scale() : 1.0,
                         .zero_gradients = request.zero_gradients()};
  spec.expected_weight_version = ExpectedWeightVersion(request);
  switch (request.optimizer_case()) {
    case v1::OptimizerStepRequest::kSgd: {
      const auto& o = request.sgd();
      spec.optimizer = core::SgdOptions{
          .lr = o.lr(), .momentum = o.momentum(), .weight_decay = o.weight_decay()};
      return spec;
    }
    case v1::OptimizerStepRequest::kAdamw: {
      const auto& o = request.adamw();
      core::AdamWOptions options{.lr = o.lr(), .weight_decay = o.weight_decay()};
      // Unset (0) betas and eps take torch.optim.AdamW's defaults.
      if (o.beta1() != 0) options.beta1 = o.beta1();
      if (o.beta2() != 0) options.beta2 = o.beta2();
      if (o.eps() != 0) options.eps = o.eps();
      spec.optimizer = options;
      return spec;
    }
    default:
      return absl::InvalidArgumentError("optimizer: expected sgd or adamw; got none");
  }
}

}  // namespace remotehead::server
