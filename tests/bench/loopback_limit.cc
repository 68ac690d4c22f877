#include "bench/loopback_limit.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace remotehead::bench {
namespace {

absl::Status Errno(const char* what) {
  return absl::InternalError(absl::StrCat("loopback limit: ", what, ": ", std::strerror(errno)));
}

// A connected pair of TCP sockets on 127.0.0.1 (the writer's end first).
absl::Status Connect(int* writer, int* reader) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(listener);
    return Errno("bind/listen");
  }
  *writer = socket(AF_INET, SOCK_STREAM, 0);
  if (*writer < 0 || connect(*writer, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(listener);
    return Errno("connect");
  }
  *reader = accept(listener, nullptr, nullptr);
  close(listener);
  if (*reader < 0) return Errno("accept");
  const int one = 1;
  setsockopt(*writer, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return absl::OkStatus();
}

absl::StatusOr<double> OneRun(int64_t bytes) {
  int writer = -1, reader = -1;
  if (absl::Status s = Connect(&writer, &reader); !s.ok()) return s;
  constexpr size_t kBlock = size_t{1} << 20;
  std::vector<char> out(kBlock, 'x'), in(kBlock);
  const auto start = std::chrono::steady_clock::now();
  std::thread send([&] {
    for (int64_t left = bytes; left > 0;) {
      const ssize_t n = write(writer, out.data(), std::min<int64_t>(left, kBlock));
      if (n <= 0) break;
      left -= n;
    }
    shutdown(writer, SHUT_WR);
  });
  int64_t received = 0;
  for (ssize_t n; (n = read(reader, in.data(), kBlock)) > 0;) received += n;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  send.join();
  close(writer);
  close(reader);
  if (received != bytes) {
    return absl::InternalError(
        absl::StrCat("loopback limit: received ", received, " bytes of ", bytes));
  }
  return bytes / seconds;
}

}  // namespace

absl::StatusOr<double> LoopbackTcpBytesPerSecond(int64_t bytes, int repeats) {
  double best = 0;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    absl::StatusOr<double> r = OneRun(bytes);
    if (!r.ok()) return r.status();
    best = std::max(best, *r);
  }
  return best;
}

}  // namespace remotehead::bench
