// A head's replicas on a 2-D mesh [R, K]: R replicas, each one server (K = 1) or a head group of
// K ranks (head_group.h), all R·K processes in one c10d world (one store, served by global rank
// 0). Vocabulary collectives run along K inside a replica (its HeadGroup); dW is summed along R
// among the ranks that hold the same vocabulary shard (the "shard peers", one process group per
// shard). Replica r's front is global rank r·K; replica 0's front is the mesh's leader (until
// replica 0 is evicted, with an external store: then the next serving replica's, mesh_epoch.h).
//
// The rules the mesh follows, kept here in one place:
//   - the replica fronts form a group of their own (the shard peers of shard 0) whose ordered,
//     sealed command log (group_log.h) is the mesh's: the leader appends, every other front
//     follows. Operations that change every replica (create, upload, drop, zero, restore, an
//     optimizer step) are mesh commands, taken by the leader only; another front refuses them
//     with NOT_THE_LEADER naming the leader's address. Training calls (steps, forward) stay in
//     the replica that took them: each replica's trainers add into its own dW;
//   - every collective along R happens inside a mesh command, so they pair up by order;
//   - at an optimizer step every replica checks that it agrees with the leader's step (its own
//     trainers' request, the head's version and shape), the fronts exchange their verdicts, and
//     only if all agree every rank sums dW over the replicas (reduce on replica 0, then broadcast:
//     the same bits everywhere) and applies the same step. Weights and versions stay identical
//     across replicas; every --mesh_checksum_every_steps versions the shard peers compare a
//     checksum of their weights (a mismatch fails the step with DATA_LOSS);
//   - failure domain = the mesh: a transport failure on the fronts' log takes it down as it
//     takes a group down (every front's health turns NOT_SERVING);
//   - unless it evicts (--mesh_min_replicas below R, mesh_epoch.h): then the loss of a replica's
//     process evicts that replica (the leader's too, with --group_store_external: the epoch's
//     first serving replica leads) and the mesh goes on in the next epoch, its cross-replica groups
//     rebuilt among the serving replicas (Regroup) while calls are answered UNAVAILABLE, reason
//     MESH_RECONFIGURING; a step in flight is settled to abort unless every serving rank had
//     summed (Decide), and the survivors keep their own dW;
//   - and the evicted replica comes back: once every process of it asks to join again (join.h),
//     the leader admits it between two mesh steps (its lane held: no mesh command runs) in the
//     next epoch, waits for that epoch's groups, and runs the heal (set_healer: a mesh command on
//     the new log) — the leader's rank of each shard sends every head's sealed state to the
//     joiner's rank of that shard, which verifies it and installs it, and every replica compares
//     the heads' bytes. Until then calls are answered MESH_RECONFIGURING, here and at the joiner
//     (Joined: its front serves only once healed). A heal that fails evicts the joiner again.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/server/group/head_group.h"
#include "remotehead/server/group/mesh_epoch.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

class MeshAdmission;  // group/mesh_admission.h
class MeshDecisions;  // group/mesh_decisions.h
class RetiredGroups;  // group/retired_groups.h

struct MeshOptions {
  // The dtype dW travels in along R: float (exact sums of fp32 dW) or bfloat16 (half the bytes,
  // rounded sums); the sum lands back in dW's own dtype.
  torch::ScalarType reduce_dtype = torch::kFloat;
  int checksum_every_steps = 1;  // 0: never
  // The fewest replicas the mesh goes on with (--mesh_min_replicas; 0: every replica, R), and
  // the most evictions within a window (--mesh_max_evictions, 0: no cap;
  // --mesh_eviction_window_seconds): Liveness::EvictionCap.
  int min_replicas = 0;
  int max_evictions = 0;
  std::chrono::seconds eviction_window{3600};
  // Tests only (--testonly_mesh_pause, refused outside a test environment): every rank pauses
  // for `pause` at `point` ("after_sum": before the commit decision; "after_apply": before the
  // step's answer) of the mesh step that makes weight version `version` — or the leader at
  // "before_heal" of the admission into epoch `version` — so that a test can kill a process (or
  // signal one) there.
  struct TestOnlyPause {
    std::string point;
    int64_t version = -1;
    std::chrono::milliseconds pause{0};
  } testonly_pause;
  // Tests only (--testonly_mesh_corrupt_heal): a joiner flips a byte of the heal it receives, so
  // that a test sees the heal refused and the joiner evicted again.
  bool testonly_corrupt_heal = false;
};

