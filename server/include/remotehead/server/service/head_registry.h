// The heads a server holds, by id, and what each needs beyond core::Head to serve many
// trainers: the ledger of gradient contributions already applied (exactly-once), the optimizer
// state, and the last loss (metrics). Every access to a head goes through a method of its
// HeadEntry that takes the entry's lock, so weights never change under a running computation
// and no caller manages a mutex of its own.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"
#include "remotehead/core/head_state.h"
#include "remotehead/core/optimizer.h"
#include "remotehead/core/vocab_group.h"
#include "remotehead/server/service/head_description.h"

namespace remotehead::server {

// What a gradient contribution is of: a head step's (X·Wᵀ) or a tied embedding's (W[ids]). A
// micro-batch of a tied model contributes both under one GradientId, each exactly once.
enum class GradientUse { kHead, kEmbedding };

// Identity of one gradient contribution (remotehead.v1.GradientId, and what it is of).
struct GradientKey {
  std::string trainer;
  int64_t step = 0;
  int64_t micro_batch = 0;
  GradientUse use = GradientUse::kHead;
  auto operator<=>(const GradientKey&) const = default;
};

// A gradient for some rows of W only: dW.index_add_(0, index, values) (a tied embedding's;
// repeated indices add up). `index` int64 [n] of this process's rows, `values` [n, D].
struct RowGradients {
  torch::Tensor index;
  torch::Tensor values;
};

// FAILED_PRECONDITION, reason HEAD_FROZEN: frozen head `id` was asked, by `field`, for `what`
// (dW, an optimizer step), which a frozen head never does.
absl::Status HeadFrozenError(const std::string& id, const std::string& field,
                             const std::string& what);

// What a request saw of its head when it began computing. It may compute and commit only while
// this still holds: a request never mixes two versions of the weights, and its dW never lands in
// a gradient window opened after it began (HeadEntry::ReadPinned, HeadEntry::Commit).
struct HeadPin {
  int64_t weight_version = 0;
  int64_t gradient_window = 0;  // goes up each time dW is zeroed
};

// What a request's end does to its head, all in one critical section (StepSession).
struct StepCommit {
  std::optional<HeadPin> pin;                      // unset: the request computed nothing
  std::optional<GradientKey> key;                  // accumulate dW under this identity
  const core::GradientBuffers* scratch = nullptr;  // the request's dW (with key), or
  const RowGradients* rows = nullptr;              // its dW for some rows only (with key)
  std::optional<double> loss;                      // recorded as the head's last loss
  const HealthWindow* health = nullptr;  // added to the step's window with a key not yet applied
};

struct CommitResult {
  bool replayed = false;       // the key had been applied already: nothing was added
  int64_t weight_version = 0;  // the version the request's results belong to
};

// Called, outside the heads' locks (under the slot's `mu`, so that replacing it waits for the
// calls in flight), after a head's micro-batch count may have changed: a new contribution
// committed, dW zeroed (or stepped), the head added or dropped. Shared by the registry's heads.
using CountObserver = std::function<void(const std::string& head_id)>;
struct CountObserverSlot {
  std::mutex mu;
  CountObserver observer;
};

class HeadEntry {
 public:
  // `reservation`: the admission ticket holding this head's bytes (0: none). `shards`: on a head
  // group, every rank's rows of the head (this process holds its own rank's); empty: the head
  // is whole. `frozen`: the head never accumulates dW nor takes an optimizer step (fixed for
  // its lifetime; a weight replace keeps it).
  HeadEntry(std::string id, std::unique_ptr<core::Head> head, uint64_t reservation = 0,
            std::vector<core::ShardRange> shards = {}, bool frozen = false)
      : id_(std::move(id)),
        shards_(std::move(shards)),
        frozen_(frozen),
        reservation_(reservation),
        head_(std::move(head)) {}

  const std::string& id() const { return id_; }
  const std::vector<core::ShardRange>& shards() const { return shards_; }
  bool frozen() const { return frozen_; }
  // Records that a step of head `student` named this head as its teacher and succeeded
  // (HeadDescription::teacher_of).
  void AddStudent(const std::string& student);
  uint64_t reservation() const { return reservation_.load(); }
  // For a head registered without one (loaded at start): takes `ticket` as its reservation.
  void set_reservation(uint64_t ticket) { reservation_.store(ticket); }
  HeadDescription Describe() const;

  // The version and gradient window now.
  HeadPin Pin() const;

