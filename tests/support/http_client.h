// A minimal HTTP/1.1 client for the tests of the /metrics endpoint: plain sockets on loopback,
// one request per connection (the server closes it after the answer).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace remotehead::testing {

// A connected socket to 127.0.0.1:port (-1 on failure), with 5 s send/receive timeouts.
inline int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const timeval timeout{.tv_sec = 5, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

struct Response {
  int status = 0;  // 0: no (complete) answer
  std::string text;
};

// One request, the whole answer (the server closes the connection after it).
inline Response Request(int port, const std::string& request) {
  Response response;
  const int fd = Connect(port);
  if (fd < 0) return response;
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    char buffer[4096];
    ssize_t n;
    while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.text.append(buffer, n);
  }
  ::close(fd);
  if (response.text.rfind("HTTP/1.1 ", 0) == 0)
    response.status = std::stoi(response.text.substr(9));
  return response;
}

inline Response Get(int port, const std::string& path = "/metrics",
                    const std::string& headers = "") {
  return Request(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + "\r\n");
}

}  // namespace remotehead::testing
