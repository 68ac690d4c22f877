#include "status.h"

#include <utility>

#include "remotehead/core/error_reason.h"
#include "remotehead/v1/head_service.pb.h"

namespace remotehead::client::internal {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  v1::RpcStatus details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return result;
  }
  for (const google::protobuf::Any& detail : details.details()) {
    v1::ErrorInfo info;
    if (detail.type_url() != "type.googleapis.com/google.rpc.ErrorInfo" ||
        !info.ParseFromString(detail.value()) || info.domain() != core::kErrorDomain) {
      continue;
    }
    return core::WithReason(std::move(result), info.reason(),
                            {info.metadata().begin(), info.metadata().end()});
  }
  return result;
}

absl::Status BrokenResponse(const absl::Status& status) {
  return status.ok() ? status : absl::InternalError(status.message());
}

}  // namespace remotehead::client::internal
