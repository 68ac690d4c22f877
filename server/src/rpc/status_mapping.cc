#include "remotehead/server/rpc/status_mapping.h"

#include <string>

#include "remotehead/core/error_reason.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  // absl::StatusCode and grpc::StatusCode both follow google.rpc.Code (0..16); anything
  // outside that range is reported as UNKNOWN rather than cast blindly.
  const auto grpc_code =
      code >= 0 && code <= 16 ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN;
  const std::string message(status.message());

  // The reason travels as google.rpc.Status.details[0] = google.rpc.ErrorInfo, the form gRPC's
  // richer error model defines (grpc-status-details-bin).
  const core::ErrorReason reason = core::ReasonOf(status);
  v1::ErrorInfo info;
  info.set_reason(reason.reason);
  info.set_domain(core::kErrorDomain);
  for (const auto& [key, value] : reason.metadata) (*info.mutable_metadata())[key] = value;
  v1::RpcStatus details;
  details.set_code(static_cast<int>(grpc_code));
  details.set_message(message);
  google::protobuf::Any* any = details.add_details();
  any->set_type_url(kErrorInfoTypeUrl);
  any->set_value(info.SerializeAsString());
  return grpc::Status(grpc_code, message, details.SerializeAsString());
}

}  // namespace remotehead::server
