#include "remotehead/server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/collectable.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace remotehead::server {

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::vector<std::weak_ptr<prometheus::Collectable>> collectables) {
  const size_t colon = address.rfind(':');
  int port = -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535 ||
      ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_address: expected IPv4 host:port (e.g. 0.0.0.0:9464); got \"", address, "\""));
  }
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string reason = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("--metrics_address: cannot listen on \"", address, "\": ", reason));
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(fd, ntohs(addr.sin_port), std::move(collectables)));
}

MetricsHttpServer::MetricsHttpServer(int fd, int port,
                                     std::vector<std::weak_ptr<prometheus::Collectable>> c)
    : fd_(fd), port_(port), collectables_(std::move(c)) {
  thread_ = std::thread([this] { Serve(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_.store(true);
  thread_.join();
  ::close(fd_);
}

void MetricsHttpServer::Serve() {
  while (!stop_.load()) {
    pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, /*timeout_ms=*/200) <= 0) continue;  // re-checks stop_ 5 times a second
    const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    // A client that stalls cannot hold the one serving thread for long.
    const timeval timeout{.tv_sec = 2, .tv_usec = 0};
    ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    ::setsockopt(client, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    Answer(client);
    ::close(client);
  }
}

void MetricsHttpServer::Answer(int client) const {
  std::string request;
  char buffer[2048];
  while (!absl::StrContains(request, "\r\n\r\n") && request.size() < 16384) {
    const ssize_t n = ::recv(client, buffer, sizeof(buffer), 0);
    if (n <= 0) return;
    request.append(buffer, static_cast<size_t>(n));
  }
  std::string status = "200 OK";
  std::string body;
  if (absl::StartsWith(request, "GET /metrics ") || absl::StartsWith(request, "GET /metrics?")) {
    std::vector<prometheus::MetricFamily> families;
    for (const auto& weak : collectables_) {
      if (auto collectable = weak.lock()) {
        auto collected = collectable->Collect();
        families.insert(families.end(), std::make_move_iterator(collected.begin()),
                        std::make_move_iterator(collected.end()));
      }
    }
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, families);
    body = out.str();
  } else {
    status = "404 Not Found";
    body = "remotehead-server serves GET /metrics only\n";
  }
  const std::string response = absl::StrCat(
      "HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8",
      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t n = ::send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace remotehead::server
