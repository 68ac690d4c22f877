// Which processes of a head group or mesh are alive, and the one verdict that it is down.
//
// Every process beats in the group's store (a sealed counter under "beat/<global rank>" every
// 200 ms, on a store connection of its own) and watches everyone else's beats. From that:
//   - the lost process is named: a transport failure (a collective or a log read failed because
//     a peer closed its connection or stopped answering) is restated by Blame as the loss of the
//     process whose beat stopped — "global rank 3 (replica 1, shard 1, at 10.0.0.5:50054)", the
//     one to look at — instead of naming the live rank that noticed;
//   - one verdict for every process: DeclareDown writes the failure (sealed) under "down"; every
//     process reads it at its next beat and goes down too, so every front reports NOT_SERVING
//     and refuses work (no replica takes dW the mesh can never apply), and the listeners (the
//     synchronous steps waiting at a front) are answered at once;
//   - on a mesh with --mesh_min_replicas below R, a lost process of a replica (other than replica
//     0, unless the store is external) evicts its replica instead (mesh_epoch.h): the next epoch is
//     settled in the store and every process enters it — the mesh goes on — unless fewer than the
//     minimum would serve;
//   - a hung process (stopped, a stuck driver) is declared lost once its beat stopped for the
//     group's timeout (--group_timeout_seconds), as a collective waiting for it would be; a store
//     that cannot be reached names global rank 0, which serves it — or, with an external store
//     (--group_store_external: its own process), the store, and the mesh is down.
// The beats and the verdict are sealed like the log's entries (group_log.h: HMAC-SHA256 under the
// group's secret, bound to this run's session), so nobody without the secret can fake a beat of a
// lost process or a verdict; whoever reaches the store can still delete keys, which takes the
// group down (docs/security.md).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/group/mesh_epochs.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

class Liveness {
 public:
  struct Timing {
    std::chrono::milliseconds beat{200};
    // A beat this old names its process when a transport failure happens.
    std::chrono::milliseconds stalled{1200};
    // A beat this old: its process is lost, with or without a failure (the group's timeout).
    std::chrono::milliseconds lost{60000};
  };

  // Starts beating on `store`: the group's store, keys under a prefix of their own, on a
  // connection whose calls wait at most StoreTimeout (OpenStore(config with that timeout,
  // "liveness"), as JoinCluster opens it). UNAVAILABLE if the session does not come within the
  // group's timeout. Events (a process lost, the verdict) are logged to `log` (nullptr: not).
  // `joining`: a process of an evicted replica joining the running mesh (join.h) starts in the
  // mesh's newest epoch (MeshEpochs::Resume) instead of epoch 0.
  static absl::StatusOr<std::unique_ptr<Liveness>> Start(const GroupConfig& config,
                                                         std::ostream* log, Timing timing,
                                                         std::unique_ptr<KeyValueStore> store,
                                                         bool joining = false);
  // Whether a mesh runs on `store` (a liveness store: OpenStore(config, "liveness")): global
  // rank 0 set the session, which it does once every process passed the first rendezvous, and
  // its processes beat (watched for up to a second). A process that starts and finds one running
  // joins it (join.h) instead of that rendezvous. FAILED_PRECONDITION for a session that nobody
  // beats in: a store that outlived its mesh.
  static absl::StatusOr<bool> MeshRunning(KeyValueStore& store, const GroupConfig& config);
  // How long a call on the liveness store may wait: a beat past `stalled` (a store that does not
  // answer is a lost global rank 0, not a reason to stop beating for the group's timeout).
  static std::chrono::milliseconds StoreTimeout(const Timing& timing) {
    return timing.stalled + timing.beat;
  }
  ~Liveness();
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  // This process's address (its gRPC port), which the others name if it is lost.
  void Announce(const std::string& address);
  // OK until the group or mesh is down; then the verdict.
  absl::Status health() const;
  // `failure` (a transport failure this process saw: IsGroupFailure) restated as the loss of the
  // process whose beat stopped, waiting a little over `stalled` for the evidence; `failure`
  // itself if every beat goes on (the transport failed on its own) or it is not a transport
  // failure. UNAVAILABLE, reason GROUP_UNAVAILABLE, metadata lost_rank, lost_replica,
  // lost_shard, lost_address.
  absl::Status Blame(const absl::Status& failure);
  // The group or mesh is down with `verdict`: recorded in the store for every process and
  // here; the listeners called. Only the first verdict counts. On a mesh that evicts, a verdict
  // naming a lost process whose replica may be evicted evicts it instead (the mesh goes on).
  void DeclareDown(const absl::Status& verdict);

  // The mesh's epochs as this process knows them, and the eviction of a lost replica when the
  // mesh evicts (mesh_epochs.h): DeclareDown tries it first; every beat reads the next epoch's
  // record.
  MeshEpochs& epochs() { return epochs_; }
  const MeshEpochs& epochs() const { return epochs_; }
  // The group or mesh this process joined.
  const GroupConfig& config() const { return config_; }
  // `listener` is called once with the verdict, by whichever thread learns it first, until
  // removed (by the returned id; RemoveListener returns once no call of it runs).
  int OnDown(std::function<void(const absl::Status&)> listener);
  void RemoveListener(int id);
  // A fact every process may read (sealed): `value` under `key` (under "shared/"), and the
  // value there now (nullopt if none or it does not verify). What a mesh's fronts tell each
  // other outside the log: which trainers came to a step (mesh_steps.h).
  absl::Status Publish(const std::string& key, const std::string& value);
  absl::StatusOr<std::optional<std::string>> Read(const std::string& key);
  // The fact under `key` taken back (its publisher's housekeeping).
  absl::Status Unpublish(const std::string& key);
  // A fact set once for every process (under "settled/"): `proposed`, unless another process
  // settled `key` first — compare-and-set on the store, the one arbiter, so every process that
  // asks learns the same value, sealed and bound to its key. What a mesh's step commits on
  // (HeadMesh::Decide). DATA_LOSS when the value there does not verify (someone without the
  // secret wrote it); the store's failure as it is.
  absl::StatusOr<std::string> Settle(const std::string& key, const std::string& proposed);
  // The settled value of `key` forgotten (every process has read it).
  absl::Status Unsettle(const std::string& key);
  // "global rank 3 (replica 1, shard 1, at 10.0.0.5:50054)".
  std::string Describe(int global_rank) const;

