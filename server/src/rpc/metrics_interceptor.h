// The metrics' gRPC side: one interceptor per RPC that records it in ServerMetrics (requests by
// method and status code, latency, bytes, in-flight calls), so no handler counts its own calls.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <memory>

#include "remotehead/server/service/metrics.h"

namespace remotehead::server {

// Add to the grpc::ServerBuilder (experimental().SetInterceptorCreators); `metrics` must outlive
// the server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewMetricsInterceptorFactory(
    ServerMetrics* metrics);

}  // namespace remotehead::server