// A later epoch's cross-replica groups, as JoinCluster builds them (mesh_epoch.h).
struct EpochGroups {
  std::unique_ptr<HeadGroup> fronts;          // on a replica's front
  std::unique_ptr<ProcessGroup> shard_peers;  // elsewhere
};

class HeadMesh : public MetricSource {
 public:
  // `fronts`: on a replica's front (rank 0 of its replica), the fronts' group whose collectives
  // are this rank's shard peers; nullptr elsewhere, with `shard_peers` given instead.
  HeadMesh(int replica, int replicas, MeshOptions options, std::unique_ptr<HeadGroup> fronts,
           std::unique_ptr<ProcessGroup> shard_peers);
  ~HeadMesh() override;

  int replica() const { return replica_; }
  int replicas() const { return replicas_; }
  bool is_front() const { return front_; }
  // Whether this process leads the mesh: the front of the epoch's leader replica
  // (MeshEpoch::leader, by the groups that serve here).
  bool is_leader() const { return front_ && leader_replica() == replica_; }
  int leader_replica() const;
  const MeshOptions& options() const { return options_; }
  // The fronts' group (the mesh's log) of the epoch that serves; nullptr off a replica's front.
  // A group the mesh left stays valid (retired) for as long as the mesh lives.
  HeadGroup* fronts();
  const HeadGroup* fronts() const;
  // OK while the mesh works: its log (on a front) and every process (liveness.h).
  absl::Status health() const;
  // Liveness, and with it eviction when it evicts (mesh_epoch.h): `regroup` builds an epoch's
  // groups (JoinCluster's), on a thread of this mesh's, whenever liveness enters an epoch.
  using Regroup = std::function<absl::StatusOr<EpochGroups>(const MeshEpoch&)>;
  void set_liveness(Liveness* liveness, Regroup regroup = nullptr);
  Liveness* liveness() const { return liveness_; }

  // Epochs (mesh_epoch.h). Whether a lost replica is evicted instead of taking the mesh down.
  bool evicts() const;
  // The epoch whose groups serve here (epoch 0 until a replica is evicted).
  MeshEpoch epoch() const;
  // OK while the groups of the mesh's epoch serve; while they are rebuilt after an eviction,
  // UNAVAILABLE, reason MESH_RECONFIGURING (metadata epoch, evicted): ask again shortly.
  absl::Status Reconfiguring() const;
  // The same for a call answered because the mesh entered `next` (what its trainers read).
  static absl::Status EpochChanged(const MeshEpoch& next) { return next.ChangeStatus(""); }
  // Waits until `deadline` for the mesh to settle: the groups of the epoch it entered built, and
  // a replica admitted healed (Reconfiguring OK). Its status then (the drain's saves wait).
  absl::Status AwaitSettled(std::chrono::steady_clock::time_point deadline);
  // `status` as a caller should read it: a failure caused by a replica that was evicted (a lost
  // process of it named, or a cross-replica collective aborted by its loss) is UNAVAILABLE,
  // reason MESH_RECONFIGURING — nothing was applied, ask again; anything else as it is.
  absl::Status Restated(const absl::Status& status) const;
  // The replica whose front serves trainer `trainer` in the current epoch, and the trainers of a
  // world of `world_size` that `replica` serves.
  int ReplicaOf(int trainer) const;
  std::vector<int> TrainersOf(int replica, int world_size) const;

  // A front other than the leader: `method` (an operation that changes every replica) refused
  // with FAILED_PRECONDITION, reason NOT_THE_LEADER, naming the leader's address: as its log
  // announced it, or, on a mesh that evicts, as the leader's replica published it (a leader
  // that changed announces nothing in the log).
  absl::Status NotTheLeader(const std::string& method) const;
  // This front's address, where clients dial it (main's --group_front_address), published for
  // the other fronts on a mesh that evicts (any of them may come to lead).
  void PublishFrontAddress(const std::string& address);

