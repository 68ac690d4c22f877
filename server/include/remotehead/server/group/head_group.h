// A head group as the service runs it: K server processes, each holding a contiguous range of a
// head's vocabulary rows, behaving together like one server. Rank 0 (the front) serves
// HeadService and turns every operation into a command of the group's ordered log
// (group_log.h); the other ranks follow the log and execute each command on their shard. The
// tensors a command needs travel by c10d collectives right after it (process_group.h). The
// transport carries a command as bytes with a name: what a command means is the layers'
// above (translate/group_commands.h encodes them, replication/ runs them).
//
// The rules every group operation follows, kept here in one place:
//   - one at a time (the front's lane), in the same order on every rank, so that the
//     collectives inside them pair up;
//   - every rank sees the same inputs and makes the same decisions, so an error (a bad request,
//     a stale weight version) happens on every rank alike, before any collective;
//   - a transport failure (a rank died, hung or left) takes the group down for good: c10d cannot
//     resume a group after a lost rank. Health turns NOT_SERVING on every rank that sees it and
//     every later call is UNAVAILABLE naming the failure; restart the group's processes;
//   - a failure is reported within one --group_timeout_seconds: once this rank's own part of a
//     command failed on the transport, the other ranks' replies get a short grace, not a fresh
//     timeout;
//   - the front declares the group down in the log (GroupLog::DeclareDown); every other rank
//     leaves when it sees that, before running anything more (a rank that was stopped and
//     continued never runs the command the front gave up on), and a rank that is down itself
//     runs nothing more: it answers every command UNAVAILABLE.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/core/vocab_group.h"
#include "remotehead/server/group/group_log.h"
#include "remotehead/server/group/liveness.h"
#include "remotehead/server/group/metric_source.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

class HeadGroup : public MetricSource {
 public:
  // `secret`: the group's (GroupConfig::secret); refused log entries and the group going down
  // are logged to `log` (nullptr: not logged).
  explicit HeadGroup(std::unique_ptr<ProcessGroup> group, std::string secret = "",
                     std::ostream* log = nullptr);

  // Opens the group's command log (every rank's nonce: GroupLog::Open) before it serves.
  absl::Status Open() { return Check(log_.Open()); }

  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  bool is_front() const { return group_->rank() == 0; }
  ProcessGroup& collectives() { return *group_; }
  const ProcessGroup& collectives() const { return *group_; }

  // Every rank's rows of a head of `vocab_size` rows (core::SplitVocabulary).
  absl::StatusOr<std::vector<core::ShardRange>> Ranges(int64_t vocab_size) const;

  // OK while the group works; the failure that took it down otherwise (its own, or the verdict
  // of the group or mesh it is part of: liveness.h).
  absl::Status health() const;
  // The liveness of the processes of this group (and of the mesh it is part of): a transport
  // failure is blamed on the process lost and taken as every process's verdict. Set before the
  // group serves; nullptr: none (the failure is this group's only).
  void set_liveness(Liveness* liveness) {
    liveness_ = liveness;
    log_.set_abandon([this, liveness] {
      const absl::Status retired = Retired();
      return retired.ok() ? liveness->health() : retired;
    });
  }
  // A mesh's cross-replica group whose epoch the mesh left (mesh_epoch.h): retired with `why`
  // (not a transport failure: nobody is blamed for it). Its log is abandoned — Follow returns
  // `why`, the replies a front awaits are abandoned with it, Enter refuses with it — and the
  // next epoch's group takes its place.
  void Retire(const absl::Status& why);
  // OK unless retired; then why.
  absl::Status Retired() const;

  // Metrics: this rank and the group's size, whether the group is up, what its collectives
  // moved (remotehead_group_*).
  std::vector<MetricFamilySamples> Metrics() const override;

  // The address clients dial for this group: its front's, set on the front when it listens and
  // on the other ranks by its announcement (front_address.h); "" until then.
  std::string front_address() const;
  void set_front_address(std::string address);

  // Called with each command's name ("step_batch", "optimizer_step", …) and the seconds this
  // rank spent on its own part of it (metrics). Set before the group serves.
  using CommandObserver = std::function<void(const std::string& command, double seconds)>;
  void set_observer(CommandObserver observer) { observer_ = std::move(observer); }

  // A command of the log as the transport carries it: its bytes, and its name ("step_batch",
  // "optimizer_step", …) for the observer.
  struct Command {
    std::string name;
    std::string bytes;
  };

