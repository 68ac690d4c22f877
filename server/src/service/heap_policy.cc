// Why the server keeps the heap memory it frees.
//
// A step's bytes pass through memory that lives for one call: gRPC reads each stream into
// 64 KiB buffers that it frees once the rows are staged, and a batch's dX and the engine's
// temporaries are allocated and freed per batch. glibc's defaults give that memory back to the
// kernel as soon as 128 KiB lie free at the top of a heap, and map anything from 128 KiB up
// (raised only as large blocks are freed) on its own. Taken again, every page is a fault that
// the kernel zeroes and charges to the memory cgroup: `remotehead-wire-bench --v 2` (X 128 MiB
// up, dX 128 MiB down) counted 16,000–28,000 faults a call in the server, a fifth of its CPU
// under `perf`, and 400–6,000 with the settings below (docs/benchmarks.md).
//
// The settings keep up to kTrimBytes free at the top of each heap, grow a heap kTopPadBytes at a
// time, and serve blocks below kMmapBytes from the heaps (the most glibc's own dynamic threshold
// would reach), so the next call reuses what this one freed. The cost is bounded: at most
// kTrimBytes of freed memory held per malloc arena, memory the next call takes again.
#include "service/heap_policy.h"

#include <malloc.h>

#include <cstdlib>
#include <string_view>

namespace remotehead::server {

namespace {

constexpr int kTrimBytes = 256 << 20;
constexpr int kTopPadBytes = 16 << 20;
constexpr int kMmapBytes = 32 << 20;

bool OperatorTunedMalloc() {
  for (const char* name : {"MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables != nullptr &&
         std::string_view(tunables).find("glibc.malloc.") != std::string_view::npos;
}

}  // namespace

void KeepFreedHeapForReuseUnlessTuned() {
  if (OperatorTunedMalloc()) return;
  mallopt(M_MMAP_THRESHOLD, kMmapBytes);
  mallopt(M_TRIM_THRESHOLD, kTrimBytes);
  mallopt(M_TOP_PAD, kTopPadBytes);
}

}  // namespace remotehead::server
