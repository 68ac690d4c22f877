// Device memory figures, the same on CPU and CUDA: bytes held by live tensors now, bytes
// reserved from the system, and the peak of the former since the last ResetPeak.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::core {

struct MemoryStats {
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t peak_allocated_bytes = 0;
};

// Wraps c10's CPU allocator with one that counts live and peak bytes, so CPU tensor memory is
// measured (not computed from shapes). Idempotent; call it at process start, before tensors
// whose memory should be counted are created. Without it, CPU stats are unavailable.
void InstallCpuMemoryTracker();

// CUDA: the caching allocator's statistics. CPU: the tracker's counts (reserved = allocated).
absl::StatusOr<MemoryStats> GetMemoryStats(const torch::Device& device);
absl::Status ResetPeakMemory(const torch::Device& device);

// Bytes as every message and breakdown states them: "1.5 MiB".
std::string FormatMiB(int64_t bytes);

// Memory a server may plan with on `device`: CUDA, the device's free memory now; CPU, the
// machine's physical memory.
absl::StatusOr<int64_t> AvailableMemoryBytes(const torch::Device& device);

}  // namespace remotehead::core
