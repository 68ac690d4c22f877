#include "rpc/port_hold.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "group/passive_addresses.h"

namespace remotehead::server {
namespace {

// HOST and PORT of HOST:PORT or [V6]:PORT; false for anything else (unix:..., a bare host).
bool SplitHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), port)) {
    return false;
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  } else if (host->find(':') != std::string::npos) {
    return false;  // a bare IPv6 address or a scheme: not HOST:PORT
  }
  return *port > 0 && *port < 65536;
}

}  // namespace

absl::StatusOr<PortHold> PortHold::Hold(const std::string& address, const std::string& flag) {
  std::string host;
  int port = 0;
  PortHold hold;
  if (!SplitHostPort(address, &host, &port)) return hold;
  const absl::StatusOr<AddressList> found = PassiveAddresses(host, port);
  if (!found.ok()) return hold;
  absl::Status in_use;
  for (const addrinfo* a = found->get(); a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // The server's own socket sets SO_REUSEADDR too: a connection of an earlier process left in
    // TIME_WAIT there does not stop it, nor this.
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
      hold.fds_.push_back(fd);
      continue;
    }
    if (errno == EADDRINUSE) {
      in_use = absl::UnavailableError(
          absl::StrCat(flag, ": cannot listen on ", address, ": ", std::strerror(errno)));
    }
    ::close(fd);
  }
  // In use only when no address of HOST could be held: a wildcard host resolves to 0.0.0.0 and
  // to [::], which (dual-stack, as the server binds it) then finds the first one held.
  if (!hold.holds() && !in_use.ok()) return in_use;
  return hold;
}

PortHold::PortHold(PortHold&& other) noexcept : fds_(std::exchange(other.fds_, {})) {}

PortHold& PortHold::operator=(PortHold&& other) noexcept {
  if (this != &other) {
    Release();
    fds_ = std::exchange(other.fds_, {});
  }
  return *this;
}

void PortHold::Release() {
  for (const int fd : fds_) ::close(fd);
  fds_.clear();
}

}  // namespace remotehead::server