  // A process that joined the running mesh (join.h): its groups are those of `admitted`, and its
  // front serves once the heal installed every head here (MarkHealed, or HealFailed).
  void Joined(const MeshEpoch& admitted);
  void MarkHealed();
  void HealFailed(const absl::Status& why);
  // Whether this process joined and its heal failed (it leaves: serving.h does not rejoin).
  bool heal_failed() const;
  // The leader's heal of the replica `admitted` admitted (a mesh command run by the replication
  // layer); unset: none (no admission either). The leader's admissions (mesh_admission.h):
  // while `replica` is admitted and healed calls that train get MESH_RECONFIGURING (BeginHeal to
  // EndHeal); AwaitEpoch waits (up to `patience`; max: no limit) until this process's groups are
  // those of epoch `number` or later (false: not by then, or the mesh closes).
  void set_healer(std::function<absl::Status(const MeshEpoch& admitted)> healer);
  void BeginHeal(int replica);
  void EndHeal();
  bool AwaitEpoch(int number,
                  std::chrono::milliseconds patience = std::chrono::milliseconds::max());
  // `bytes` (every head's sealed state, on the leader's rank) broadcast from the leader's
  // replica to this rank's shard peers of `epoch`'s groups (ABORTED, reason MESH_RECONFIGURING,
  // once the mesh left it); counted as heal bytes on the replica that receives them for good
  // (`joiner`) and on the leader's.
  absl::Status BroadcastFromLeader(std::string& bytes, int epoch, bool joiner);
  // A heal this rank took part in, by result (metrics).
  void CountHeal(bool ok) { (ok ? heals_ok_ : heals_failed_).fetch_add(1); }

  // `t` summed over every replica's `t` (the same shape everywhere), written back into `t` with
  // the same bits on every replica. `epoch` (>= 0): by that epoch's groups only — ABORTED,
  // reason MESH_RECONFIGURING, once the mesh left it (a step belongs to the epoch it began in).
  absl::Status SumOverReplicas(torch::Tensor& t, int epoch = -1);
  // Every replica's `t` (the same shape everywhere) summed into the leader's `t` (exact sums in
  // t's dtype; the other replicas' `t` is left undefined-valued). Fronts only.
  absl::Status SumOnLeader(torch::Tensor& t);
  // A name for a new mesh step, unique across runs (16 random bytes, in hex): the leader gives
  // each step it proposes one (MeshStep.attempt), and its commit decision is settled under it.
  static absl::StatusOr<std::string> NewStepAttempt();
  // The commit decision of the mesh step `attempt`, settled once for every rank of every
  // replica (Liveness::Settle) after the sum (`summed`: how this rank's went): this rank
  // proposes to apply (its sum is done) and gets OK to apply, or ABORTED when the step was
  // settled to abort first — no rank applies without reading "apply". On a mesh that evicts, a
  // rank proposes "apply" only once every serving rank said its sum is done (store_keys::
  // MeshSummed), and "abort" when its own sum failed, a serving replica was evicted meanwhile,
  // or the others did not say so within the group's timeout: so a step is applied on every
  // serving replica or on none. The leader forgets the decision of the step before (every rank
  // has read it: the mesh's commands run one after another). Without liveness (a mesh built in a
  // test without one): `summed`.
  // `epoch` (>= 0): the step's (MeshStep.epoch); a mesh that left it aborts the step.
  absl::Status Decide(const std::string& attempt, const absl::Status& summed = absl::OkStatus(),
                      int epoch = -1);
  // OK if every replica's `tensors` hash alike; DATA_LOSS naming the replicas that differ.
  absl::Status CompareAcrossReplicas(const std::vector<torch::Tensor>& tensors,
                                     const std::string& what);
  // Every front's verdict on the current mesh command, by replica (fronts only): OK, or its
  // error (code and message).
  absl::StatusOr<std::vector<absl::Status>> ExchangeVerdicts(const absl::Status& mine);

