// The one file that includes c10d (torch.distributed's C++ layer, from the torch wheel). Gloo's
// own headers are not in the wheel: Debian's libgloo-dev supplies the declarations that
// ProcessGroupGloo.hpp needs, and nothing of Debian's libgloo is linked (LibTorch bundles a newer
// gloo with a different store interface).
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if defined(REMOTEHEAD_WITH_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "group/passive_addresses.h"
#include "group/store_keys.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {
namespace {

// A call `op` of this rank that failed with `detail`, as a status naming both: `timed_out`
// gives DEADLINE_EXCEEDED, else UNAVAILABLE.
absl::Status GroupCallFailed(const std::string& op, const GroupConfig& config,
                             absl::string_view detail, bool timed_out) {
  const std::string message = absl::StrCat("head group: ", op, " failed on rank ", config.rank,
                                           " of ", config.size, ": ", detail);
  const std::map<std::string, std::string> metadata = {{"op", op},
                                                       {"rank", absl::StrCat(config.rank)}};
  if (timed_out) {
    return core::WithReason(absl::DeadlineExceededError(message), core::reason::kGroupTimeout,
                            metadata);
  }
  return core::WithReason(absl::UnavailableError(message), core::reason::kGroupUnavailable,
                          metadata);
}

// A failed c10d call as a status naming the operation and this rank. c10d reports a timeout
// and a lost peer with the same exception types, so the time the call took tells them apart:
// a call that failed after (nearly) the whole --group_timeout_seconds timed out
// (DEADLINE_EXCEEDED), anything sooner (a peer that closed its connection, a transport error) is
// UNAVAILABLE.
absl::Status FromException(const std::exception& e, const std::string& op,
                           const GroupConfig& config, std::chrono::milliseconds timeout,
                           std::chrono::steady_clock::time_point start) {
  const absl::string_view what = e.what();
  return GroupCallFailed(op, config, what.substr(0, what.find('\n')),
                         std::chrono::steady_clock::now() - start >= timeout * 9 / 10);
}

// c10d's log below ERROR muted while it lives (c10d logs at FLAGS_caffe2_log_level, a global
// of c10's; only the thread of a group's store calls touches it).
class QuietC10dLog {
 public:
  QuietC10dLog() : saved_(FLAGS_caffe2_log_level) {
    FLAGS_caffe2_log_level = std::max(saved_, 2);  // 2: ERROR
  }
  ~QuietC10dLog() { FLAGS_caffe2_log_level = saved_; }
  QuietC10dLog(const QuietC10dLog&) = delete;
  QuietC10dLog& operator=(const QuietC10dLog&) = delete;

 private:
  const int saved_;
};

// Keys under one prefix of the store; every failed call a status naming the call and the key.
class C10dStore final : public KeyValueStore {
 public:
  C10dStore(const GroupConfig& config, c10::intrusive_ptr<c10d::Store> store)
      : config_(config), store_(std::move(store)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    return StoreCall("set", key, config_.timeout,
                     [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    std::vector<uint8_t> bytes;
    RETURN_IF_ERROR(StoreCall("get", key, timeout, [&] {
      // A wait that times out is how a following rank polls for the next command: c10d's
      // warning for each (and for a store that went away, which the status reports) is muted.
      const QuietC10dLog quiet;
      store_->wait({key}, timeout);
      bytes = ReadIfThere(key);
    }));
    if (bytes == AbsentMark()) {
      // Deleted between the wait and the read (the front deletes replies that their ranks may
      // still be watching; a stranger may delete anything): as if it had not come in time.
      return GroupCallFailed(absl::StrCat("store get \"", key, "\""), config_,
                             "deleted while it was read", /*timed_out=*/true);
    }
    return std::string(bytes.begin(), bytes.end());
  }

  absl::Status Delete(const std::string& key) override {
    return StoreCall("delete", key, config_.timeout, [&] { store_->deleteKey(key); });
  }

  absl::StatusOr<bool> Exists(const std::string& key) override {
    bool exists = false;
    RETURN_IF_ERROR(
        StoreCall("check", key, config_.timeout, [&] { exists = store_->check({key}); }));
    return exists;
  }

  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    std::vector<uint8_t> now;
    RETURN_IF_ERROR(StoreCall("compare-set", key, config_.timeout, [&] {
      now = store_->compareSet(key, std::vector<uint8_t>(expected.begin(), expected.end()),
                               std::vector<uint8_t>(desired.begin(), desired.end()));
    }));
    return std::string(now.begin(), now.end());
  }

 private:
  // What ReadIfThere answers for a missing key: no writer of the store writes these bytes.
  static const std::vector<uint8_t>& AbsentMark() {
    static const std::vector<uint8_t> mark = [] {
      constexpr char kText[] = "\0remotehead: no such key\0";
      return std::vector<uint8_t>(kText, kText + sizeof(kText) - 1);
    }();
    return mark;
  }

  // The value at `key`, or AbsentMark() if there is none, in one request. Not c10d's get(): its
  // plain TCPStore server answers a GET of a missing key by closing the connection, so a key
  // deleted after a wait saw it would cut this process off the store. A compare-and-set whose
  // expected value is the mark changes nothing and answers the value, or the mark when the key
  // is missing (the server then creates nothing).
  std::vector<uint8_t> ReadIfThere(const std::string& key) {
    return store_->compareSet(key, AbsentMark(), AbsentMark());
  }

  // Runs one store call that may wait up to `timeout`; an exception (a timeout, a store that is
  // gone) becomes a status naming the call and the key.
  template <typename Call>
  absl::Status StoreCall(const char* verb, const std::string& key,
                         std::chrono::milliseconds timeout, Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    try {
      call();
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return FromException(e, absl::StrCat("store ", verb, " \"", key, "\""), config_, timeout,
                           start);
    }
  }

  const GroupConfig config_;
  c10::intrusive_ptr<c10d::Store> store_;
};

class C10dGroup final : public ProcessGroup {
 public:
  C10dGroup(GroupConfig config, c10::intrusive_ptr<c10d::Store> store,
            c10::intrusive_ptr<c10d::Backend> backend)
      : config_(std::move(config)),
        store_(config_, std::move(store)),
        backend_(std::move(backend)) {}

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  const GroupConfig& config() const override { return config_; }
  void Abort() override { backend_->abort(); }

  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& t) override {
    std::vector<int64_t> shape = {config_.size};
    shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
    torch::Tensor out = torch::empty(shape, t.options());
    std::vector<torch::Tensor> input = {t.contiguous()};
    std::vector<std::vector<torch::Tensor>> outputs(1);
    for (int r = 0; r < config_.size; ++r) outputs[0].push_back(out[r]);
    const int64_t peers = config_.size - 1;
    RETURN_IF_ERROR(Run("all_gather", t.nbytes() * peers, t.nbytes() * peers,
                        [&] { return backend_->allgather(outputs, input); }));
    return out;
  }

  absl::Status ReduceSum(torch::Tensor& t, int root) override {
    std::vector<torch::Tensor> tensors = {t};
    c10d::ReduceOptions options;
    options.rootRank = root;
    options.reduceOp = c10d::ReduceOp::SUM;
    const int64_t n = t.nbytes();
    const bool is_root = config_.rank == root;
    return Run("reduce", is_root ? 0 : n, is_root ? n * (config_.size - 1) : 0,
               [&] { return backend_->reduce(tensors, options); });
  }

  absl::Status Broadcast(torch::Tensor& t, int root) override {
    std::vector<torch::Tensor> tensors = {t};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    const int64_t n = t.nbytes();
    const bool is_root = config_.rank == root;
    return Run("broadcast", is_root ? n * (config_.size - 1) : 0, is_root ? 0 : n,
               [&] { return backend_->broadcast(tensors, options); });
  }

  absl::StatusOr<torch::Tensor> Gather(const torch::Tensor& t, int root) override {
    const bool is_root = config_.rank == root;
    std::vector<torch::Tensor> input = {t.contiguous()};
    std::vector<std::vector<torch::Tensor>> outputs;  // c10d: empty off the root
    torch::Tensor out;
    if (is_root) {
      std::vector<int64_t> shape = {config_.size};
      shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
      out = torch::empty(shape, t.options());
      outputs.emplace_back();
      for (int r = 0; r < config_.size; ++r) outputs[0].push_back(out[r]);
    }
    c10d::GatherOptions options;
    options.rootRank = root;
    const int64_t n = t.nbytes();
    RETURN_IF_ERROR(Run("gather", is_root ? 0 : n, is_root ? n * (config_.size - 1) : 0,
                        [&] { return backend_->gather(outputs, input, options); }));
    return out;
  }

  absl::Status Set(const std::string& key, const std::string& value) override {
    return store_.Set(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    return store_.Get(key, timeout);
  }
  absl::Status Delete(const std::string& key) override { return store_.Delete(key); }
  absl::StatusOr<bool> Exists(const std::string& key) override { return store_.Exists(key); }
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    return store_.CompareSet(key, expected, desired);
  }

  std::map<std::string, CollectiveBytes> Bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }

 private:
  // Runs one collective to completion (wait() throws on a timeout or a lost peer) and counts it.
  template <typename Launch>
  absl::Status Run(const std::string& op, int64_t sent, int64_t received, Launch&& launch) {
    const auto start = std::chrono::steady_clock::now();
    try {
      launch()->wait();
    } catch (const std::exception& e) {
      return FromException(e, op, config_, config_.timeout, start);
    }
    std::lock_guard<std::mutex> lock(mu_);
    CollectiveBytes& b = bytes_[op];
    ++b.calls;
    b.sent += sent;
    b.received += received;
    return absl::OkStatus();
  }

  const GroupConfig config_;
  C10dStore store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  mutable std::mutex mu_;
  std::map<std::string, CollectiveBytes> bytes_;
};

// A listening socket on `host`:`port` only (c10d's own store server listens on every address):
// handed to the TCPStore, which takes it over. UNAVAILABLE naming `flag` if it cannot be bound.
absl::StatusOr<int> ListenOn(const std::string& host, int port, const std::string& flag) {
  const absl::StatusOr<AddressList> found = PassiveAddresses(host, port);
  if (!found.ok()) {
    return absl::UnavailableError(absl::StrCat(flag, ": cannot resolve \"", host,
                                               "\" to listen on (", found.status().message(), ")"));
  }
  std::string last_error = "no address";
  int fd = -1;
  for (const addrinfo* a = found->get(); a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat(flag, ": cannot listen on ", host, ":", port, " (", last_error, ")"));
  }
  return fd;
}

