#include "remotehead/core/call_mode.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace remotehead::core {

const char* CallModeName(CallMode mode) {
  switch (mode) {
    case CallMode::kFused:
      return "ForwardBackward";
    case CallMode::kForward:
      return "Forward";
    case CallMode::kBackward:
      break;
  }
  return "Backward";
}

absl::StatusOr<Reduction> ParseReduction(std::string_view name) {
  if (name == "none") return Reduction::kNone;
  if (name == "sum") return Reduction::kSum;
  if (name == "mean") return Reduction::kMean;
  if (name == "weighted_sum") return Reduction::kWeightedSum;
  return absl::InvalidArgumentError(absl::StrCat(
      "reduction: expected one of none, sum, mean, weighted_sum; got \"", std::string(name), "\""));
}

std::string_view ReductionName(Reduction reduction) {
  switch (reduction) {
    case Reduction::kNone:
      return "none";
    case Reduction::kSum:
      return "sum";
    case Reduction::kMean:
      return "mean";
    case Reduction::kWeightedSum:
      return "weighted_sum";
  }
  return "unknown";
}

}  // namespace remotehead::core
