// The group flags resolved into a GroupConfig (process_group.h), and the group plane's exposure
// rule: no c10d here.
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {
namespace {

std::string Lookup(const std::map<std::string, std::string>& env, const std::string& name) {
  const auto it = env.find(name);
  return it == env.end() ? std::string() : it->second;
}

absl::StatusOr<int> ParseInt(const std::string& text, const std::string& field) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected an integer; got \"", text, "\""));
  }
  return value;
}

absl::StatusOr<int> ParseRank(const std::string& text, const std::string& field, int size) {
  ASSIGN_OR_RETURN(const int rank, ParseInt(text, field));
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected a rank in [0, ", size, "); got ", rank));
  }
  return rank;
}

}  // namespace

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || absl::StartsWith(host, "127.") || host == "::1";
}

absl::Status CheckGroupPlane(const GroupConfig& config) {
  if (config.size <= 1 || !config.secret.empty() || config.trusted_network) {
    return absl::OkStatus();
  }
  const std::string& bind = config.listen_host();
  if (IsLoopbackHost(config.store_host) && IsLoopbackHost(bind)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--group_secret_file: expected the group's secret for a store beyond loopback (", bind, ":",
      config.store_port,
      "): anyone who reaches the store could run commands on the group; "
      "got none (--group_trusted_network accepts a network where only the group's ranks can reach "
      "the store)"));
}

absl::StatusOr<GroupConfig> ResolveGroupConfig(const GroupFlags& flags,
                                               const std::map<std::string, std::string>& env) {
  GroupConfig config;
  config.size = flags.size;
  const std::string world = Lookup(env, "WORLD_SIZE");
  if (config.size == 0 && !world.empty()) {
    ASSIGN_OR_RETURN(config.size, ParseInt(world, "WORLD_SIZE"));
    if (config.size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("WORLD_SIZE: expected at least 1 process; got ", config.size));
    }
  } else if (config.size == 0) {
    config.size = 1;
  }
  if (config.size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--group_size: expected at least 1 process; got ", config.size));
  }
  // -1 alone means "from the environment": any other negative rank is a mistake, not a default.
  const std::string rank = Lookup(env, "RANK");
  if (flags.rank == -1) {
    config.rank = 0;
    if (!rank.empty()) {
      ASSIGN_OR_RETURN(config.rank, ParseRank(rank, "RANK", config.size));
    }
  } else if (flags.rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--group_rank: expected a rank in [0, ", config.size,
                     ") or -1 (RANK from the environment); got ", flags.rank));
  } else {
    config.rank = flags.rank;
  }
  if (config.rank >= config.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--group_rank: expected a rank in [0, ", config.size, "); got ", config.rank));
  }
  std::string store = flags.store;
  if (store.empty()) {
    const std::string addr = Lookup(env, "MASTER_ADDR");
    const std::string port = Lookup(env, "MASTER_PORT");
    store = absl::StrCat(addr.empty() ? "127.0.0.1" : addr, ":", port.empty() ? "29500" : port);
  }
  const size_t colon = store.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(store.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--group_store: expected host:port of the group's TCPStore (rank 0 serves it); got \"",
        store, "\""));
  }
  config.store_host = store.substr(0, colon);
  // "[::1]:29500": the host without its brackets.
  if (config.store_host.size() > 2 && config.store_host.front() == '[' &&
      config.store_host.back() == ']') {
    config.store_host = config.store_host.substr(1, config.store_host.size() - 2);
  }
  config.store_port = port;
  config.store_bind = flags.store_bind;
  config.transport_host = flags.transport_host;
  if (flags.replicas < 1 || config.size % flags.replicas != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--group_replicas: expected a number of replicas that divides the mesh's ", config.size,
        " processes (--group_size or WORLD_SIZE = replicas x ranks per replica); got ",
        flags.replicas));
  }
  config.replicas = flags.replicas;
  config.store_external = flags.store_external;
  if (!(flags.timeout_seconds > 0) || flags.timeout_seconds > 86400) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--group_timeout_seconds: expected a value in (0, 86400]; got ", flags.timeout_seconds));
  }
  config.timeout = std::chrono::milliseconds(static_cast<int64_t>(flags.timeout_seconds * 1000.0));
  return config;
}

}  // namespace remotehead::server
