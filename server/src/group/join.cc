#include "group/join.h"

#include <algorithm>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "group/exchange.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

std::string Sealing(const GroupConfig& config) {
  return !config.secret.empty() ? "sealed with the group's secret"
                                : "NOT authenticated (no --group_secret_file)";
}

absl::StatusOr<std::unique_ptr<HeadGroup>> OpenGroup(std::unique_ptr<ProcessGroup> group,
                                                     const GroupConfig& config) {
  auto head_group = std::make_unique<HeadGroup>(std::move(group), config.secret, &std::cerr);
  RETURN_IF_ERROR(head_group->Open());
  return head_group;
}

// Every process's heartbeat on a store connection of its own (liveness.h); `joining`: a
// process of an evicted replica, joining the running mesh (JoinRunningMesh).
absl::StatusOr<std::unique_ptr<Liveness>> StartLiveness(const GroupConfig& config,
                                                        bool joining = false) {
  const Liveness::Timing timing{.lost = config.timeout};
  GroupConfig connection = config;
  connection.timeout = Liveness::StoreTimeout(timing);
  ASSIGN_OR_RETURN(std::unique_ptr<KeyValueStore> store, OpenStore(connection, "liveness"));
  return Liveness::Start(config, &std::cerr, timing, std::move(store), joining);
}

// Whether a mesh runs already at the store (a process of it restarted, or one whose replica was
// evicted restarted itself): then this process joins it instead of the first rendezvous.
absl::StatusOr<bool> MeshRunning(const GroupConfig& config) {
  ASSIGN_OR_RETURN(std::unique_ptr<KeyValueStore> store, OpenStore(config, "liveness"));
  return Liveness::MeshRunning(*store, config);
}

void EnableEviction(Liveness& liveness, const MeshOptions& options) {
  liveness.epochs().Enable(options.min_replicas,
                           {.evictions = options.max_evictions, .window = options.eviction_window});
}

// A later epoch's cross-replica groups (mesh_epoch.h) of this process: built as the first ones
// were, among the replicas that serve in it.
absl::StatusOr<EpochGroups> JoinEpoch(const GroupConfig& config, Liveness* liveness,
                                      const MeshEpoch& epoch) {
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> shard,
                   ProcessGroup::JoinShardInEpoch(config, epoch));
  EpochGroups groups;
  if (config.rank_in_replica() != 0) {
    groups.shard_peers = std::move(shard);
    return groups;
  }
  ASSIGN_OR_RETURN(groups.fronts, OpenGroup(std::move(shard), config));
  groups.fronts->set_liveness(liveness);
  std::cout << "remotehead-server: mesh " << epoch.Describe() << ": replica " << config.replica()
            << "'s front joined its log" << std::endl;
  return groups;
}

// A process of an evicted replica joins the running mesh: it asks (sealed) and waits until the
// leader admits its whole replica in a new epoch, then joins its replica's group and the epoch's
// cross-replica groups under that epoch's prefixes. Its heads come from the heal (HeadMesh).
absl::StatusOr<Cluster> JoinRunningMesh(const GroupConfig& config, const MeshOptions& options) {
  std::cout << "remotehead-server: a mesh runs at " << config.store_address() << ": rank "
            << config.rank << " (replica " << config.replica() << ", shard "
            << config.rank_in_replica()
            << ") asks to join it again; the leader admits the whole replica between two steps"
            << std::endl;
  Cluster cluster;
  cluster.joined_running = true;
  ASSIGN_OR_RETURN(cluster.liveness, StartLiveness(config, /*joining=*/true));
  Liveness* liveness = cluster.liveness.get();
  EnableEviction(*liveness, options);
  ASSIGN_OR_RETURN(const MeshEpoch admitted, liveness->AwaitAdmission());
  if (config.ranks_per_replica() > 1) {
    ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> replica,
                     ProcessGroup::JoinReplicaInEpoch(config, admitted));
    ASSIGN_OR_RETURN(cluster.group, OpenGroup(std::move(replica), config));
    cluster.group->set_liveness(liveness);
  }
  ASSIGN_OR_RETURN(EpochGroups groups, JoinEpoch(config, liveness, admitted));
  cluster.mesh =
      std::make_unique<HeadMesh>(config.replica(), config.replicas, options,
                                 std::move(groups.fronts), std::move(groups.shard_peers));
  cluster.mesh->Joined(admitted);
  cluster.mesh->set_liveness(liveness, [config, liveness](const MeshEpoch& epoch) {
    return JoinEpoch(config, liveness, epoch);
  });
  std::cout << "remotehead-server: admitted to the mesh in " << admitted.Describe()
            << ": waiting for the heal (every head's state from the leader, replica "
            << admitted.leader() << ")" << std::endl;
  return cluster;
}

}  // namespace