  // Runs fn(const core::Head&) under the lock and returns its result: snapshots and checks that
  // must see one version of the weights.
  template <typename Fn>
  decltype(auto) Read(Fn&& fn) const {
    std::lock_guard<std::mutex> lock(mu_);
    return fn(static_cast<const core::Head&>(*head_));
  }
  // Runs fn(const core::Head&) -> absl::Status under the lock if the head is still as `*pin`
  // says (an unset pin is set to the head's state now): a request's computations. ABORTED,
  // naming what changed, if the head was dropped or its weights changed since.
  template <typename Fn>
  absl::Status ReadPinned(std::optional<HeadPin>* pin, Fn&& fn) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pin->has_value()) *pin = PinLocked();
    if (absl::Status s = CheckPinLocked(**pin, /*gradient=*/false); !s.ok()) return s;
    return fn(static_cast<const core::Head&>(*head_));
  }
  // ReadPinned with a second head read under its own lock too: fn(const core::Head&, const
  // core::Head* other_head) (other_head null when `other` is). Both locks are taken in one fixed
  // order (by the entries' addresses), so two requests that each read the other's head as their
  // second one cannot deadlock. ABORTED, naming it, if `other` was dropped.
  template <typename Fn>
  absl::Status ReadPinnedWith(const HeadEntry* other, std::optional<HeadPin>* pin, Fn&& fn) const {
    if (other == nullptr || other == this) {
      return ReadPinned(pin, [&](const core::Head& head) {
        return fn(head, other == nullptr ? nullptr : &head);
      });
    }
    const bool this_first = std::less<const HeadEntry*>()(this, other);
    std::lock_guard<std::mutex> first(this_first ? mu_ : other->mu_);
    std::lock_guard<std::mutex> second(this_first ? other->mu_ : mu_);
    if (!pin->has_value()) *pin = PinLocked();
    if (absl::Status s = CheckPinLocked(**pin, /*gradient=*/false); !s.ok()) return s;
    if (absl::Status s = other->CheckNotDroppedLocked(); !s.ok()) return s;
    return fn(static_cast<const core::Head&>(*head_),
              static_cast<const core::Head*>(other->head_.get()));
  }
  // Runs fn(const core::Head&, const core::Head* other_head) under both entries' locks, taken
  // as ReadPinnedWith takes them (other_head null when `other` is): snapshots of two heads.
  template <typename Fn>
  decltype(auto) ReadWith(const HeadEntry* other, Fn&& fn) const {
    if (other == nullptr || other == this) {
      return Read(
          [&](const core::Head& head) { return fn(head, other == nullptr ? nullptr : &head); });
    }
    const bool this_first = std::less<const HeadEntry*>()(this, other);
    std::lock_guard<std::mutex> first(this_first ? mu_ : other->mu_);
    std::lock_guard<std::mutex> second(this_first ? other->mu_ : mu_);
    return fn(static_cast<const core::Head&>(*head_),
              static_cast<const core::Head*>(other->head_.get()));
  }
  // Runs fn(core::Head&) under the lock, for changes without a method of their own.
  template <typename Fn>
  decltype(auto) Write(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    return fn(*head_);
  }

  // The only place a request's gradient reaches the head: adds *scratch unless commit.key was
  // applied since the last zeroing (then reports a replay), records the loss. ABORTED, with
  // nothing changed, if the head was dropped, its weights changed since commit.pin, or (with a
  // key) its gradients were zeroed since.
  absl::StatusOr<CommitResult> Commit(const StepCommit& commit);
  // Called under the entry's lock with the change in bytes of its optimizer state before a
  // growth (an error refuses the change, which then does not happen) or after a shrink: how a
  // server keeps its memory budget in step with the head (see ChangeOptimizerState).
  using ResizeState = std::function<absl::Status(int64_t delta_bytes)>;
  // For a head whose bytes are not counted (yet): a restore at start, before admission exists.
  static absl::Status NotCounted(int64_t) { return absl::OkStatus(); }
  // Bytes the head's optimizer state holds now.
  int64_t OptimizerStateBytes() const;
  // Runs `step` (an optimizer step on the head and its state) under the lock; then publishes
  // the health window (HeadDescription::step_health) and opens a new one, and, with
  // zero_gradients, zeroes dW / db and forgets the ledger in the same critical section.
  absl::Status OptimizerStep(
      const std::function<absl::Status(core::Head&, core::OptimizerState&)>& step,
      bool zero_gradients);
  // Zeroes dW / db and forgets the ledger: a new accumulation window, ids may be reused (the
  // health window is dropped with them, unpublished).
  void ZeroGradients();
  // New weights from `head` (UploadHeader.replace): INVALID_ARGUMENT unless it has this head's
  // shape, dtype and bias; FAILED_PRECONDITION while gradients computed with the old weights
  // are accumulated. The optimizer state is reset and the version goes up by one.
  absl::Status ReplaceWeights(const core::Head& head, const ResizeState& resize);
  // A CPU copy of the head's whole training state under `state_id` (recorded as the head's).
  core::HeadState CaptureState(const std::string& state_id);
  // Puts the head back to `state` (core::ApplyHeadState) and zeroes its gradients: a new
  // gradient window. `at_start`: the server is restoring it after a restart.
  absl::Status RestoreState(const core::HeadState& state, bool at_start,
                            const ResizeState& resize = NotCounted);
  // Called by HeadRegistry::Drop: requests still holding this entry fail instead of committing
  // to a head nobody can reach (or to a new head of the same id).
  void MarkDropped();

 private:
  HeadPin PinLocked() const;
  absl::Status CheckPinLocked(const HeadPin& pin, bool gradient) const;
  absl::Status CheckNotDroppedLocked() const;
  void ZeroGradientsLocked();

  const std::string id_;
  const std::vector<core::ShardRange> shards_;
  const bool frozen_;
  std::atomic<uint64_t> reservation_;
  friend class HeadRegistry;
  std::shared_ptr<CountObserverSlot> observer_;  // the registry's; set before it is shared
  void Counted() const;                          // tells the observer (if any)
  absl::StatusOr<CommitResult> CommitUnderLock(const StepCommit& commit);
  mutable std::mutex mu_;  // guards everything below
  std::unique_ptr<core::Head> head_;
  int64_t gradient_window_ = 0;
  bool dropped_ = false;
  std::string state_id_;
  std::optional<int64_t> restored_version_;
  // Contributions already added since the last zeroing. A replay recomputes its answer (the
  // trainer needs dX again) and adds nothing, so only the identity is kept.
  std::set<GradientKey> applied_;
  // The micro-batches among them: a tied model's micro-batch is one, its head and embedding
  // contributions two keys.
  int64_t MicroBatchesLocked() const;
  core::OptimizerState optimizer_;  // created by the first OptimizerStep
  std::optional<double> last_loss_;
  std::set<std::string> students_;  // teacher_of
  HealthWindow health_window_;      // committed since the last optimizer step or zeroing
  std::optional<HealthWindow> step_health_;
  int64_t step_tokens_total_ = 0;
};

