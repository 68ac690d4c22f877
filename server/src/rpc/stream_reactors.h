// The reactors of the non-step streams: UploadHead (client → server weight rows) and
// ExportWeights / FetchGradients (server → client row chunks of a snapshot). Protocol only:
// the head operations they end in are HeadOperations'.
#pragma once

#include <grpcpp/grpcpp.h>

#include "remotehead/v1/head_service.grpc.pb.h"
#include "rpc/service_context.h"

namespace remotehead::server {

grpc::ServerReadReactor<v1::UploadHeadRequest>* NewUploadReactor(
    grpc::CallbackServerContext* context, ServiceContext* service, v1::HeadInfo* response);

grpc::ServerWriteReactor<v1::ExportWeightsResponse>* NewExportReactor(
    ServiceContext* service, const v1::ExportWeightsRequest& request);

grpc::ServerWriteReactor<v1::FetchGradientsResponse>* NewFetchGradientsReactor(
    ServiceContext* service, const v1::FetchGradientsRequest& request);

}  // namespace remotehead::server
