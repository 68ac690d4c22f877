// Serves GET /metrics (Prometheus text format) from prometheus-cpp collectables over HTTP, with
// Debian's civetweb: a pool of worker threads (concurrent scrapes; a client that connects and
// stalls holds one worker until its request timeout, never the others), a prompt stop, and an
// optional bearer token. Other paths answer 404, other methods 405.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace prometheus {
class Collectable;
}

namespace remotehead::server {

struct MetricsHttpOptions {
  std::string address;            // --metrics_address: IPv4 host:port (port 0: a free one)
  std::string bearer_token;       // non-empty: /metrics needs "Authorization: Bearer <token>" (401)
  int num_threads = 8;            // requests served at once
  int request_timeout_ms = 5000;  // longest a client may take to send its request / read the reply
};

class MetricsHttpServer {
 public:
  // INVALID_ARGUMENT naming --metrics_address for a bad address, UNAVAILABLE when it cannot be
  // bound (or the HTTP server cannot start).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpOptions& options,
      std::vector<std::weak_ptr<prometheus::Collectable>> collectables);
  ~MetricsHttpServer();  // stops serving; returns promptly even with idle connections open
  int port() const;

  class Impl;

 private:
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The exposure rule of the metrics port (plain HTTP) next to a TLS-protected gRPC port: with TLS
// on and no bearer token, only a loopback --metrics_address (127.0.0.0/8) is accepted, since the
// metrics name every head; INVALID_ARGUMENT naming --metrics_address otherwise.
absl::Status CheckMetricsExposure(const std::string& address, bool tls, bool bearer_token);

}  // namespace remotehead::server