  // Joining again (mesh_epoch.h). A process of an evicted replica: asks to join in the epoch
  // the mesh is in (sealed, so that only a process holding the group's secret can ask) and
  // waits until an epoch admits its replica; that epoch, or the verdict if the mesh goes down.
  absl::StatusOr<MeshEpoch> AwaitAdmission();
  // The leader: whether every process of `replica` asked to join in epoch `epoch`. A request
  // that does not verify is refused — logged and deleted.
  absl::StatusOr<bool> AskedToJoin(int replica, int epoch);
  // The requests of `replica`'s processes taken away once it was admitted.
  absl::Status ForgetJoin(int replica);

 private:
  Liveness(const GroupConfig& config, std::unique_ptr<KeyValueStore> store, std::ostream* log,
           Timing timing);
  absl::Status OpenSession(bool joining);
  // The newest epoch settled in the store (epoch 0 if none).
  absl::StatusOr<MeshEpoch> NewestEpoch();
  absl::Status AskToJoin(int epoch);
  void Run();
  void Beat();
  // Takes the verdict (`write`: this process's own, recorded in the store).
  void GoDown(const absl::Status& verdict, bool write);
  // The epoch `entered` evicted a replica: its processes are no longer watched; or admitted
  // one: its (new) processes are watched from now on.
  void Watch(const MeshEpoch& entered);
  // `failure` blamed on the replica `entered` evicted (a process of it, unwatched since).
  absl::Status EvictedLoss(const MeshEpoch& entered, const absl::Status& failure) const;
  // The settled value of `key` (nullopt: none yet); DATA_LOSS if it does not verify.
  absl::StatusOr<std::optional<std::string>> ReadSettled(const std::string& key);
  // The body of `value`, sealed as `key`'s settled value; DATA_LOSS naming `where` otherwise.
  absl::StatusOr<std::string> OpenSettled(const std::string& key, const std::string& where,
                                          const std::string& value) const;
  // The process lost, as a status (`since`: how long its beat has been stopped).
  absl::Status Lost(int global_rank, std::chrono::milliseconds since,
                    const std::string& first_seen) const;
  // The process whose beat stopped longest, at least `at_least` ago (kNoProcess: none), and
  // for how long; the store itself unreachable counts as global rank 0's, or kStoreProcess when
  // the store has its own process. Under mu_.
  std::pair<int, std::chrono::milliseconds> StalledLocked(std::chrono::milliseconds at_least) const;
  // A process whose beat stopped for `stalled` and whose address refuses connections (it is
  // gone: no need to wait for the group's timeout), and for how long; kNoProcess if none;
  // kStoreProcess for an external store that failed for `stalled` and refuses connections.
  std::pair<int, std::chrono::milliseconds> Gone() const;
  // The value at `key` now (nullopt: none), as stored (sealed); a store that fails, its status.
  absl::StatusOr<std::optional<std::string>> Fetch(const std::string& key);
  std::string Sealed(char kind, const std::string& body) const;
  // The body of `value` if its seal verifies for `kind`.
  std::optional<std::string> Opened(char kind, const std::string& value) const;

  using Clock = std::chrono::steady_clock;
  // What StalledLocked and Gone name besides a global rank: nobody, or the external store.
  static constexpr int kNoProcess = -1;
  static constexpr int kStoreProcess = -2;
  const GroupConfig config_;
  const std::unique_ptr<KeyValueStore> store_;
  std::ostream* const log_;
  const Timing timing_;
  std::string session_;
  int64_t beats_ = 0;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::map<int, std::string> last_beat_;          // by global rank
  std::map<int, Clock::time_point> last_change_;  // when its beat last changed
  std::map<int, std::string> addresses_;
  Clock::time_point store_failing_since_ = Clock::time_point::max();
  absl::Status down_;
  std::map<int, std::function<void(const absl::Status&)>> listeners_;  // under calling_
  int next_listener_ = 0;
  std::mutex calling_;  // held while listeners are called, added or removed
  MeshEpochs epochs_;   // after what its hooks use
  std::thread thread_;
};

// Whether `status` is a verdict that names the process lost (Blame's), which says what to do.
bool NamesLostProcess(const absl::Status& status);
// Whether `status` is the verdict of a process whose replica was evicted (metadata "evicted"),
// which says what happened: the mesh goes on without it.
bool NamesEvictedReplica(const absl::Status& status);
// Whether `status` names a store key a stranger changed (GroupLog's tampering: metadata "key"),
// which says what to do — fence the store. It is never restated as a lost process (a rank may be
// stopped or slow at the same time: the tampering is what the answer says; the loss may follow).
bool NamesTampering(const absl::Status& status);

}  // namespace remotehead::server
