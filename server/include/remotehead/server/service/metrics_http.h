// Serves GET /metrics (Prometheus text format) from prometheus-cpp collectables over HTTP/1.1:
// one thread with an event loop (epoll) over non-blocking sockets, so a client that connects
// and stalls, trickles its request or never reads the answer holds a socket, never a thread:
// however many such clients there are, a scrape is answered as soon as its request is in.
// Every connection has a deadline (its request head must arrive, and its answer leave, within
// request_timeout_ms); at max_connections the oldest connection still sending its request is
// dropped to take a new one. One request per connection ("Connection: close"). An optional
// bearer token; other paths answer 404, other methods 405; a prompt stop.
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
  int max_connections = 1024;     // open at once (stalled clients included)
  int request_timeout_ms = 5000;  // longest a client may take to send its request / read the reply
};

class MetricsHttpServer {
 public:
  // INVALID_ARGUMENT naming --metrics_address for a bad address, UNAVAILABLE when it cannot be
  // bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpOptions& options,
      std::vector<std::weak_ptr<prometheus::Collectable>> collectables);
  // Stops serving: the port is closed and no request reads the collectables once it returns.
  ~MetricsHttpServer();
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
