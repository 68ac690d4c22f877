// Device names as flags and requests give them, resolved in one place for every binary (the
// server, the benchmarks) and checked against the machine before anything is allocated there.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

// "auto" (cuda:0 when the machine has a GPU, else the CPU), "cpu", "cuda" (cuda:0) or "cuda:N".
// InvalidArgument for any other name, FailedPrecondition for a CUDA device this machine lacks;
// both messages start with `field`.
absl::StatusOr<torch::Device> ResolveDevice(const std::string& name, const std::string& field);

// OK when `device` is on this machine (the CPU always; cuda:N when N < the GPU count);
// FailedPrecondition naming `field`, the device and what the machine has otherwise.
absl::Status CheckDeviceOnMachine(const torch::Device& device, const std::string& field);

}  // namespace remotehead::core
