// The copies between the host and a CUDA head's device that a server makes for every batch of a
// request — its rows in, its dX out — made off the compute stream, so that neither the compute
// thread nor the GPU waits for them: the rows of one batch are copied in (on the device's inbound
// copy stream, from page-locked host memory where they were staged) while the batch before
// computes, and a batch's dX is copied out (into page-locked host memory, on the outbound copy
// stream) while the next one computes; the host waits for a copy only where it reads the bytes
// (HostCopy::WhenLanded).
//
// On the CPU none of this costs anything: ToDevice and HostCopy::Start return their tensor as it
// is (or in the wire's layout), and a HostCopy has landed at once.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "remotehead/core/token_batch.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

struct CopyEvent;  // where a copy is done (a CUDA event; device_transfer.cc)

// The batch on `device` (what TokenBatch::To gives). To a CUDA device: every tensor copied on the
// device's inbound copy stream (asynchronously from page-locked memory), which the current stream
// then waits for by an event — so the host never waits for the compute stream's work, only, for a
// tensor in pageable memory, for its own copy to be staged. Otherwise batch.To(device).
TokenBatch ToDevice(const TokenBatch& batch, const torch::Device& device);
// One tensor the same way.
torch::Tensor ToDevice(const torch::Tensor& t, const torch::Device& device);

// A tensor on its way to the host, contiguous and in `dtype`: on a CUDA device, copied into
// page-locked host memory on the outbound copy stream once the work queued so far on the current
// stream is done; on the CPU, the tensor itself (made contiguous or converted only if it is not
// already so).
class HostCopy {
 public:
  HostCopy() = default;  // nothing: host() undefined, landed
  static HostCopy Start(const torch::Tensor& t, std::optional<torch::ScalarType> dtype = {});

  // The host tensor. Its memory exists at once; its values only once landed().
  const torch::Tensor& host() const { return host_; }
  // Whether the copy has completed (never blocks).
  bool landed() const;
  // Runs `then` once the copy has completed: here and now if it has, else on the thread that
  // waits for the process's copies. `then` must not throw.
  void WhenLanded(std::function<void()> then) const;

 private:
  torch::Tensor host_;
  std::shared_ptr<CopyEvent> done_;  // null: landed
};

}  // namespace remotehead::core
