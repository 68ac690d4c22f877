// The loopback TCP limit of this machine, measured: what the wire numbers of a benchmark are
// read against (remotehead-remote-bench reports its wire goodput next to it, in the same run).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace remotehead::bench {

// Bytes per second through one TCP connection on 127.0.0.1: a thread writes `bytes` in 1 MiB
// writes while this one reads them, timed from the first write to the last byte read (the best
// of `repeats`). The plain socket pair a gRPC stream runs over, with no framing or copies of
// its own: the upper bound of one stream's goodput.
absl::StatusOr<double> LoopbackTcpBytesPerSecond(int64_t bytes, int repeats = 3);

}  // namespace remotehead::bench
