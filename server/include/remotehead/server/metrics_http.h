// Serves GET /metrics (Prometheus text format) from prometheus-cpp collectables, on one thread,
// one connection at a time (scrapes are rare and small). prometheus-cpp's civetweb Exposer
// cannot start its threads in a process that has loaded LibTorch (mg_start: "Cannot create
// threads"), so the exposition is served here, from the same collectables and serializer.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace prometheus {
class Collectable;
}

namespace remotehead::server {

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
