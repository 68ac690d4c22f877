// The devices the device-parametrised tests run on: the CPU always, and the first CUDA device
// always listed too, so that on a machine without a GPU the CUDA half of every such test shows
// up as skipped (with the reason) instead of silently missing from the counts.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "remotehead/core/torch_api.h"

namespace remotehead::testing {

inline std::vector<std::string> TestDevices() { return {"cpu", "cuda:0"}; }

// "cpu" / "cuda": the suffix of a parametrised test's name.
inline std::string DeviceLabel(const std::string& device) {
  return torch::Device(device).is_cuda() ? "cuda" : "cpu";
}

// Empty when tests can run on `device`; otherwise why not, for GTEST_SKIP.
inline std::string UnavailableReason(const torch::Device& device) {
  if (!device.is_cuda()) return "";
  if (!torch::cuda::is_available()) return "no CUDA device on this machine (CUDA half skipped)";
  if (device.index() >= static_cast<int64_t>(torch::cuda::device_count())) {
    return "cuda:" + std::to_string(device.index()) + " is not on this machine";
  }
  return "";
}

}  // namespace remotehead::testing

// In a test body or SetUp: skips the test when `device` is not on this machine.
#define REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(device)                                                 \
  do {                                                                                            \
    if (const std::string why = ::remotehead::testing::UnavailableReason(device); !why.empty()) { \
      GTEST_SKIP() << why;                                                                        \
    }                                                                                             \
  } while (0)
