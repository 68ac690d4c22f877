#include "rpc/serving.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "group/join.h"
#include "group/store_keys.h"
#include "replication/cluster_drain.h"

namespace remotehead::server {
namespace {

constexpr std::chrono::milliseconds kPoll{100};

// Health turns NOT_SERVING once, saying why.
class Health {
 public:
  Health(grpc::Server& server, std::ostream& err) : server_(server), err_(err) {}
  void NotServing(const std::string& why = "") {
    if (!serving_.exchange(false)) return;
    server_.GetHealthCheckService()->SetServingStatus(false);
    if (!why.empty()) err_ << "remotehead-server: NOT_SERVING: " << why << std::endl;
  }
  bool serving() const { return serving_.load(); }

 private:
  grpc::Server& server_;
  std::ostream& err_;
  std::atomic<bool> serving_{true};
};

// A server on its own: serves until the signal, drains its calls, saves every head's state.
int ServeAlone(grpc::Server& server, HeadService& service, const std::atomic<int>& signal,
               const ServingOptions& options) {
  while (signal.load() == 0) std::this_thread::sleep_for(kPoll);
  *options.out << "remotehead-server: draining (up to " << DrainSeconds(options.grace) << " s)"
               << std::endl;
  server.GetHealthCheckService()->SetServingStatus(false);
  service.Drain();
  server.Shutdown(std::chrono::system_clock::now() + options.grace);
  const absl::Status saved = service.SaveAllStates();
  if (!saved.ok()) {
    *options.err << "remotehead-server: head states NOT saved at shutdown: " << saved.message()
                 << std::endl;
    // A state that was not saved is training lost: not a clean stop.
    *options.err << "remotehead-server: stopped, with head states not saved" << std::endl;
    return 1;
  }
  if (!options.state_dir.empty()) {
    *options.out << "remotehead-server: head states saved to " << options.state_dir << std::endl;
  }
  *options.out << "remotehead-server: stopped" << std::endl;
  return 0;
}

// A signalled rank stops by `deadline` whatever blocks it (a store that no longer answers, a
// follower stuck in it): the process then exits 1, saying that nothing was saved.
void StopBy(ClusterDrain::Clock::time_point deadline, std::ostream& err) {
  std::thread([deadline, &err] {
    std::this_thread::sleep_until(deadline);
    err << "remotehead-server: stopped: the drain did not end in time and this rank could not "
           "stop cleanly (its group's store does not answer?): head states NOT saved"
        << std::endl;
    std::cout.flush();
    std::_Exit(1);
  }).detach();
}

// This process's replica was evicted from its mesh (`verdict`): it starts again as a new process
// with the same command line, which asks to join the running mesh (join.h). Every descriptor is
// closed across the exec (its sockets: the gRPC and metrics ports, the groups' connections).
// If its own heal failed it leaves instead (exit code 1); returns only if the exec failed.
[[noreturn]] void RestartToRejoin(const Cluster& cluster, const absl::Status& verdict,
                                  const ServingOptions& options) {
  if (cluster.mesh->heal_failed()) {
    *options.err << "remotehead-server: this process's replica was evicted again after its heal "
                    "failed (the heads' states it received did not verify): it leaves the mesh"
                 << std::endl;
    std::cout.flush();
    std::_Exit(1);  // its follower and groups are not waited for: nothing of it is kept
  }
  *options.err << "remotehead-server: " << verdict.message() << std::endl;
  *options.out << "remotehead-server: restarting to join the mesh again (a new process with the "
                  "same flags)"
               << std::endl;
  std::cout.flush();
  std::cerr.flush();
  if (DIR* fds = opendir("/proc/self/fd"); fds != nullptr) {
    const int own = dirfd(fds);
    while (const dirent* entry = readdir(fds)) {
      int fd = -1;
      if (!absl::SimpleAtoi(entry->d_name, &fd) || fd <= 2 || fd == own) continue;
      const int flags = fcntl(fd, F_GETFD);
      if (flags >= 0) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
    }
    closedir(fds);
  }
  execv("/proc/self/exe", options.restart_argv);
  *options.err << "remotehead-server: could not restart (" << std::strerror(errno)
               << "): this process leaves; restart it to join the mesh again" << std::endl;
  std::cout.flush();
  std::_Exit(1);
}

// Whether a signal makes this process leave its mesh instead of draining it: on a mesh that
// evicts (--mesh_min_replicas), a process of a replica other than the leader's that serves, when
// the mesh keeps its minimum without it. Its replica is evicted (the others go on, its trainers
// move and resend their open step) and, started again with its flags (a pod that its StatefulSet
// restarts), it rejoins and is healed: nothing needs saving. Otherwise the signal drains the
// mesh, saving every head's state on every rank.
bool LeavesAtSignal(const Cluster& cluster) {
  const HeadMesh* mesh = cluster.mesh.get();
  if (mesh == nullptr || !mesh->evicts() || mesh->replica() == mesh->leader_replica()) {
    return false;
  }
  const MeshEpoch epoch = mesh->epoch();
  const int minimum = mesh->options().min_replicas;
  return epoch.serves(mesh->replica()) && static_cast<int>(epoch.live.size()) - 1 >= minimum;
}

// How long a signalled process that may leave waits for the leader's drain first: a drain the
// leader began (its own signal) is told to the fronts within a poll or two.
constexpr std::chrono::milliseconds kLeaveGrace{1500};

// Whether the mesh's leader began draining (MeshSteps::Drain told the fronts).
bool LeaderDrains(const Cluster& cluster) {
  if (cluster.liveness == nullptr) return false;
  const absl::StatusOr<std::optional<std::string>> told =
      cluster.liveness->Read(store_keys::kMeshDraining);
  return told.ok() && told->has_value();
}

[[noreturn]] void Leave(grpc::Server& server, int signal, const Cluster& cluster,
                        const ServingOptions& options) {
  *options.out << "remotehead-server: signal " << signal << ": this process of replica "
               << cluster.mesh->replica()
               << " leaves the mesh, which evicts its replica and goes on without it "
                  "(--mesh_min_replicas); started again with its flags, it rejoins and is healed"
               << std::endl;
  // Its calls' dW would leave with it: they end now, and their trainers resend them elsewhere.
  server.Shutdown(std::chrono::system_clock::now());
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(0);  // its groups and follower are not waited for: its peers see it gone
}

// A rank of a group or mesh: serves (and follows its log) until the drain says stop.
int ServeInCluster(grpc::Server& server, HeadService& service, const Cluster& cluster,
                   const std::atomic<int>& signal, const ServingOptions& options) {
  Health health(server, *options.err);
  ClusterDrain& drain = service.cluster_drain();
  const bool front = cluster.serves();
  drain.Configure(
      {.grace = options.grace, .save = options.save, .global_rank = options.global_rank},
      [&](ClusterDrain::Clock::time_point deadline) {
        health.NotServing();
        if (!front) return true;
        const bool idle = service.Quiesce(deadline);
        // Calls past the grace are cancelled, as a server on its own cancels them.
        server.Shutdown(std::chrono::system_clock::now());
        return idle;
      });
  // A rank other than the front follows its front's commands, a replica's front other than the
  // mesh's leader the leader's, until the drain's stop (or until the one it follows is gone).
  std::atomic<bool> followed{false};
  absl::Status follow_status;
  std::thread follower;
  if (cluster.placement().follows_group() || cluster.placement().follows_mesh()) {
    follower = std::thread([&] {
      follow_status = front ? service.FollowMesh(drain.stop_following())
                            : service.FollowGroup(drain.stop_following());
      followed.store(true);
    });
  }
  ClusterDrain::Outcome outcome;
  bool watched = false;
  // A signal to a process that may leave (LeavesAtSignal): when it may leave, unless the
  // leader's drain begins by then (every pod deleted together: one drain of the whole mesh).
  std::optional<ClusterDrain::Clock::time_point> leaving;
  bool follows_drain = false;
  for (;;) {
    std::this_thread::sleep_for(kPoll);
    if (const absl::Status down = cluster.health(); !down.ok()) {
      if (NamesEvictedReplica(down) && cluster.mesh != nullptr && options.restart_argv != nullptr) {
        health.NotServing();
        RestartToRejoin(cluster, down, options);
      }
      health.NotServing("the head group is down: " + std::string(down.message()));
    }
    int stop = signal.load();
    if (stop != 0 && !follows_drain && LeavesAtSignal(cluster)) {
      if (LeaderDrains(cluster)) {
        follows_drain = true;  // the whole mesh drains: this process's states are saved too
      } else {
        health.NotServing();
        if (!leaving.has_value()) leaving = ClusterDrain::Clock::now() + kLeaveGrace;
        if (ClusterDrain::Clock::now() >= *leaving) Leave(server, stop, cluster, options);
        stop = 0;  // not (yet) a request to drain the mesh
      }
    }
    if (stop != 0 && !watched) {
      watched = true;  // after Poll's own deadline, which stops cleanly when nothing blocks
      StopBy(ClusterDrain::Clock::now() + drain.patience() + std::chrono::seconds(5), *options.err);
    }
    if (stop != 0 || drain.draining()) health.NotServing();
    std::optional<absl::Status> ended;
    if (followed.load()) ended = follow_status;
    outcome = drain.Poll(stop, ended);
    if (outcome.done) break;
  }
  health.NotServing();
  server.Shutdown(std::chrono::system_clock::now());  // a no-op once the drain shut it down
  drain.StopFollowing();
  if (follower.joinable()) follower.join();
  (outcome.exit_code == 0 ? *options.out : *options.err)
      << "remotehead-server: " << outcome.line << std::endl;
  return outcome.exit_code;
}

}  // namespace

int ServeUntilStopped(grpc::Server& server, HeadService& service, const Cluster& cluster,
                      const std::atomic<int>& signal, const ServingOptions& options) {
  if (!cluster.placement().in_cluster()) {
    return ServeAlone(server, service, signal, options);
  }
  return ServeInCluster(server, service, cluster, signal, options);
}

}  // namespace remotehead::server
