// A head group's processes joined on torch.distributed's C++ layer (c10d): a TCPStore for the
// rendezvous and the group's ordered command log, ProcessGroupGloo for tensors on the CPU and
// ProcessGroupNCCL for tensors on CUDA. Everything c10d is confined to
// server/src/group/c10d_group.cc; this interface is Abseil and LibTorch only.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/core/vocab_group.h"
#include "remotehead/server/group/mesh_epoch.h"

namespace remotehead::server {

struct GroupConfig {
  int size = 1;  // every process of the group (on a mesh, of every replica: R·K)
  int rank = 0;
  // The head's replicas on a mesh [R, K] (head_mesh.h): R of them, each a group of size / R
  // ranks; global rank g is rank g mod K of replica g / K.
  int replicas = 1;
  int ranks_per_replica() const { return size / replicas; }
  int replica() const { return rank / ranks_per_replica(); }
  int rank_in_replica() const { return rank % ranks_per_replica(); }
  std::string store_host = "127.0.0.1";  // rank 0 serves the TCPStore here; the others dial it
  int store_port = 29500;
  // The store is served by a process of its own (remotehead-server --serve_group_store), which
  // every rank dials, global rank 0 too (--group_store_external): then a mesh survives the loss
  // of any replica, replica 0's included (mesh_epoch.h).
  bool store_external = false;
  // "host:port" of the store, as messages name it.
  std::string store_address() const { return store_host + ":" + std::to_string(store_port); }
  // The address rank 0's store listens on (empty: store_host's); never every interface unless
  // it says so ("0.0.0.0" / "::").
  std::string store_bind;
  // Where rank 0's store listens: store_bind, else store_host.
  const std::string& listen_host() const { return store_bind.empty() ? store_host : store_bind; }
  // This rank's address (or a name resolving to it) for its Gloo collectives: their listening
  // socket (an ephemeral port) and the address peers connect to. Empty: GLOO_SOCKET_IFNAME's
  // interface, else 127.0.0.1 for a store on loopback, else the host name's address.
  std::string transport_host;
  // The group's shared secret, sealing every entry of its command log (group_log.h); empty:
  // none, accepted on loopback or with trusted_network only (CheckGroupPlane).
  std::string secret;
  bool trusted_network = false;  // --group_trusted_network
  // How long a collective or a store read waits for the other ranks before failing.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  torch::Device device = torch::kCPU;  // CPU: Gloo; CUDA: NCCL on this device
  std::string prefix = "remotehead";   // store keys of this group live under it
};

// The group flags as given (possibly empty) completed from torchrun-style environment variables
// (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) and checked. INVALID_ARGUMENT naming the flag:
// --group_size < 1, --group_rank outside [0, size), a --group_store that is not host:port, a
// --group_timeout_seconds <= 0.
struct GroupFlags {
  int size = 0;       // 0: from WORLD_SIZE, else 1 (no group)
  int rank = -1;      // -1: from RANK (any other negative rank is refused)
  std::string store;  // host:port; empty: MASTER_ADDR:MASTER_PORT
  double timeout_seconds = 60;
  std::string store_bind;       // --group_store_bind (empty: the host of the store's address)
  std::string transport_host;   // --group_transport_host (GroupConfig::transport_host)
  int replicas = 1;             // --group_replicas: must divide the size
  bool store_external = false;  // --group_store_external (GroupConfig::store_external)
};
absl::StatusOr<GroupConfig> ResolveGroupConfig(const GroupFlags& flags,
                                               const std::map<std::string, std::string>& env);

// The group plane's exposure rule: a group whose store is reached (or listens) beyond loopback
// needs a secret (--group_secret_file) unless the operator says that its network is trusted
// (--group_trusted_network). INVALID_ARGUMENT naming --group_secret_file otherwise.
absl::Status CheckGroupPlane(const GroupConfig& config);
// Whether `host` names the loopback interface (localhost, 127.0.0.0/8, ::1).
bool IsLoopbackHost(const std::string& host);

// Where a group's command log (group_log.h) lives in the store: every key of it under this
// prefix, and a log key's full name there (c10d's PrefixStore joins them with "/"), as a
// stranger's store client sees it (e.g. "remotehead/commands/cmd/5"; on a mesh
// "remotehead/replica/<r>/commands/…" and the mesh's own under its prefix).
std::string CommandLogPrefix(const GroupConfig& config);
std::string CommandLogStoreKey(const GroupConfig& config, const std::string& key);

// Bytes this rank's collectives handed to and received from the transport, by operation.
struct CollectiveBytes {
  int64_t calls = 0;
  int64_t sent = 0;
  int64_t received = 0;
};

// Keys and values in the group's store (c10d's TCPStore, served by global rank 0), under a
// prefix of their own.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` for `key` to exist, then returns its value; DEADLINE_EXCEEDED naming the
  // key if it does not appear in time.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          std::chrono::milliseconds timeout) = 0;
  virtual absl::Status Delete(const std::string& key) = 0;
  // Whether `key` exists now (no waiting).
  virtual absl::StatusOr<bool> Exists(const std::string& key) = 0;
  // `key` set to `desired` if it holds `expected`, or if it does not exist and `expected` is
  // empty (c10d's compareSet): the value it holds afterwards, so that of several processes
  // setting a missing key at once exactly one wins and every one learns which.
  virtual absl::StatusOr<std::string> CompareSet(const std::string& key,
                                                 const std::string& expected,
                                                 const std::string& desired) = 0;
};

