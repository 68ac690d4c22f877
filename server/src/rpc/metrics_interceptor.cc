#include "rpc/metrics_interceptor.h"

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>

#include <string>

#include "absl/strings/match.h"
#include "rpc/step_reactor.h"

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
  // What the RPC's messages are, as an interceptor sees them.
  enum class Messages { kProtobuf, kByteBuffers, kUncounted };
  MetricsInterceptor(std::unique_ptr<ServerMetrics::RpcObservation> rpc, Messages messages)
      : rpc_(std::move(rpc)), messages_(messages) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    // remotehead.v1's messages are protobuf messages, whose MessageLite base sits at offset 0
    // (single inheritance), but for the step methods, served raw (step_reactor.h): ByteBuffers.
    // Other services may pass raw ByteBuffers too (gRPC's default health service does): their
    // bytes are not counted.
    if (messages_ != Messages::kUncounted &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (const void* message = methods->GetRecvMessage(); message != nullptr) {
        rpc_->Received(Size(message));
      }
    }
    if (messages_ != Messages::kUncounted &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      if (const void* message = methods->GetSendMessage(); message != nullptr) {
        rpc_->Sent(Size(message));
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
  int64_t Size(const void* message) const {
    if (messages_ == Messages::kByteBuffers) {
      return static_cast<int64_t>(static_cast<const grpc::ByteBuffer*>(message)->Length());
    }
    return static_cast<int64_t>(
        static_cast<const google::protobuf::MessageLite*>(message)->ByteSizeLong());
  }

  const std::unique_ptr<ServerMetrics::RpcObservation> rpc_;  // CANCELLED if never finished
  const Messages messages_;
};

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const std::string method = info->method() != nullptr ? info->method() : "";
    using Messages = MetricsInterceptor::Messages;
    const Messages messages = IsRawStepMethod(method) ? Messages::kByteBuffers
                              : absl::StartsWith(method, "/remotehead.v1.HeadService/")
                                  ? Messages::kProtobuf
                                  : Messages::kUncounted;
    return new MetricsInterceptor(metrics_->StartRpc(RpcName(info->method())), messages);
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
