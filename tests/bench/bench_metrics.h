// What the benches read of a server process's /metrics (Prometheus text on loopback): the body,
// and one sample's value; and a process's CPU time.
#pragma once

#include <arpa/inet.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

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

// CPU seconds (user + system) used so far by process `pid` (0: this process).
inline double CpuSeconds(pid_t pid) {
  if (pid == 0) {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
    return seconds(usage.ru_utime) + seconds(usage.ru_stime);
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
  const std::vector<std::string> fields =
      absl::StrSplit(text.substr(text.rfind(')') + 2), ' ', absl::SkipEmpty());
  if (fields.size() < 13) return 0;
  double utime = 0, stime = 0;
  if (!absl::SimpleAtod(fields[11], &utime) || !absl::SimpleAtod(fields[12], &stime)) return 0;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace remotehead::bench
