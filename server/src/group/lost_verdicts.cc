#include "group/lost_verdicts.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "remotehead/core/error_reason.h"

namespace remotehead::server {
namespace {

std::string FirstSeen(const std::string& first_seen) {
  return first_seen.empty() ? std::string() : absl::StrCat(" (first seen as: ", first_seen, ")");
}

std::string ClusterName(const GroupConfig& config) {
  return config.replicas > 1 ? "mesh" : "head group";
}

}  // namespace

bool Refuses(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), address.substr(colon + 1).c_str(), &hints, &found) != 0) {
    return false;
  }
  bool refused = found != nullptr;
  for (addrinfo* a = found; a != nullptr && refused; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      refused = false;
      break;
    }
    int error = 0;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        pollfd p{.fd = fd, .events = POLLOUT, .revents = 0};
        socklen_t length = sizeof(error);
        error =
            ::poll(&p, 1, 300) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0
                ? error
                : ETIMEDOUT;
      }
    }
    ::close(fd);
    refused = error == ECONNREFUSED;
  }
  ::freeaddrinfo(found);
  return refused;
}

std::string Tenths(std::chrono::milliseconds d) {
  return absl::FormatDuration(absl::Milliseconds(d.count() / 100 * 100));
}

absl::Status LostProcessVerdict(const GroupConfig& config, const LostProcess& lost,
                                const std::string& first_seen) {
  const int k = config.ranks_per_replica();
  const std::string how =
      lost.global_rank == 0 && lost.since.count() < 0
          ? std::string("the store it serves cannot be reached")
          : absl::StrCat("no heartbeat for ", Tenths(lost.since), " (killed, crashed or hung)");
  return core::WithReason(
      absl::UnavailableError(absl::StrCat(
          lost.described, " is lost: ", how, ": the ", ClusterName(config), " of ", config.size,
          " processes is down — restart every process of it", FirstSeen(first_seen))),
      core::reason::kGroupUnavailable,
      {{"rank", absl::StrCat(config.rank)},
       {"lost_rank", absl::StrCat(lost.global_rank)},
       {"lost_replica", absl::StrCat(lost.global_rank / k)},
       {"lost_shard", absl::StrCat(lost.global_rank % k)},
       {"lost_address", lost.address}});
}

absl::Status LostStoreVerdict(const GroupConfig& config, const std::string& first_seen) {
  const std::string store = config.store_address();
  return core::WithReason(
      absl::UnavailableError(absl::StrCat(
          "the group's store at ", store,
          " (its own process: --group_store_external) cannot be reached: the ", ClusterName(config),
          " of ", config.size, " processes is down — restart the store and every process of it",
          FirstSeen(first_seen))),
      core::reason::kGroupUnavailable,
      {{"rank", absl::StrCat(config.rank)}, {"lost_store", store}});
}

}  // namespace remotehead::server