// Gloo's transport device: --group_transport_host's address, else GLOO_SOCKET_IFNAME's interface
// (as torch.distributed reads it), else the loopback interface for a group on one machine, else
// this host's address. Gloo listens there on an ephemeral port (there is no setting for it).
std::shared_ptr<::gloo::transport::Device> GlooDevice(const GroupConfig& config) {
  if (!config.transport_host.empty()) {
    return c10d::ProcessGroupGloo::createDeviceForHostname(config.transport_host);
  }
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (IsLoopbackHost(config.store_host)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::Backend> MakeBackend(const GroupConfig& config,
                                              const c10::intrusive_ptr<c10d::Store>& store) {
  if (config.device.is_cuda()) {
#if defined(REMOTEHEAD_WITH_NCCL)
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = config.timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, config.rank, config.size, options);
#else
    throw std::runtime_error("this build has no NCCL (LibTorch without CUDA)");
#endif
  }
  auto options = c10d::ProcessGroupGloo::Options::create(config.timeout);
  options->devices.push_back(GlooDevice(config));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, config.rank, config.size, options);
}

// The TCPStore every group of this process uses: served by global rank 0 (on the store's bind
// address only), dialled by every other rank; or served by a process of its own
// (--group_store_external, ServeStore) and dialled by every rank.
c10::intrusive_ptr<c10d::TCPStore> ConnectStore(const GroupConfig& config, absl::Status* failed) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(config.store_port);
  store_options.isServer = config.rank == 0 && !config.store_external;
  if (store_options.isServer) {
    absl::StatusOr<int> fd =
        ListenOn(config.listen_host(), config.store_port,
                 config.store_bind.empty() ? "--group_store" : "--group_store_bind");
    if (!fd.ok()) {
      *failed = fd.status();
      return {};
    }
    store_options.masterListenFd = *fd;
  }
  store_options.numWorkers = config.size;
  store_options.waitWorkers = false;
  store_options.timeout = config.timeout;
  store_options.useLibUV = false;
  return c10::make_intrusive<c10d::TCPStore>(config.store_host, store_options);
}

