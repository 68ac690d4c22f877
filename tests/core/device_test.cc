// Device names, resolved in one place for the server and the benchmarks: the accepted
// spellings, and precise errors for a name that is not a device or a device the machine lacks.
#include "remotehead/core/device.h"

#include <gtest/gtest.h>

namespace remotehead {
namespace {

TEST(ResolveDevice, AcceptsCpuAndAuto) {
  EXPECT_EQ(*core::ResolveDevice("cpu", "--device"), torch::Device(torch::kCPU));
  EXPECT_EQ(*core::ResolveDevice("auto", "--device"), torch::cuda::is_available()
                                                          ? torch::Device(torch::kCUDA, 0)
                                                          : torch::Device(torch::kCPU));
}

TEST(ResolveDevice, NamesThatAreNotDevicesAreInvalid) {
  for (const std::string name : {"gpu", "cuda:x", "cuda:-1", "", "CPU", "tpu:0"}) {
    auto device = core::ResolveDevice(name, "--device");
    ASSERT_FALSE(device.ok()) << name;
    EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(device.status().message(),
              "--device: expected auto, cpu, cuda or cuda:N; got \"" + name + "\"");
  }
}

TEST(ResolveDevice, CudaDeviceTheMachineLacksIsAFailedPrecondition) {
  auto device = core::ResolveDevice("cuda:63", "device");
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
  if (torch::cuda::is_available()) {
    const int count = static_cast<int>(torch::cuda::device_count());
    EXPECT_EQ(device.status().message(),
              "device: expected an available device (cuda:0 to cuda:" + std::to_string(count - 1) +
                  "); got cuda:63 but this machine has " + std::to_string(count) +
                  " CUDA device(s)");
  } else {
    EXPECT_EQ(device.status().message(),
              "device: expected an available device; got cuda:63 but CUDA is not available on "
              "this machine");
  }
}

TEST(ResolveDevice, CudaNamesResolveToAnIndexedDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  EXPECT_EQ(*core::ResolveDevice("cuda", "--device"), torch::Device(torch::kCUDA, 0));
  const int last = static_cast<int>(torch::cuda::device_count()) - 1;
  EXPECT_EQ(*core::ResolveDevice("cuda:" + std::to_string(last), "--device"),
            torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(last)));
}

}  // namespace
}  // namespace remotehead
