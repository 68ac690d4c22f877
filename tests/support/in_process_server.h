// The HeadService in this process, on a loopback port of its own: what the service and client
// test suites talk to over a real gRPC channel.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "remotehead/server/rpc/head_service.h"

namespace remotehead::testing {

class InProcessServer {
 public:
  // max_receive_message_bytes: the largest client message the server accepts (0: gRPC's
  // default, 4 MiB).
  explicit InProcessServer(server::ServiceOptions options, int max_receive_message_bytes = 0)
      : service_(server::HeadService::Create(&registry_, options)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_->service());
    if (max_receive_message_bytes > 0) builder.SetMaxReceiveMessageSize(max_receive_message_bytes);
    server_ = builder.BuildAndStart();
  }
  // The server stops before the service, which goes before the registry.
  ~InProcessServer() {
    service_->Drain();  // as the server binary: waiting synchronous steps do not hold Shutdown
    if (server_ != nullptr) server_->Shutdown();
    service_.reset();
  }
  InProcessServer(const InProcessServer&) = delete;
  InProcessServer& operator=(const InProcessServer&) = delete;

  bool started() const { return server_ != nullptr && port_ > 0; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  server::HeadRegistry& registry() { return registry_; }
  server::HeadService& service() { return *service_; }

 private:
  server::HeadRegistry registry_;
  std::unique_ptr<server::HeadService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace remotehead::testing
