#include "group/passive_addresses.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace remotehead::server {

absl::StatusOr<AddressList> PassiveAddresses(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (const int err =
          ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      err != 0) {
    return absl::UnavailableError(::gai_strerror(err));
  }
  return AddressList(found, &::freeaddrinfo);
}

}  // namespace remotehead::server
