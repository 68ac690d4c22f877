// The client's statuses: a gRPC status converted (code, message and the server's reason), a
// response the wire codec refused, and the shapes error messages quote.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"

namespace remotehead::client::internal {

// absl::StatusCode and grpc::StatusCode both follow google.rpc.Code: the code maps 1:1, the
// server's message is kept as it is, and the reason it sent (a google.rpc.ErrorInfo in the
// status details) is attached, for core::ReasonOf / core::GetReason.
absl::Status FromGrpc(const grpc::Status& status);

// The server's bytes failed the wire codec's checks: a broken response (INTERNAL), not a bad
// input of the caller's.
absl::Status BrokenResponse(const absl::Status& status);
template <typename T>
absl::StatusOr<T> BrokenResponse(absl::StatusOr<T> result) {
  if (result.ok()) return result;
  return absl::InternalError(result.status().message());
}

inline std::string ShapeOf(const torch::Tensor& t) { return c10::str(t.sizes()); }

}  // namespace remotehead::client::internal
