#include "translate/group_commands.h"

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/wire/tensor_codec.h"

namespace remotehead::server {
v1::DType GroupWireDtype(torch::ScalarType dtype) {
  // Every dtype a head or a batch tensor can have has a wire value.
  return wire::ToWireDtype(dtype, "dtype").value_or(v1::DTYPE_UNSPECIFIED);
}

v1::GroupPin PinToWire(const HeadPin& pin) {
  v1::GroupPin wire;
  wire.set_weight_version(pin.weight_version);
  wire.set_gradient_window(pin.gradient_window);
  return wire;
}

HeadPin PinFromWire(const v1::GroupPin& pin) {
  return {.weight_version = pin.weight_version(), .gradient_window = pin.gradient_window()};
}

v1::GroupTensor DescribeTensor(const std::string& name, const torch::Tensor& t) {
  v1::GroupTensor spec;
  spec.set_name(name);
  spec.set_dtype(GroupWireDtype(t.scalar_type()));
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
