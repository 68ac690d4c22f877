// The reactors of a tied embedding's calls: EmbeddingLookup (W[ids] streamed back as row chunks)
// and EmbeddingGradient (the gradient rows streamed in, then added into dW). Protocol only: the
// operations they end in are ReplicatedHeadOperations'.
#pragma once

#include <grpcpp/grpcpp.h>

#include "remotehead/v1/head_service.grpc.pb.h"
#include "rpc/service_context.h"

namespace remotehead::server {

grpc::ServerWriteReactor<v1::EmbeddingLookupResponse>* NewEmbeddingLookupReactor(
    ServiceContext* service, const v1::EmbeddingLookupRequest& request);

grpc::ServerReadReactor<v1::EmbeddingGradientRequest>* NewEmbeddingGradientReactor(
    grpc::CallbackServerContext* context, ServiceContext* service,
    v1::EmbeddingGradientResponse* response);

}  // namespace remotehead::server