// A connection of its own to the store of the group or mesh `config` joined (after Join /
// JoinMesh), keys under `<config.prefix>/<name>`: for what concerns every process of it
// (liveness.h). Its calls never wait behind a log's, whose reads block while they poll.
absl::StatusOr<std::unique_ptr<KeyValueStore>> OpenStore(const GroupConfig& config,
                                                         const std::string& name);

// The group's store served by this process alone (remotehead-server --serve_group_store), on
// config.store_bind (else the store's host) at config.store_port, for as long as the returned
// connection to it lives; UNAVAILABLE naming --group_store(_bind) when it cannot listen there.
absl::StatusOr<std::unique_ptr<KeyValueStore>> ServeStore(const GroupConfig& config);

class ProcessGroup : public core::GroupCollectives, public KeyValueStore {
 public:
  // Joins the group: rank 0 starts the store, listening on config.store_bind (else the store's
  // host) only, and every rank waits (up to config.timeout) for the others. UNAVAILABLE /
  // DEADLINE_EXCEEDED naming what did not answer; UNAVAILABLE naming --group_store(_bind) when
  // rank 0 cannot listen there.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Join(const GroupConfig& config);

  // The two groups of this rank on a mesh of config.replicas replicas (one store, served by
  // global rank 0): `replica`, the K ranks of its replica (its rank: config.rank_in_replica();
  // nullptr when K = 1), and `shard`, the R ranks that hold the same vocabulary shard in every
  // replica (its rank: config.replica()). Same errors as Join.
  struct Mesh {
    std::unique_ptr<ProcessGroup> replica;
    std::unique_ptr<ProcessGroup> shard;
  };
  static absl::StatusOr<Mesh> JoinMesh(const GroupConfig& config);
  // This rank's shard group in a later epoch of the mesh (mesh_epoch.h): the ranks of the same
  // shard in the replicas serving in `epoch` (its rank: its replica's index among them), under
  // the epoch's own prefix, on a store connection of its own. Same errors as Join.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> JoinShardInEpoch(const GroupConfig& config,
                                                                        const MeshEpoch& epoch);
  // This rank's replica's own group (K ranks) rebuilt when the replica is admitted again in
  // `epoch` (its processes are new: join.h), under the epoch's own prefix. Same errors as Join.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> JoinReplicaInEpoch(const GroupConfig& config,
                                                                          const MeshEpoch& epoch);
  ~ProcessGroup() override = default;

  virtual const GroupConfig& config() const = 0;
  // A group the mesh left (HeadMesh's epochs): NCCL's communicators aborted, so that a
  // collective still in flight on it fails at once instead of at NCCL's timeout. Gloo's backend
  // has nothing to abort: its collectives fail as their peers' connections close, and its
  // connections close when the group is destroyed.
  virtual void Abort() {}

  // The group's store (shared by every rank, KeyValueStore): values under keys, for commands
  // and their replies.

  // Every rank's `t` (same shape and dtype on all ranks) stacked by rank, [size, t.shape…], on
  // rank `root`; an undefined tensor on the other ranks.
  virtual absl::StatusOr<torch::Tensor> Gather(const torch::Tensor& t, int root) = 0;

  // What the collectives moved so far, by operation name ("all_gather", "reduce", "broadcast",
  // "gather").
  virtual std::map<std::string, CollectiveBytes> Bytes() const = 0;
};

}  // namespace remotehead::server
