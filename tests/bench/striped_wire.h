// The wire of a step call over C parallel streams (ClientOptions::streams, StepHeader.stripe):
// X up and dX down through the step's own path with next to no compute — a ForwardBackward on a
// head of two tokens — so that what is timed is the client, the transport and the server's
// handling of the messages. remotehead-remote-bench reports it for each stream count next to
// the loopback TCP limit measured in the same run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::bench {

struct StripedWire {
  int streams = 1;
  double seconds = 0;   // median wall time of one step
  double gb_per_s = 0;  // (X bytes + dX bytes) / seconds
  // max |dX − the first stream count's dX| / max |dX|: striping changes nothing.
  double dx_max_rel_diff = 0;
};

// For each count in `streams`, a client with that many streams to `target` runs the probe step
// on `hidden` ([N, D] float32) `warmup` + `repeats` times (the median is reported).
absl::StatusOr<std::vector<StripedWire>> MeasureStripedWire(const std::string& target,
                                                            const torch::Tensor& hidden,
                                                            const std::vector<int>& streams,
                                                            int64_t chunk_bytes, int warmup,
                                                            int repeats);

}  // namespace remotehead::bench