namespace {

// --testonly_mesh_pause as options (MeshOptions::TestOnlyPause).
absl::StatusOr<MeshOptions::TestOnlyPause> ResolveTestOnlyPause(const MeshFlags& flags) {
  MeshOptions::TestOnlyPause pause;
  if (flags.testonly_pause.empty()) return pause;
  if (!flags.test_environment) {
    return absl::InvalidArgumentError(
        "--testonly_mesh_pause: a fault point for tests only: expected REMOTEHEAD_TESTONLY=1 in "
        "the environment; got none");
  }
  const std::vector<std::string> fields = absl::StrSplit(flags.testonly_pause, ',');
  double seconds = 0;
  if (fields.size() != 3 ||
      (fields[0] != "after_sum" && fields[0] != "after_apply" && fields[0] != "before_heal") ||
      !absl::SimpleAtoi(fields[1], &pause.version) || !absl::SimpleAtod(fields[2], &seconds) ||
      seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--testonly_mesh_pause: expected \"after_sum|after_apply,<weight version>,<seconds>\" "
        "or \"before_heal,<epoch>,<seconds>\"; got \"",
        flags.testonly_pause, "\""));
  }
  pause.point = fields[0];
  pause.pause = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  return pause;
}

}  // namespace

absl::StatusOr<MeshOptions> ResolveMeshOptions(const MeshFlags& flags, int replicas) {
  MeshOptions options;
  if (flags.reduce_dtype == "bfloat16") {
    options.reduce_dtype = torch::kBFloat16;
  } else if (flags.reduce_dtype != "float32") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mesh_reduce_dtype: expected float32 or bfloat16; got \"", flags.reduce_dtype, "\""));
  }
  if (flags.checksum_every_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mesh_checksum_every_steps: expected >= 0; got ", flags.checksum_every_steps));
  }
  options.checksum_every_steps = flags.checksum_every_steps;
  if (flags.min_replicas < 0 || flags.min_replicas > std::max(replicas, 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--mesh_min_replicas: expected 1 to --group_replicas (", replicas,
                     "), or 0 for every replica; got ", flags.min_replicas));
  }
  options.min_replicas = flags.min_replicas;
  if (flags.max_evictions < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--mesh_max_evictions: expected >= 0 (0: no cap); got ", flags.max_evictions));
  }
  if (!(flags.eviction_window_seconds > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mesh_eviction_window_seconds: expected > 0; got ", flags.eviction_window_seconds));
  }
  options.max_evictions = flags.max_evictions;
  options.eviction_window =
      std::chrono::seconds(static_cast<int64_t>(flags.eviction_window_seconds));
  ASSIGN_OR_RETURN(options.testonly_pause, ResolveTestOnlyPause(flags));
  if (flags.testonly_corrupt_heal && !flags.test_environment) {
    return absl::InvalidArgumentError(
        "--testonly_mesh_corrupt_heal: a fault for tests only: expected REMOTEHEAD_TESTONLY=1 in "
        "the environment; got none");
  }
  options.testonly_corrupt_heal = flags.testonly_corrupt_heal;
  return options;
}

absl::Status Cluster::health() const {
  if (liveness != nullptr) RETURN_IF_ERROR(liveness->health());
  return placement().health();
}

std::vector<MetricSource*> Cluster::metric_sources() const {
  std::vector<MetricSource*> sources;
  if (group != nullptr) sources.push_back(group.get());
  if (mesh != nullptr) sources.push_back(mesh.get());
  return sources;
}

void Cluster::ObserveGroupCommands(std::function<void(const std::string&, double)> observer) const {
  if (group != nullptr) group->set_observer(std::move(observer));
}

std::vector<HeadGroup*> Cluster::logs_led() const {
  std::vector<HeadGroup*> logs;
  if (group != nullptr && group->is_front()) logs.push_back(group.get());
  if (mesh != nullptr && mesh->is_leader()) logs.push_back(mesh->fronts());
  return logs;
}

