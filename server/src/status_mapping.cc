#include "remotehead/server/status_mapping.h"

#include <string>

namespace remotehead::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  // absl::StatusCode and grpc::StatusCode both follow google.rpc.Code (0..16); anything
  // outside that range is reported as UNKNOWN rather than cast blindly.
  const auto grpc_code =
      code >= 0 && code <= 16 ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN;
  return grpc::Status(grpc_code, std::string(status.message()));
}

}  // namespace remotehead::server
