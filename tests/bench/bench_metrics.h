// What the benches read of a server process's /metrics (Prometheus text on loopback): the body,
// and one sample's value.
#pragma once

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sstream>
#include <string>

#include "absl/strings/numbers.h"

namespace remotehead::bench {

// GET http://127.0.0.1:port/metrics ("" if nothing answers).
inline std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string body;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[65536];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) body.append(buffer, n);
    }
  }
  close(fd);
  return body;
}

// The value of the sample `name` (with its labels, as exposed: `family{a="b"}` or `family`) in
// a /metrics body; 0 if absent.
inline double MetricValue(const std::string& body, const std::string& name) {
  std::istringstream lines(body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + " ", 0) != 0) continue;
    double value = 0;
    absl::SimpleAtod(line.substr(name.size() + 1), &value);
    return value;
  }
  return 0;
}

}  // namespace remotehead::bench
