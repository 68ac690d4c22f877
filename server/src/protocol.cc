#include "protocol.h"

#include "absl/strings/str_cat.h"
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
  info->set_incarnation(ServerIncarnation());
  info->set_state_id(d.state_id);
  return absl::OkStatus();
}

absl::Status CheckIncarnation(const std::string& expected, const std::string& field,
                              const HeadDescription& head) {
  if (expected.empty() || expected == ServerIncarnation()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      field, ": expected the server process \"", expected, "\"; got \"", ServerIncarnation(),
      "\": the server restarted, and the dW and gradient ids accumulated before are gone. Head \"",
      head.id, "\" is at version ", head.weight_version,
      head.restored_version.has_value()
          ? absl::StrCat(" (restored from its saved state \"", head.state_id, "\" at version ",
                         *head.restored_version, ")")
          : std::string(" (not restored: the server has no saved state of it)"),
      ". Resume from the trainer checkpoint of that version"));
}

absl::StatusOr<std::optional<torch::ScalarType>> OptionalDtype(v1::DType dtype,
                                                               const std::string& field) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return std::nullopt;
  ASSIGN_OR_RETURN(const torch::ScalarType t, wire::FromWireDtype(dtype, field));
  return t;
}

}  // namespace remotehead::server
