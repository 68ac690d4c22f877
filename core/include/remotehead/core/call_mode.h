// The kinds of engine call and of reduction, as plain names: what a client, the server and the
// engine share about a step without the engine itself (this header and call_mode.cc are part of
// remotehead::core_types, which the C++ client links; Abseil only).
#pragma once

#include <string_view>

#include "absl/status/statusor.h"

namespace remotehead::core {

// The engine's three entry points: FusedForwardBackward, Forward, Backward (engine.h).
enum class CallMode { kFused, kForward, kBackward };
// The mode as the service's RPCs name it: "ForwardBackward", "Forward", "Backward".
const char* CallModeName(CallMode mode);

// How a step reduces its per-token outputs over the valid tokens (the table in engine.h).
enum class Reduction { kNone, kSum, kMean, kWeightedSum };
absl::StatusOr<Reduction> ParseReduction(std::string_view name);
std::string_view ReductionName(Reduction reduction);

}  // namespace remotehead::core