  // The front's right to run one group operation: held for the whole operation.
  class Lane {
   public:
    // Appends `command` to the log, runs `local` (this rank's part, collectives included) and
    // waits for every other rank's reply; `local_last`: waits for the replies first (a commit,
    // so that the front, whose state clients read, changes only after every other rank did).
    // The first error wins: this rank's, else a rank's reply (named). A transport failure in
    // any of it takes the group down.
    absl::Status Run(const Command& command, const std::function<absl::Status()>& local,
                     bool local_last = false);

   private:
    friend class HeadGroup;
    Lane(HeadGroup* group, std::unique_lock<std::mutex> lock)
        : group_(group), lock_(std::move(lock)) {}
    HeadGroup* group_;
    std::unique_lock<std::mutex> lock_;
  };
  // Front: waits for the lane; UNAVAILABLE if the group itself failed (the mesh being down
  // does not stop a replica whose ranks work from answering reads).
  absl::StatusOr<Lane> Enter();
  // OK while the group and what it is part of work (health); else UNAVAILABLE, reason
  // GROUP_UNAVAILABLE, saying why and what to do: the answer to every call that would train.
  absl::Status Serving() const;
  // Front: a new id for a request whose engine calls run on every rank.
  int64_t NewSession() { return next_session_.fetch_add(1); }
  // Any rank: asks the front to drain the group; the front: whether a rank asked, and why
  // (GroupLog::RequestDrain / DrainRequested; replication/cluster_drain.h runs the drain).
  absl::Status RequestDrain(const std::string& reason) { return log_.RequestDrain(reason); }
  absl::StatusOr<std::optional<std::string>> DrainRequested() { return log_.DrainRequested(); }

  // Other ranks: takes commands in order and runs `execute` on each one's bytes, replying with
  // its status, until `stop` is set (OK) or the front is gone or declared the group down
  // (UNAVAILABLE saying so).
  absl::Status Follow(const std::function<absl::Status(const std::string& bytes)>& execute,
                      const std::atomic<bool>& stop);
  // Runs `part` (this rank's part of the command named `command`) and reports its time to the
  // observer: Lane::Run on the front; on the other ranks `execute`, once it knows the name.
  absl::Status Timed(const std::string& command, const std::function<absl::Status()>& part);

  // The front's `tensors` written into every other rank's (same shapes and dtypes; any dtype:
  // they travel as bytes), in order.
  absl::Status Share(std::vector<torch::Tensor>& tensors);
  // This rank's rows `mine` of a tensor split by `ranges`: the whole tensor on the front, an
  // undefined one on the other ranks.
  absl::StatusOr<torch::Tensor> GatherRows(const torch::Tensor& mine,
                                           const std::vector<core::ShardRange>& ranges);
  // Every rank's `mine` (one shape and dtype on all ranks) summed on the front, in that dtype;
  // an undefined tensor on the other ranks. For parts that are zero but on one rank (a tied
  // embedding's rows, each held by one rank) the sum is exact in any dtype.
  absl::StatusOr<torch::Tensor> SumToFront(const torch::Tensor& mine);

 private:
  // Takes the group down with `failure` if it is a transport failure (the front also declares
  // it in the log); returns `failure`.
  absl::Status Check(absl::Status failure);
  // Other ranks: UNAVAILABLE (and this rank down) once the front declared the group down or is
  // gone; OK otherwise.
  absl::Status CheckFront();
  // The failure that took this group itself down (OK while it works).
  absl::Status OwnHealth() const;
  absl::Status Unavailable(const absl::Status& failure) const;

  std::unique_ptr<ProcessGroup> group_;
  std::ostream* event_log_;
  GroupLog log_;
  std::mutex lane_;
  std::atomic<int64_t> next_session_{1};
  CommandObserver observer_;
  Liveness* liveness_ = nullptr;
  mutable std::mutex mu_;
  absl::Status down_;          // guarded by mu_
  absl::Status retired_;       // guarded by mu_
  std::string front_address_;  // guarded by mu_
};

// Whether `status` is a transport failure of the group (a collective or the store failed: a
// rank died, hung or left): UNAVAILABLE or DEADLINE_EXCEEDED from the group.
bool IsGroupFailure(const absl::Status& status);

}  // namespace remotehead::server
