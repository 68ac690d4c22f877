// The addresses a server binds HOST:PORT on: the one resolution of a listening address that the
// group's store (c10d_group.cc) and the ports held until the server binds them
// (rpc/port_hold.h) share.
#pragma once

#include <netdb.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace remotehead::server {

using AddressList = std::unique_ptr<addrinfo, void (*)(addrinfo*)>;

// HOST's stream addresses for binding PORT (getaddrinfo with AI_PASSIVE: an empty host is
// every local address), walked through ai_next. UNAVAILABLE with the resolver's own message.
absl::StatusOr<AddressList> PassiveAddresses(const std::string& host, int port);

}  // namespace remotehead::server