absl::StatusOr<std::vector<std::string>> Cluster::AllGather(const std::string& mine) const {
  std::vector<std::string> replica = {mine};
  if (group != nullptr) {
    ASSIGN_OR_RETURN(replica, AllGatherStrings(group->collectives(), mine));
  }
  if (mesh == nullptr) return replica;
  ASSIGN_OR_RETURN(const std::vector<std::string> replicas,
                   AllGatherStrings(mesh->peers(), PackStrings(replica)));
  std::vector<std::string> world;
  for (const std::string& packed : replicas) {
    ASSIGN_OR_RETURN(const std::vector<std::string> ranks, UnpackStrings(packed));
    world.insert(world.end(), ranks.begin(), ranks.end());
  }
  return world;
}

absl::StatusOr<Cluster> JoinCluster(const GroupConfig& config, const MeshOptions& mesh_options) {
  Cluster cluster;
  if (config.size <= 1) return cluster;
  const std::string transport = config.device.is_cuda() ? "NCCL" : "Gloo";
  const std::string store = config.store_address();
  const std::string listening =
      config.rank == 0 && !config.store_external
          ? absl::StrCat("; store listening on ", config.listen_host(), ":", config.store_port)
          : std::string();
  if (config.replicas <= 1) {
    std::cout << "remotehead-server: joining head group as rank " << config.rank << " of "
              << config.size << " at " << store << " (" << transport << ")" << std::endl;
    ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> group, ProcessGroup::Join(config));
    ASSIGN_OR_RETURN(cluster.group, OpenGroup(std::move(group), config));
    // After the log opened: ranks whose secrets differ are refused by it, naming the rank.
    ASSIGN_OR_RETURN(cluster.liveness, StartLiveness(config));
    cluster.group->set_liveness(cluster.liveness.get());
    std::cout << "remotehead-server: head group joined: rank " << config.rank << " of "
              << config.size
              << (config.rank == 0 ? " (the front: serves HeadService)"
                                   : " (follows the front's commands)")
              << "; command log " << Sealing(config) << listening << std::endl;
    return cluster;
  }
  // Replica 0's processes too once the store is external: global rank 0 serves it otherwise,
  // and a mesh that lost it is down, never running.
  if (mesh_options.min_replicas > 0 && (config.replica() != 0 || config.store_external)) {
    ASSIGN_OR_RETURN(const bool running, MeshRunning(config));
    if (running) return JoinRunningMesh(config, mesh_options);
  }
  const int k = config.ranks_per_replica();
  std::cout << "remotehead-server: joining a mesh of " << config.replicas << " replicas x " << k
            << " ranks as rank " << config.rank << " (replica " << config.replica() << ", shard "
            << config.rank_in_replica() << ") at " << store << " (" << transport << ")"
            << std::endl;
  ASSIGN_OR_RETURN(ProcessGroup::Mesh joined, ProcessGroup::JoinMesh(config));
  if (joined.replica != nullptr) {
    ASSIGN_OR_RETURN(cluster.group, OpenGroup(std::move(joined.replica), config));
  }
  std::unique_ptr<HeadGroup> fronts;
  if (config.rank_in_replica() == 0) {
    ASSIGN_OR_RETURN(fronts, OpenGroup(std::move(joined.shard), config));
  }
  ASSIGN_OR_RETURN(cluster.liveness, StartLiveness(config));
  Liveness* liveness = cluster.liveness.get();
  if (mesh_options.min_replicas > 0) EnableEviction(*liveness, mesh_options);
  if (cluster.group != nullptr) cluster.group->set_liveness(liveness);
  if (fronts != nullptr) fronts->set_liveness(liveness);
  cluster.mesh = std::make_unique<HeadMesh>(config.replica(), config.replicas, mesh_options,
                                            std::move(fronts), std::move(joined.shard));
  cluster.mesh->set_liveness(liveness, [config, liveness](const MeshEpoch& epoch) {
    return JoinEpoch(config, liveness, epoch);
  });
  std::cout << "remotehead-server: mesh joined: replica " << config.replica() << " of "
            << config.replicas << ", rank " << config.rank_in_replica() << " of " << k
            << (config.rank_in_replica() != 0 ? " (follows its replica's front)"
                : config.replica() == 0       ? " (the leader: serves HeadService and leads the "
                                                "mesh)"
                                              : " (a replica's front: serves HeadService, follows "
                                                "the leader)")
            << "; logs " << Sealing(config) << listening << std::endl;
  return cluster;
}

}  // namespace remotehead::server
