// A step's header read into the engine's types, and its outcome into the summary that ends the
// call: the conversions between a step's messages and the session's types. The header's is the
// one conversion from the wire's StepHeader to core::StepOptions. The front of a request calls it
// (StepSession), and so does every other rank of a head group, which receives the request's own
// header in each step command (group_steps.h): an option added to the header reaches every rank
// through this function.
//
// Protobuf-facing and stateless: it checks what the header alone determines (the reduction and
// the mode's fields, the dtypes asked for); what needs the head (the function's params, the
// incarnation, the version, the identity) is checked by the engine's plan and the session, on
// the StepCall this returns.
#pragma once

#include <optional>

#include "absl/status/statusor.h"
#include "remotehead/core/call_mode.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/v1/head_service.pb.h"
#include "step/step_call.h"

namespace remotehead::server {

// The header of a call in `mode` (kFused: ForwardBackward, kForward, kBackward).
absl::StatusOr<StepCall> ReadStepHeader(const v1::StepHeader& header, core::CallMode mode);

// The summary that ends a step call: what the session's commit gave, with this process's
// incarnation.
void ToWire(const StepOutcome& outcome, v1::StepSummary* summary);

}  // namespace remotehead::server