// The group of `member` (its size, rank and key prefix) on `tcp`: the backend's rendezvous keys
// and our commands under prefixes of their own.
std::unique_ptr<ProcessGroup> GroupOn(const c10::intrusive_ptr<c10d::TCPStore>& tcp,
                                      const GroupConfig& member) {
  auto backend = MakeBackend(
      member, c10::make_intrusive<c10d::PrefixStore>(store_keys::Backend(member.prefix), tcp));
  auto commands = c10::make_intrusive<c10d::PrefixStore>(CommandLogPrefix(member), tcp);
  return std::make_unique<C10dGroup>(member, commands, backend);
}

}  // namespace

absl::StatusOr<std::unique_ptr<KeyValueStore>> ServeStore(const GroupConfig& config) {
  const auto start = std::chrono::steady_clock::now();
  try {
    GroupConfig server = config;
    server.rank = 0;
    server.store_external = false;
    absl::Status failed;
    auto tcp = ConnectStore(server, &failed);
    RETURN_IF_ERROR(failed);
    return std::make_unique<C10dStore>(config,
                                       c10::make_intrusive<c10d::PrefixStore>(
                                           store_keys::Named(config.prefix, "store-process"), tcp));
  } catch (const std::exception& e) {
    return FromException(
        e, absl::StrCat("serving the store on ", config.listen_host(), ":", config.store_port),
        config, config.timeout, start);
  }
}

