// The one place where internal statuses become gRPC statuses (Triton-style): core/ and server/
// return absl::Status with messages naming field, expected and actual, and a reason
// (core/error_reason.h); handlers convert here.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace remotehead::server {

// The Any type URL of the ErrorInfo in a status's details (googleapis' name for it).
inline constexpr char kErrorInfoTypeUrl[] = "type.googleapis.com/google.rpc.ErrorInfo";

// Same code (absl and gRPC share the canonical code numbers), same message, and the status's
// reason as a google.rpc.ErrorInfo in the details (grpc-status-details-bin).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace remotehead::server
