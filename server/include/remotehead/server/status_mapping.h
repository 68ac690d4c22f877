// The one place where internal statuses become gRPC statuses (Triton-style): core/ and server/
// return absl::Status with messages naming field, expected and actual; handlers convert here.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace remotehead::server {

// Same code (absl and gRPC share the canonical code numbers), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace remotehead::server