absl::StatusOr<std::unique_ptr<KeyValueStore>> OpenStore(const GroupConfig& config,
                                                         const std::string& name) {
  const auto start = std::chrono::steady_clock::now();
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(config.store_port);
    options.isServer = false;  // global rank 0's server, which Join started, serves it too
    options.waitWorkers = false;
    options.timeout = config.timeout;
    options.useLibUV = false;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(config.store_host, options);
    return std::make_unique<C10dStore>(config, c10::make_intrusive<c10d::PrefixStore>(
                                                   store_keys::Named(config.prefix, name), tcp));
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("connecting to the store at ", config.store_address()),
                         config, config.timeout, start);
  }
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Join(const GroupConfig& config) {
  const auto start = std::chrono::steady_clock::now();
  try {
    absl::Status failed;
    auto tcp = ConnectStore(config, &failed);
    RETURN_IF_ERROR(failed);
    return GroupOn(tcp, config);
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("joining the group at ", config.store_address()), config,
                         config.timeout, start);
  }
}

namespace {

// `member` (a group of a mesh's epoch) joined on a store connection of its own to global rank
// 0's store, started at the first rendezvous; `what` names it in errors.
absl::StatusOr<std::unique_ptr<ProcessGroup>> JoinLater(const GroupConfig& config,
                                                        const GroupConfig& member,
                                                        const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(config.store_port);
    options.isServer = false;
    options.waitWorkers = false;
    options.timeout = config.timeout;
    options.useLibUV = false;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(config.store_host, options);
    return GroupOn(tcp, member);
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("joining ", what, " at ", config.store_address()), config,
                         config.timeout, start);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::JoinShardInEpoch(
    const GroupConfig& config, const MeshEpoch& epoch) {
  GroupConfig shard = config;
  shard.size = static_cast<int>(epoch.live.size());
  shard.rank = epoch.IndexOf(config.replica());
  shard.replicas = 1;
  shard.prefix =
      store_keys::ShardGroupInEpoch(config.prefix, config.rank_in_replica(), epoch.number);
  if (shard.rank < 0) {
    return absl::FailedPreconditionError(absl::StrCat("mesh ", epoch.Describe(), ": replica ",
                                                      config.replica(), " does not serve in it"));
  }
  return JoinLater(config, shard, absl::StrCat("the shard peers of mesh epoch ", epoch.number));
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::JoinReplicaInEpoch(
    const GroupConfig& config, const MeshEpoch& epoch) {
  GroupConfig replica = config;
  replica.size = config.ranks_per_replica();
  replica.rank = config.rank_in_replica();
  replica.replicas = 1;
  replica.prefix = store_keys::ReplicaGroupInEpoch(config.prefix, config.replica(), epoch.number);
  return JoinLater(
      config, replica,
      absl::StrCat("replica ", config.replica(), "'s group in mesh epoch ", epoch.number));
}

absl::StatusOr<ProcessGroup::Mesh> ProcessGroup::JoinMesh(const GroupConfig& config) {
  const auto start = std::chrono::steady_clock::now();
  try {
    absl::Status failed;
    auto tcp = ConnectStore(config, &failed);
    RETURN_IF_ERROR(failed);
    Mesh mesh;
    // Every rank joins its replica's group first, then its shard's: the rendezvous of each
    // group waits only for its own members, so the order cannot deadlock.
    const int k = config.ranks_per_replica();
    if (k > 1) {
      GroupConfig replica = config;
      replica.size = k;
      replica.rank = config.rank_in_replica();
      replica.replicas = 1;
      replica.prefix = store_keys::ReplicaGroup(config.prefix, config.replica());
      mesh.replica = GroupOn(tcp, replica);
    }
    GroupConfig shard = config;
    shard.size = config.replicas;
    shard.rank = config.replica();
    shard.replicas = 1;
    shard.prefix = store_keys::ShardGroup(config.prefix, config.rank_in_replica());
    mesh.shard = GroupOn(tcp, shard);
    return mesh;
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("joining the mesh at ", config.store_address()), config,
                         config.timeout, start);
  }
}

}  // namespace remotehead::server
