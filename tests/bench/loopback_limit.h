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
// With `connections` > 1: as many socket pairs at once, each carrying bytes / connections with a
// writer and a reader thread of its own, timed from the first write to the last byte read on any
// of them — the bound of C striped streams.
absl::StatusOr<double> LoopbackTcpBytesPerSecond(int64_t bytes, int repeats = 3,
                                                 int connections = 1);

}  // namespace remotehead::bench
