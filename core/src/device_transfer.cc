#include "remotehead/core/device_transfer.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#ifdef REMOTEHEAD_TORCH_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace remotehead::core {

struct CopyEvent {
#ifdef REMOTEHEAD_TORCH_HAS_CUDA
  at::cuda::CUDAEvent event;
  void Wait() { event.synchronize(); }
  bool Done() { return event.query(); }
#else
  void Wait() {}
  bool Done() { return true; }
#endif
};

namespace {

#ifdef REMOTEHEAD_TORCH_HAS_CUDA
enum class Direction { kIn, kOut };

// One stream per device and direction, for the life of the process: copies in one direction
// stay in order, and the two directions use the device's two copy engines at once.
c10::cuda::CUDAStream CopyStream(c10::DeviceIndex device, Direction direction) {
  static std::mutex mu;
  static std::map<std::pair<c10::DeviceIndex, Direction>, c10::cuda::CUDAStream>* streams =
      new std::map<std::pair<c10::DeviceIndex, Direction>, c10::cuda::CUDAStream>();
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(device, direction);
  auto it = streams->find(key);
  if (it == streams->end()) {
    it =
        streams->emplace(key, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)).first;
  }
  return it->second;
}

c10::DeviceIndex CudaIndexOf(const torch::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}
#endif

// The thread that waits for the process's outbound copies and runs what waits on them. Never
// destroyed: it may be waiting when the process exits.
class CopyWaiter {
 public:
  static CopyWaiter& Get() {
    static CopyWaiter* waiter = new CopyWaiter();
    return *waiter;
  }
  void Add(std::shared_ptr<CopyEvent> event, std::function<void()> then) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(std::move(event), std::move(then));
    }
    cv_.notify_one();
  }

 private:
  CopyWaiter() : thread_([this] { Loop(); }) { thread_.detach(); }
  void Loop() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return !queue_.empty(); });
      auto [event, then] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      event->Wait();
      then();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<CopyEvent>, std::function<void()>>> queue_;
  std::thread thread_;
};

}  // namespace

TokenBatch ToDevice(const TokenBatch& batch, const torch::Device& device) {
#ifdef REMOTEHEAD_TORCH_HAS_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex index = CudaIndexOf(device);
    const torch::Device cuda(torch::kCUDA, index);
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(index);
    const c10::cuda::CUDAStream in = CopyStream(index, Direction::kIn);
    TokenBatch out;
    {
      const c10::cuda::CUDAStreamGuard guard(in);
      out = batch.Map([&](const torch::Tensor& t) {
        return t.to(cuda, /*non_blocking=*/t.device().is_cpu() && t.is_pinned());
      });
    }
    at::cuda::CUDAEvent arrived;
    arrived.record(in);
    arrived.block(compute);
    // Made on the inbound stream, used and freed on the compute stream: their memory is not
    // handed out again before the compute stream is past its last use.
    out.Map([&](const torch::Tensor& t) {
      t.record_stream(compute);
      return t;
    });
    return out;
  }
#endif
  return batch.To(device);
}

torch::Tensor ToDevice(const torch::Tensor& t, const torch::Device& device) {
  return ToDevice(TokenBatch{.hidden = t}, device).hidden;
}

HostCopy HostCopy::Start(const torch::Tensor& t, std::optional<torch::ScalarType> dtype) {
  HostCopy copy;
  const torch::ScalarType to = dtype.value_or(t.scalar_type());
#ifdef REMOTEHEAD_TORCH_HAS_CUDA
  if (t.device().is_cuda()) {
    const c10::DeviceIndex index = t.device().index();
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(index);
    const c10::cuda::CUDAStream out = CopyStream(index, Direction::kOut);
    const torch::Tensor source = t.detach().to(to).contiguous();  // on the compute stream
    at::cuda::CUDAEvent computed;
    computed.record(compute);
    computed.block(out);
    copy.host_ = torch::empty(source.sizes(), torch::TensorOptions().dtype(to).pinned_memory(true));
    {
      const c10::cuda::CUDAStreamGuard guard(out);
      copy.host_.copy_(source, /*non_blocking=*/true);
    }
    // The source's memory is not handed out again before the outbound stream is past the copy.
    source.record_stream(out);
    copy.done_ = std::make_shared<CopyEvent>();
    copy.done_->event.record(out);
    return copy;
  }
#endif
  copy.host_ = t.detach().to(torch::kCPU, to).contiguous();
  return copy;
}

bool HostCopy::landed() const { return done_ == nullptr || done_->Done(); }

void HostCopy::WhenLanded(std::function<void()> then) const {
  if (landed()) {
    then();
    return;
  }
  CopyWaiter::Get().Add(done_, std::move(then));
}

}  // namespace remotehead::core
