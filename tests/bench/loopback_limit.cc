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

// One socket pair carrying `bytes`: a writer thread, this thread reading; the bytes it read.
int64_t Carry(int writer, int reader, int64_t bytes) {
  constexpr size_t kBlock = size_t{1} << 20;
  std::vector<char> out(kBlock, 'x'), in(kBlock);
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
  send.join();
  return received;
}

absl::StatusOr<double> OneRun(int64_t bytes, int connections) {
  std::vector<int> writers(connections, -1), readers(connections, -1);
  absl::Status connected;
  for (int c = 0; c < connections && connected.ok(); ++c) {
    connected = Connect(&writers[c], &readers[c]);
  }
  std::vector<int64_t> received(connections, 0);
  const int64_t each = bytes / connections;
  const auto start = std::chrono::steady_clock::now();
  if (connected.ok()) {
    std::vector<std::thread> pairs;
    for (int c = 0; c < connections; ++c) {
      pairs.emplace_back([&, c] { received[c] = Carry(writers[c], readers[c], each); });
    }
    for (std::thread& t : pairs) t.join();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int c = 0; c < connections; ++c) {
    if (writers[c] >= 0) close(writers[c]);
    if (readers[c] >= 0) close(readers[c]);
  }
  if (!connected.ok()) return connected;
  int64_t total = 0;
  for (int64_t r : received) total += r;
  if (total != each * connections) {
    return absl::InternalError(
        absl::StrCat("loopback limit: received ", total, " bytes of ", each * connections));
  }
  return total / seconds;
}

}  // namespace

absl::StatusOr<double> LoopbackTcpBytesPerSecond(int64_t bytes, int repeats, int connections) {
  double best = 0;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    absl::StatusOr<double> r = OneRun(bytes, std::max(1, connections));
    if (!r.ok()) return r.status();
    best = std::max(best, *r);
  }
  return best;
}

}  // namespace remotehead::bench
