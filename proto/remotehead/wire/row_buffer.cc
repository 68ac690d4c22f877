#include "remotehead/wire/row_buffer.h"

#include <sys/mman.h>

#include <cstddef>
#include <deque>
#include <mutex>
#include <utility>

namespace remotehead::wire {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// Mappings given back, kept for the next buffer of the same size: a fresh mapping costs, on its
// first write, a page fault and the kernel's zeroing of every page (a 128 MiB dX: 128 MiB
// zeroed per call, a tenth of the call's CPU on 2 cores), a recycled one neither. At most
// kKeptBytes are kept, the least recently given back unmapped first.
class RecycledMappings {
 public:
  static constexpr size_t kKeptBytes = size_t{256} << 20;

  void* Take(size_t mapped) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
      if (it->second != mapped) continue;
      void* base = it->first;
      kept_.erase(std::next(it).base());
      kept_bytes_ -= mapped;
      return base;
    }
    return nullptr;
  }

  void Give(void* base, size_t mapped) {
    std::deque<std::pair<void*, size_t>> unmap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (mapped > kKeptBytes) {
        unmap.emplace_back(base, mapped);
      } else {
        kept_.emplace_back(base, mapped);
        kept_bytes_ += mapped;
        while (kept_bytes_ > kKeptBytes) {
          unmap.push_back(kept_.front());
          kept_bytes_ -= kept_.front().second;
          kept_.pop_front();
        }
      }
    }
    for (const auto& [b, n] : unmap) munmap(b, n);
  }

 private:
  std::mutex mu_;
  std::deque<std::pair<void*, size_t>> kept_;  // (base, mapped bytes), oldest first
  size_t kept_bytes_ = 0;
};

// Never destroyed: buffers may be given back while the process exits.
RecycledMappings& Recycled() {
  static auto* recycled = new RecycledMappings;
  return *recycled;
}

}  // namespace

torch::Tensor EmptyRows(const std::vector<int64_t>& sizes, torch::ScalarType dtype) {
  int64_t elements = 1;
  for (const int64_t s : sizes) elements *= s;
  const size_t bytes = static_cast<size_t>(elements) * c10::elementSize(dtype);
  if (bytes < kHugePage) return torch::empty(sizes, dtype);
  // Mapped with one huge page to spare, so that an aligned start can be cut out of it.
  const size_t mapped = (bytes + kHugePage - 1) / kHugePage * kHugePage + kHugePage;
  void* base = Recycled().Take(mapped);
  if (base == nullptr) {
    base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return torch::empty(sizes, dtype);
  }
  const auto start = reinterpret_cast<uintptr_t>(base);
  void* aligned = reinterpret_cast<void*>((start + kHugePage - 1) / kHugePage * kHugePage);
  madvise(aligned, mapped - (reinterpret_cast<uintptr_t>(aligned) - start), MADV_HUGEPAGE);
  return torch::from_blob(
      aligned, sizes, [base, mapped](void*) { Recycled().Give(base, mapped); },
      torch::TensorOptions().dtype(dtype));
}

}  // namespace remotehead::wire
