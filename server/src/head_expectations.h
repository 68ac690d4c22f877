// What a request expects of the head it names — the server process it began with, the weight
// version it computed on — checked against what the head is. Protobuf-free: the handlers pass
// the request's fields, the step session its StepCall's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "remotehead/server/head_registry.h"

namespace remotehead::server {

// A request's expected_incarnation (`field`; empty: unchecked) against this server process:
// FAILED_PRECONDITION saying that the server restarted, and at which version `head` now is.
absl::Status CheckIncarnation(const std::string& expected, const std::string& field,
                              const HeadDescription& head);

// A request's optional expected_weight_version (`field`; unset: unchecked) against the version
// `head` describes: FAILED_PRECONDITION naming both (and a restore at start, if there was one).
absl::Status CheckWeightVersion(std::optional<int64_t> expected, const std::string& field,
                                const HeadDescription& head);

}  // namespace remotehead::server
