// Which HeadService calls a server still takes, and how many of them are running: a server that
// drains refuses every new call (UNAVAILABLE, reason SERVER_DRAINING: the client may retry
// elsewhere or later) while the calls it took finish, and it knows when they have.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"

namespace remotehead::server {

class CallGate {
 public:
  // From now on every new call is refused (Admit).
  void Close() { closed_.store(true); }
  // OK while the gate is open; UNAVAILABLE with reason SERVER_DRAINING once it is closed.
  absl::Status Admit() const;
  // HeadService calls started and not yet ended (counted by Counter's interceptors).
  int64_t running() const { return running_.load(); }
  // Waits until no call runs or `deadline` passes; whether none runs.
  bool AwaitIdle(std::chrono::steady_clock::time_point deadline) const;
  // Add to the grpc::ServerBuilder's interceptors: counts every HeadService call from its start
  // to its end (the gate must outlive the server).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Counter();

 private:
  friend class CallCounter;
  std::atomic<bool> closed_{false};
  std::atomic<int64_t> running_{0};
};

}  // namespace remotehead::server
