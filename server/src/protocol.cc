#include "protocol.h"

#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::server {

absl::Status ToWire(const HeadDescription& d, v1::HeadInfo* info) {
  info->set_head_id(d.id);
  info->set_vocab_size(d.vocab_size);
  info->set_hidden_size(d.hidden_size);
  ASSIGN_OR_RETURN(const v1::DType dtype, wire::ToWireDtype(d.dtype, "head.dtype"));
  info->set_dtype(dtype);
  info->set_has_bias(d.has_bias);
  info->set_device(d.device);
  info->set_weight_version(d.weight_version);
  info->set_accumulated_micro_batches(d.accumulated_micro_batches);
  return absl::OkStatus();
}

absl::StatusOr<std::optional<torch::ScalarType>> OptionalDtype(v1::DType dtype,
                                                               const std::string& field) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return std::nullopt;
  ASSIGN_OR_RETURN(const torch::ScalarType t, wire::FromWireDtype(dtype, field));
  return t;
}

}  // namespace remotehead::server
