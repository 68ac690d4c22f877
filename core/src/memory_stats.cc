#include "remotehead/core/memory_stats.h"

#include <c10/core/CPUAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#ifdef REMOTEHEAD_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/str_cat.h"

namespace remotehead::core {
namespace {

// Delegates to the allocator it replaces and keeps live / peak byte counts. Each allocation's
// context is its data pointer (what c10's raw_allocate / raw_deallocate require, e.g. for
// oneDNN's bf16 matmuls), so the wrapped allocation is kept in a map keyed by that pointer.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero-byte allocations hold no memory
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_allocations_.emplace(data, Allocation{std::move(inner), n});
    }
    Add(static_cast<int64_t>(n));
    return {data, data, &Release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void ResetPeak() { peak_.store(live_.load()); }

 private:
  struct Allocation {
    c10::DataPtr inner;
    size_t bytes;
  };

  static void Release(void* data);

  void Free(void* data) {
    Allocation allocation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_allocations_.find(data);
      if (it == live_allocations_.end()) return;
      allocation = std::move(it->second);
      live_allocations_.erase(it);
    }
    Add(-static_cast<int64_t>(allocation.bytes));
    // `allocation.inner` frees the memory through the wrapped allocator's deleter here.
  }

  void Add(int64_t delta) {
    const int64_t now = live_.fetch_add(delta) + delta;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  c10::Allocator* base_;
  std::mutex mu_;
  std::unordered_map<void*, Allocation> live_allocations_;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

std::atomic<CountingCpuAllocator*> g_cpu_tracker{nullptr};

void CountingCpuAllocator::Release(void* data) { g_cpu_tracker.load()->Free(data); }

}  // namespace

void InstallCpuMemoryTracker() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never freed: tensors may outlive any scope and call back into it at exit.
    auto* tracker = new CountingCpuAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(tracker, /*priority=*/100);
    g_cpu_tracker.store(tracker);
  });
}

absl::StatusOr<MemoryStats> GetMemoryStats(const torch::Device& device) {
  MemoryStats stats;
  if (device.is_cpu()) {
    const CountingCpuAllocator* tracker = g_cpu_tracker.load();
    if (tracker == nullptr) {
      return absl::FailedPreconditionError(
          "memory stats for cpu: expected InstallCpuMemoryTracker() at start-up; not installed");
    }
    stats.allocated_bytes = tracker->live();
    stats.reserved_bytes = tracker->live();
    stats.peak_allocated_bytes = tracker->peak();
    return stats;
  }
#ifdef REMOTEHEAD_TORCH_HAS_CUDA
  if (device.is_cuda() && torch::cuda::is_available()) {
    const auto s =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    constexpr size_t kAggregate = 0;  // StatType::AGGREGATE
    stats.allocated_bytes = s.allocated_bytes[kAggregate].current;
    stats.reserved_bytes = s.reserved_bytes[kAggregate].current;
    stats.peak_allocated_bytes = s.allocated_bytes[kAggregate].peak;
    return stats;
  }
#endif
  return absl::InvalidArgumentError(
      absl::StrCat("device: expected cpu or an available cuda device; got ", device.str()));
}

absl::Status ResetPeakMemory(const torch::Device& device) {
  if (device.is_cpu()) {
    CountingCpuAllocator* tracker = g_cpu_tracker.load();
    if (tracker == nullptr) {
      return absl::FailedPreconditionError(
          "memory stats for cpu: expected InstallCpuMemoryTracker() at start-up; not installed");
    }
    tracker->ResetPeak();
    return absl::OkStatus();
  }
#ifdef REMOTEHEAD_TORCH_HAS_CUDA
  if (device.is_cuda() && torch::cuda::is_available()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
    return absl::OkStatus();
  }
#endif
  return absl::InvalidArgumentError(
      absl::StrCat("device: expected cpu or an available cuda device; got ", device.str()));
}

absl::StatusOr<int64_t> AvailableMemoryBytes(const torch::Device& device) {
  if (device.is_cpu()) {
    return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  }
#ifdef REMOTEHEAD_TORCH_HAS_CUDA
  if (device.is_cuda() && torch::cuda::is_available()) {
    c10::cuda::CUDAGuard guard(device.index() < 0 ? 0 : device.index());
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMemGetInfo failed on ", device.str()));
    }
    return static_cast<int64_t>(free_bytes);
  }
#endif
  return absl::InvalidArgumentError(
      absl::StrCat("device: expected cpu or an available cuda device; got ", device.str()));
}

std::string FormatMiB(int64_t bytes) {
  return absl::StrCat(static_cast<double>(bytes) / (1 << 20), " MiB");
}

}  // namespace remotehead::core
