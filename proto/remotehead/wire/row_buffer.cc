#include "remotehead/wire/row_buffer.h"

#include <sys/mman.h>

#include <cstddef>

namespace remotehead::wire {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

torch::Tensor EmptyRows(const std::vector<int64_t>& sizes, torch::ScalarType dtype) {
  int64_t elements = 1;
  for (const int64_t s : sizes) elements *= s;
  const size_t bytes = static_cast<size_t>(elements) * c10::elementSize(dtype);
  if (bytes < kHugePage) return torch::empty(sizes, dtype);
  // Mapped with one huge page to spare, so that an aligned start can be cut out of it.
  const size_t mapped = (bytes + kHugePage - 1) / kHugePage * kHugePage + kHugePage;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return torch::empty(sizes, dtype);
  const auto start = reinterpret_cast<uintptr_t>(base);
  void* aligned = reinterpret_cast<void*>((start + kHugePage - 1) / kHugePage * kHugePage);
  madvise(aligned, mapped - (reinterpret_cast<uintptr_t>(aligned) - start), MADV_HUGEPAGE);
  return torch::from_blob(
      aligned, sizes, [base, mapped](void*) { munmap(base, mapped); },
      torch::TensorOptions().dtype(dtype));
}

}  // namespace remotehead::wire
