// The epochs a mesh that evicts goes through (mesh_epoch.h), as one process knows them: the
// eviction policy (--mesh_min_replicas, --mesh_max_evictions), the epoch this process is in, the
// settling of the next one when a loss is named, and the listeners of each epoch entered. Part of
// the process's Liveness (liveness.h), which watches the beats, owns the store's settled values
// and calls Evict for a verdict and Adopt for a record it read; what this needs of it comes as
// Hooks.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/group/mesh_epoch.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

// At most `evictions` replicas evicted within `window` (MeshEpochs::Enable).
struct EvictionCap {
  int evictions = 0;  // 0: no cap but the minimum
  std::chrono::seconds window{3600};
};

class MeshEpochs {
 public:
  // What the epochs need of the process's liveness.
  struct Hooks {
    // Liveness::Settle: `proposed` under `key` unless another process settled it first.
    std::function<absl::StatusOr<std::string>(const std::string& key, const std::string& proposed)>
        settle;
    // Liveness::Describe: "global rank 3 (replica 1, shard 1, at …)".
    std::function<std::string(int global_rank)> describe;
    // The epoch `entered` was entered: the evicted replica's processes are no longer watched, an
    // admitted one's are watched again.
    std::function<void(const MeshEpoch& entered)> watch;
    // This process's replica was evicted: the process is down with `verdict`.
    std::function<void(const absl::Status& verdict)> go_down;
  };
  MeshEpochs(const GroupConfig& config, std::ostream* log, Hooks hooks);

  // From then on the loss of a process of a replica other than replica 0 (of any replica, with
  // an external store) evicts its replica as long as `min_replicas` replicas keep serving and
  // fewer than `cap.evictions` were evicted within the last `cap.window` (a slow replica that
  // makes others look lost must not evict them one after another: past the cap a loss takes the
  // mesh down). The same on every process.
  void Enable(int min_replicas, EvictionCap cap = {});
  bool evicts() const { return min_replicas_ > 0; }
  // The epoch this process is in (epoch 0 until a replica is evicted).
  MeshEpoch current() const;
  // `listener` is called once for each epoch this process enters, by the thread that learns it;
  // it must not block. Removed by RemoveListener(id).
  int OnEpoch(std::function<void(const MeshEpoch&)> listener);
  void RemoveListener(int id);
  // Whether `status` names a lost process of a replica evicted already (no verdict on the mesh).
  bool NamesEvicted(const absl::Status& status) const;

  // The lost process `verdict` names evicts its replica: true once this process is in an epoch
  // without that replica (it settled the next epoch, or another process had); false when the
  // loss takes the mesh down (no eviction here, replica 0, too few left, the cap, the store).
  bool Evict(const absl::Status& verdict);
  // The same for `replica`, for `cause` ("the heal of replica 1 failed (…)").
  bool EvictReplica(int replica, const std::string& cause);
  // Enters `next` if it is the epoch after this process's own: the line logged, the evicted
  // replica unwatched (an admitted one watched again), this process down if its replica was
  // evicted, the listeners called.
  void Adopt(const MeshEpoch& next);
  // The leader, between two mesh steps, once every process of the evicted `replica` asked to
  // join: settles (and enters) the next epoch with `replica` serving again. The epoch entered
  // (another process's record if one was settled first); the store's failure as it is.
  absl::StatusOr<MeshEpoch> Admit(int replica);
  // A process that joins a running mesh (join.h) starts in the epoch the mesh is in: entered
  // without a word, no listener called; it is joining until an epoch admits its replica.
  void Resume(const MeshEpoch& current);
  bool joining() const;

 private:
  using Clock = std::chrono::steady_clock;
  // Whether the cap forbids another eviction now (logged, with `cause`).
  bool Capped(const std::string& cause);

  const GroupConfig config_;
  std::ostream* const log_;
  const Hooks hooks_;
  int min_replicas_ = 0;  // 0: no eviction
  EvictionCap cap_;
  mutable std::mutex mu_;
  MeshEpoch epoch_;                         // under mu_
  bool joining_ = false;                    // under mu_: Resume'd, not admitted yet
  std::vector<Clock::time_point> entered_;  // when each epoch was entered (under mu_)
  std::mutex evicting_;                     // one eviction at a time in this process
  std::mutex calling_;                      // held while listeners are called, added, removed
  std::map<int, std::function<void(const MeshEpoch&)>> listeners_;  // under calling_
  int next_listener_ = 0;
};

}  // namespace remotehead::server
