// Prometheus metrics of a remotehead server (prometheus-cpp). Protocol metrics (requests by RPC
// and status code, latency, bytes, in-flight calls) come from one gRPC interceptor, so no
// handler counts its own calls; step metrics (tokens, latency by phase, logits chunk) are
// reported by the step reactor; state (device memory, admission, per-head version, micro-
// batches and last loss) is read at scrape time. Every name is listed in the README.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

#include <c10/core/Device.h>

#include "remotehead/server/admission.h"

namespace prometheus {
class Collectable;
}

namespace remotehead::v1 {
class StepTimings;
}

namespace remotehead::server {

class HeadRegistry;

class ServerMetrics {
 public:
  // `registry` and `admission` are read at scrape time and must outlive this object;
  // `admission` may be set later (the service owns it).
  ServerMetrics(const HeadRegistry* registry, c10::Device device, int64_t memory_budget_bytes);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  void set_admission(const AdmissionController* admission);

  // What an Exposer serves: the metrics recorded here and the scrape-time state.
  std::vector<std::weak_ptr<prometheus::Collectable>> Collectables() const;
  // Add to the grpc::ServerBuilder (experimental().SetInterceptorCreators).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  // A step RPC (ForwardBackward, Forward, Backward) that succeeded.
  void ObserveStep(const std::string& rpc, const std::string& head, const std::string& function,
                   int64_t valid_tokens, const v1::StepTimings& timings,
                   int64_t logits_chunk_bytes);

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// Serves GET /metrics (Prometheus text format) from `collectables` on one thread, one
// connection at a time (scrapes are rare and small). prometheus-cpp's civetweb Exposer cannot
// start its threads in a process that has loaded LibTorch (mg_start: "Cannot create threads"),
// so the exposition is served here, from the same prometheus-cpp collectables and serializer.
class MetricsHttpServer {
 public:
  // `address` is IPv4 host:port (port 0: a free one). INVALID_ARGUMENT naming --metrics_address
  // for a bad address, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::vector<std::weak_ptr<prometheus::Collectable>> collectables);
  ~MetricsHttpServer();  // stops serving
  int port() const { return port_; }

 private:
  MetricsHttpServer(int fd, int port, std::vector<std::weak_ptr<prometheus::Collectable>> c);
  void Serve();
  void Answer(int client) const;

  const int fd_;
  const int port_;
  const std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace remotehead::server
