// Translations between protobuf messages and the server's own types that more than one handler
// needs. Wire tensors are remotehead::wire's; statuses are status_mapping's.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/functions.h"
#include "remotehead/server/service/head_registry.h"
#include "remotehead/v1/head_service.pb.h"
#include "service/head_expectations.h"
#include "service/head_requests.h"

namespace remotehead::server {

// The HeadInfo every handler that reports a head's state answers with.
absl::Status ToWire(const HeadDescription& description, v1::HeadInfo* info);

// Every function of `registry` as ListFunctions describes it.
absl::Status ToWire(const core::FunctionRegistry& registry, v1::ListFunctionsResponse* response);

// A message's `optional int64 expected_weight_version` (a request's, a header's, a head group
// command's): the version its caller pins, or none. The one reader of the field.
template <typename Message>
std::optional<int64_t> ExpectedWeightVersion(const Message& message) {
  if (!message.has_expected_weight_version()) return std::nullopt;
  return message.expected_weight_version();
}

// A request's optional dtype field (DTYPE_UNSPECIFIED: unset), named `field` in errors.
absl::StatusOr<std::optional<torch::ScalarType>> OptionalDtype(v1::DType dtype,
                                                               const std::string& field);

// A creation's traits from its request's fields (CreateHeadRequest, UploadHeader, a head group's
// commands), `field_prefix` ("" or "header.") naming them in errors.
absl::StatusOr<HeadTraits> TraitsFromWire(bool frozen, v1::DType grad_dtype,
                                          const std::string& field_prefix);

// The operations' arguments from their requests (the handlers', and a head group's commands').
core::HeadInit FromWire(const v1::CreateHeadRequest::FromInit& init, torch::ScalarType dtype);
SafetensorsSource FromWire(const v1::CreateHeadRequest::FromSafetensors& source,
                           std::optional<torch::ScalarType> dtype);
absl::StatusOr<OptimizerStepSpec> FromWire(const v1::OptimizerStepRequest& request);

}  // namespace remotehead::server
