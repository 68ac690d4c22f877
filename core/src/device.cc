#include "remotehead/core/device.h"

#include <cstdint>
#include <optional>

#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::core {

absl::Status CheckDeviceOnMachine(const torch::Device& device, const std::string& field) {
  if (!device.is_cuda()) return absl::OkStatus();
  if (!torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": expected an available device; got ", device.str(),
                     " but CUDA is not available on this machine"));
  }
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  const int64_t index = device.has_index() ? device.index() : 0;
  if (index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": expected an available device (cuda:0 to cuda:", count - 1, "); got ",
                     device.str(), " but this machine has ", count, " CUDA device(s)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Device> ResolveDevice(const std::string& name, const std::string& field) {
  if (name == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0)
                                       : torch::Device(torch::kCPU);
  }
  std::optional<torch::Device> device;
  if (name == "cpu" || name == "cuda" || name.starts_with("cuda:")) {
    try {
      device = torch::Device(name);
    } catch (const c10::Error&) {
      // reported below, as any other name
    }
  }
  if (!device.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected auto, cpu, cuda or cuda:N; got \"", name, "\""));
  }
  if (device->is_cuda() && !device->has_index()) device = torch::Device(torch::kCUDA, 0);
  RETURN_IF_ERROR(CheckDeviceOnMachine(*device, field));
  return *device;
}

}  // namespace remotehead::core
