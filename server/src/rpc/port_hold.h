// A port the server is told to listen on (--listen, --metrics_address), held from the process's
// start until the server binds it.
//
// A head group's rank binds its ports only after the group's rendezvous, and the rendezvous
// opens many sockets of its own (Gloo's pairs, the store's connections) whose ports the kernel
// picks from its ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
// default, which holds 50051). One of them could take the port in between, and the rank would
// join its group only to die at once ("Address already in use"; seen in CI). A socket bound to
// the port keeps the kernel's own choices off it; Release() frees it just before the server
// binds.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace remotehead::server {

class PortHold {
 public:
  // Binds HOST:PORT's port on each of HOST's addresses. Holds nothing for port 0 (the kernel's
  // choice), an address that is not HOST:PORT (unix:...) or a host that does not resolve or
  // bind here: the server's own bind reports those. UNAVAILABLE, naming `flag`, the address
  // and the error, when another socket already listens there: the server could not listen.
  static absl::StatusOr<PortHold> Hold(const std::string& address, const std::string& flag);

  PortHold() = default;
  PortHold(PortHold&& other) noexcept;
  PortHold& operator=(PortHold&& other) noexcept;
  PortHold(const PortHold&) = delete;
  PortHold& operator=(const PortHold&) = delete;
  ~PortHold() { Release(); }

  // The port becomes free for the server's own bind (idempotent).
  void Release();
  bool holds() const { return !fds_.empty(); }

 private:
  std::vector<int> fds_;
};

}  // namespace remotehead::server
