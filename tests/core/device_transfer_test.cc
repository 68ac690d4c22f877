// The host <-> device copies of a server's rows (core/device_transfer.h). On the CPU they cost
// nothing: the tensors themselves come back, no copy, landed at once, and what waits on a copy
// runs on the spot. On a CUDA device (skipped without one): a batch's rows (page-locked or not)
// arrive on the inbound stream before the compute stream reads them; dX lands in page-locked host
// memory off the compute stream, and what waits on it runs once (when it has landed) — even when
// the device tensor is freed and its memory reused right after the copy was started.
#include "remotehead/core/device_transfer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "support/devices.h"

namespace remotehead {
namespace {

TEST(DeviceTransferOnCpu, ToDeviceIsTheTensorsThemselves) {
  const torch::Tensor t = torch::randn({5, 3});
  EXPECT_TRUE(core::ToDevice(t, torch::kCPU).is_same(t));
  EXPECT_FALSE(core::ToDevice(torch::Tensor(), torch::kCPU).defined());
  const core::TokenBatch batch{
      .hidden = t, .targets = torch::arange(5), .aux = {{"advantages", torch::ones({5})}}};
  const core::TokenBatch same = core::ToDevice(batch, torch::kCPU);
  EXPECT_TRUE(same.hidden.is_same(batch.hidden));
  EXPECT_TRUE(same.targets.is_same(batch.targets));
  EXPECT_TRUE(same.aux.at("advantages").is_same(batch.aux.at("advantages")));
  EXPECT_FALSE(same.weights.defined());
}

TEST(DeviceTransferOnCpu, HostCopyOfAContiguousTensorIsItsMemoryAndHasLanded) {
  const torch::Tensor t = torch::randn({7, 4});
  const core::HostCopy copy = core::HostCopy::Start(t);
  EXPECT_EQ(copy.host().data_ptr(), t.data_ptr());  // no copy
  EXPECT_TRUE(copy.landed());
  const std::thread::id here = std::this_thread::get_id();
  std::thread::id ran_on;
  copy.WhenLanded([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, here);  // at once, on the calling thread
  EXPECT_TRUE(core::HostCopy().landed());
}

TEST(DeviceTransferOnCpu, HostCopyMakesTheWiresLayoutOnlyWhenNeeded) {
  const torch::Tensor t = torch::randn({6, 5});
  const core::HostCopy transposed = core::HostCopy::Start(t.t());
  EXPECT_TRUE(transposed.host().is_contiguous());
  EXPECT_TRUE(torch::equal(transposed.host(), t.t()));
  const core::HostCopy halved = core::HostCopy::Start(t, torch::kBFloat16);
  EXPECT_EQ(halved.host().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(halved.host(), t.to(torch::kBFloat16)));
}

class DeviceTransferOnCuda : public ::testing::Test {
 protected:
  void SetUp() override { REMOTEHEAD_SKIP_UNLESS_ON_MACHINE(torch::Device("cuda:0")); }
  const torch::Device cuda_{"cuda:0"};
};

// Page-locked hidden rows and pageable targets, as a server's staged batch has them, while the
// compute stream is busy with the batch before.
TEST_F(DeviceTransferOnCuda, RowsArriveBeforeTheComputeStreamReadsThem) {
  torch::Tensor busy = torch::randn({4096, 4096}, torch::TensorOptions(cuda_));
  for (int round = 0; round < 20; ++round) {
    busy = busy.matmul(busy).tanh_();  // the batch before, still running
    const core::TokenBatch host{
        .hidden = torch::arange(1 << 20, torch::kFloat).add(round).view({1024, 1024}).pin_memory(),
        .targets = torch::arange(1024).add(round)};
    const core::TokenBatch on_device = core::ToDevice(host, cuda_);
    ASSERT_TRUE(on_device.hidden.is_cuda() && on_device.targets.is_cuda());
    // Read on the compute stream right away, with no host synchronisation in between.
    EXPECT_TRUE(torch::equal(on_device.hidden.cpu(), host.hidden));
    EXPECT_TRUE(torch::equal(on_device.targets.cpu(), host.targets));
  }
}

TEST_F(DeviceTransferOnCuda, DxLandsOffTheComputeStreamEvenWhenItsMemoryIsReusedAtOnce) {
  std::vector<torch::Tensor> expected;
  std::vector<core::HostCopy> copies;
  for (int i = 0; i < 8; ++i) {
    torch::Tensor dx = torch::randn({2048, 1024}, torch::TensorOptions(cuda_));  // 8 MiB
    expected.push_back(dx.to(torch::kCPU));
    copies.push_back(core::HostCopy::Start(dx * 2.0));  // a temporary: freed right away
    // The freed memory handed out again and overwritten on the compute stream.
    torch::Tensor reuse = torch::empty({2048, 1024}, torch::TensorOptions(cuda_));
    reuse.fill_(-7.0);
  }
  std::mutex mu;
  std::vector<int> order;
  std::atomic<int> done{0};
  for (int i = 0; i < static_cast<int>(copies.size()); ++i) {
    EXPECT_TRUE(copies[i].host().is_pinned());
    copies[i].WhenLanded([&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
      ++done;
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (done.load() < static_cast<int>(copies.size()) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(done.load(), static_cast<int>(copies.size()));
  std::sort(order.begin(), order.end());
  EXPECT_EQ(std::unique(order.begin(), order.end()), order.end());  // each ran once
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_TRUE(copies[i].landed());
    EXPECT_TRUE(torch::equal(copies[i].host(), expected[i] * 2.0)) << "copy " << i;
  }
}

}  // namespace
}  // namespace remotehead
