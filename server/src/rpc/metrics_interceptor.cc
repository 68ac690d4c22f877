#include "rpc/metrics_interceptor.h"

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>

#include <string>

#include "absl/strings/match.h"

namespace remotehead::server {
namespace {

// "/remotehead.v1.HeadService/ForwardBackward" -> "ForwardBackward": low cardinality.
std::string RpcName(const char* method) {
  const std::string full = method != nullptr ? method : "";
  const size_t slash = full.rfind('/');
  return slash == std::string::npos ? full : full.substr(slash + 1);
}

// One per RPC: counts it when its status goes out (or, if none does, when it is destroyed).
class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(std::unique_ptr<ServerMetrics::RpcObservation> rpc, bool protobuf_messages)
      : rpc_(std::move(rpc)), protobuf_messages_(protobuf_messages) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    // remotehead.v1's messages are protobuf messages, whose MessageLite base sits at offset 0
    // (single inheritance). Other services may pass raw ByteBuffers (gRPC's default health
    // service does): their bytes are not counted.
    if (protobuf_messages_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (const void* message = methods->GetRecvMessage(); message != nullptr) {
        rpc_->Received(static_cast<int64_t>(
            static_cast<const google::protobuf::MessageLite*>(message)->ByteSizeLong()));
      }
    }
    if (protobuf_messages_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      if (const void* message = methods->GetSendMessage(); message != nullptr) {
        rpc_->Sent(static_cast<int64_t>(
            static_cast<const google::protobuf::MessageLite*>(message)->ByteSizeLong()));
      } else if (grpc::ByteBuffer* buffer = methods->GetSerializedSendMessage();
                 buffer != nullptr) {
        rpc_->Sent(static_cast<int64_t>(buffer->Length()));
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      rpc_->Finish(static_cast<int>(methods->GetSendStatus().error_code()));
    }
    methods->Proceed();
  }

 private:
  const std::unique_ptr<ServerMetrics::RpcObservation> rpc_;  // CANCELLED if never finished
  const bool protobuf_messages_;
};

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const std::string method = info->method() != nullptr ? info->method() : "";
    return new MetricsInterceptor(metrics_->StartRpc(RpcName(info->method())),
                                  absl::StartsWith(method, "/remotehead.v1.HeadService/"));
  }

 private:
  ServerMetrics* const metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewMetricsInterceptorFactory(
    ServerMetrics* metrics) {
  return std::make_unique<MetricsInterceptorFactory>(metrics);
}

}  // namespace remotehead::server
