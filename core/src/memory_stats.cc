#include "remotehead/core/memory_stats.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include <c10/core/CPUAllocator.h>

#ifdef REMOTEHEAD_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "absl/strings/str_cat.h"

namespace remotehead::core {
namespace {

// Delegates to the allocator it replaces and keeps live / peak byte counts.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    Add(static_cast<int64_t>(n));
    auto* ctx = new Allocation{std::move(inner), n, this};
    return {data, ctx, &Release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

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
    CountingCpuAllocator* owner;
  };

  static void Release(void* ctx) {
    auto* a = static_cast<Allocation*>(ctx);
    a->owner->Add(-static_cast<int64_t>(a->bytes));
    delete a;  // frees the memory through the wrapped allocator's deleter
  }

  void Add(int64_t delta) {
    const int64_t now = live_.fetch_add(delta) + delta;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  c10::Allocator* base_;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

std::atomic<CountingCpuAllocator*> g_cpu_tracker{nullptr};

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
    const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
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

}  // namespace remotehead::core