// Runs `change`, which may resize `state`, with the growth reserved first: the bytes beyond
// what `state` holds now, up to `expected_bytes` (what it will hold afterwards, at most), go
// through `resize` before `change` runs (refused: it does not run); afterwards the reservation
// follows what `state` really holds, whether `change` succeeded or not.
absl::Status ChangeOptimizerState(const core::OptimizerState& state, int64_t expected_bytes,
                                  const HeadEntry::ResizeState& resize,
                                  const std::function<absl::Status()>& change);

class HeadRegistry {
 public:
  // ALREADY_EXISTS if the id is taken; INVALID_ARGUMENT for an empty id. `reservation`: the
  // admission ticket holding the head's bytes, released by whoever drops it. `frozen`: see
  // HeadEntry.
  absl::StatusOr<std::shared_ptr<HeadEntry>> Add(const std::string& id,
                                                 std::unique_ptr<core::Head> head,
                                                 uint64_t reservation = 0,
                                                 std::vector<core::ShardRange> shards = {},
                                                 bool frozen = false);
  // NOT_FOUND naming the id asked for (and no other head's).
  absl::StatusOr<std::shared_ptr<HeadEntry>> Get(const std::string& id) const;
  // Removes the head and returns it (requests still holding it then fail to commit).
  absl::StatusOr<std::shared_ptr<HeadEntry>> Drop(const std::string& id);
  std::vector<std::shared_ptr<HeadEntry>> List() const;
  // Replaces the observer (nullptr: none); returns once no call of the previous one runs.
  void set_count_observer(CountObserver observer);

 private:
  std::shared_ptr<CountObserverSlot> observer_ = std::make_shared<CountObserverSlot>();
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<HeadEntry>> heads_;
};

}  // namespace remotehead::server