  // Metrics: the bytes of dW summed over the replicas so far (in the reduce dtype) and the time
  // it took (conversions and both collectives), what this
  // rank's collectives with its shard peers moved, and the weight checksums compared.
  int64_t reduced_bytes() const { return reduced_bytes_; }
  double reduce_seconds() const { return reduce_nanoseconds_ * 1e-9; }
  std::map<std::string, CollectiveBytes> PeerBytes() const;
  int64_t checksums(bool matched) const { return matched ? matched_ : mismatched_; }
  // Pauses here if the options' test-only pause names `point` of the step to `version` (saying
  // so on stderr first, for the test that waits for it).
  void TestOnlyPause(const std::string& point, int64_t version) const;
  // The replicas this process saw evicted (one per epoch it entered).
  int64_t evictions() const { return evictions_; }
  // Metrics: this replica and the mesh's replicas, whether the mesh is up, dW summed over the
  // replicas (the payload and what it moved on the wire), the weight checksums compared, the
  // steps' commit decisions read (remotehead_mesh_*).
  std::vector<MetricFamilySamples> Metrics() const override;
  // This rank's shard peers: the R ranks that hold its rows in every replica, by replica.
  ProcessGroup& peers();
  const ProcessGroup& peers() const;

 private:
  // A cross-replica collective's failure: on a mesh that evicts, blamed on the process lost and
  // taken as the mesh's verdict (which evicts its replica); then ABORTED, reason
  // MESH_RECONFIGURING (no group takes it as its own transport failure: only the evicted replica
  // is gone); otherwise `failure` as it is.
  // `epoch`: the epoch of the group whose collective failed.
  absl::Status PeersFailed(const absl::Status& failure, int epoch);
  // The cross-replica group of the epoch that serves, and that epoch's number.
  struct Peers {
    ProcessGroup* group;
    int epoch;
  };
  Peers CurrentPeers();
  // The cross-replica group of `epoch` (-1: the current one's), once this process entered it
  // (waiting up to the group's timeout); ABORTED, reason MESH_RECONFIGURING, if it left it.
  absl::StatusOr<Peers> PeersOf(int epoch);
  // Liveness entered `next`: the groups of the epoch left are retired, the regroup thread builds
  // the new ones.
  void Enter(const MeshEpoch& next);
  void RegroupLoop();
  // A step of epoch `epoch` in a mesh that left it: ABORTED, reason MESH_RECONFIGURING.
  absl::Status EpochLeft(int epoch) const;

  const int replica_;
  const int replicas_;
  const MeshOptions options_;
  const bool front_;
  mutable std::mutex epoch_mu_;
  std::condition_variable regrouped_;
  MeshEpoch epoch_;   // the epoch whose groups serve (under epoch_mu_)
  MeshEpoch wanted_;  // the newest epoch liveness entered (under epoch_mu_)
  bool closing_ = false;
  std::unique_ptr<HeadGroup> fronts_;          // under epoch_mu_
  std::unique_ptr<ProcessGroup> shard_peers_;  // under epoch_mu_
  // The groups of the epochs left (retired_groups.h; under epoch_mu_).
  std::unique_ptr<RetiredGroups> retired_;
  Regroup regroup_;
  std::thread regrouping_;
  std::unique_ptr<MeshDecisions> decisions_;  // every step's commit decision (mesh_decisions.h)
  std::unique_ptr<MeshAdmission> admission_;  // the leader's, on a mesh that evicts
  // The replica admitted and not yet healed (-1: none): calls that train wait (under epoch_mu_).
  int healing_ = -1;
  absl::Status heal_failed_;  // a joiner's failed heal (under epoch_mu_)
  std::atomic<int64_t> heals_ok_{0};
  std::atomic<int64_t> heals_failed_{0};
  std::atomic<int64_t> heal_bytes_{0};
  int epoch_listener_ = -1;
  Liveness* liveness_ = nullptr;
  std::atomic<int64_t> reduced_bytes_{0};
  std::atomic<int64_t> reduce_nanoseconds_{0};
  std::atomic<int64_t> matched_{0};
  std::atomic<int64_t> mismatched_{0};
  std::atomic<int64_t> evictions_{0};
};

}  // namespace remotehead::server
