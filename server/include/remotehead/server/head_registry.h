// The heads a server holds, by id, and what each needs beyond core::Head to serve many
// trainers: the ledger of gradient contributions already applied (exactly-once), the optimizer
// state, and the last loss (metrics). Every access to a head goes through a method of its
// HeadEntry that takes the entry's lock, so weights never change under a running computation
// and no caller manages a mutex of its own.
#pragma once

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
#include "remotehead/core/head.h"
#include "remotehead/core/optimizer.h"

namespace remotehead::server {

// Identity of one gradient contribution (remotehead.v1.GradientId).
struct GradientKey {
  std::string trainer;
  int64_t step = 0;
  int64_t micro_batch = 0;
  auto operator<=>(const GradientKey&) const = default;
};

// A head at one moment (DescribeHead, ListHeads, metrics).
struct HeadDescription {
  std::string id;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  torch::ScalarType dtype = torch::kFloat;
  bool has_bias = false;
  std::string device;
  int64_t weight_version = 0;
  int64_t accumulated_micro_batches = 0;  // contributions since the last zeroing
  std::optional<double> last_loss;        // of the last successful ForwardBackward
};

// What a request's end does to its head, all in one critical section (StepSession).
struct StepCommit {
  std::optional<GradientKey> key;                  // accumulate dW under this identity
  const core::GradientBuffers* scratch = nullptr;  // the request's dW (with key)
  std::optional<double> loss;                      // recorded as the head's last loss
};

struct CommitResult {
  bool replayed = false;       // the key had been applied already: nothing was added
  int64_t weight_version = 0;  // the version the request's results belong to
};

class HeadEntry {
 public:
  HeadEntry(std::string id, std::unique_ptr<core::Head> head)
      : id_(std::move(id)), head_(std::move(head)) {}

  const std::string& id() const { return id_; }
  HeadDescription Describe() const;

  // Runs fn(const core::Head&) under the lock and returns its result: computations, snapshots
  // and version checks that must see one version of the weights.
  template <typename Fn>
  decltype(auto) Read(Fn&& fn) const {
    std::lock_guard<std::mutex> lock(mu_);
    return fn(static_cast<const core::Head&>(*head_));
  }
  // Runs fn(core::Head&) under the lock, for changes without a method of their own.
  template <typename Fn>
  decltype(auto) Write(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    return fn(*head_);
  }

  // The only place a request's gradient reaches the head: adds *scratch unless commit.key was
  // applied since the last zeroing (then reports a replay), records the loss.
  CommitResult Commit(const StepCommit& commit);
  // Runs `step` (an optimizer step on the head and its state) under the lock; then, with
  // zero_gradients, zeroes dW / db and forgets the ledger in the same critical section.
  absl::Status OptimizerStep(
      const std::function<absl::Status(core::Head&, core::OptimizerState&)>& step,
      bool zero_gradients);
  // Zeroes dW / db and forgets the ledger: a new accumulation window, ids may be reused.
  void ZeroGradients();
  // New weights from `head` (UploadHeader.replace): INVALID_ARGUMENT unless it has this head's
  // shape, dtype and bias; FAILED_PRECONDITION while gradients computed with the old weights
  // are accumulated. The optimizer state is reset and the version goes up by one.
  absl::Status ReplaceWeights(const core::Head& head);

 private:
  const std::string id_;
  mutable std::mutex mu_;  // guards everything below
  std::unique_ptr<core::Head> head_;
  // Contributions already added since the last zeroing. A replay recomputes its answer (the
  // trainer needs dX again) and adds nothing, so only the identity is kept.
  std::set<GradientKey> applied_;
  core::OptimizerState optimizer_;  // created by the first OptimizerStep
  std::optional<double> last_loss_;
};

class HeadRegistry {
 public:
  // ALREADY_EXISTS if the id is taken; INVALID_ARGUMENT for an empty id.
  absl::StatusOr<std::shared_ptr<HeadEntry>> Add(const std::string& id,
                                                 std::unique_ptr<core::Head> head);
  // Add, or HeadEntry::ReplaceWeights of the existing head `id`.
  absl::StatusOr<std::shared_ptr<HeadEntry>> AddOrReplace(const std::string& id,
                                                          std::unique_ptr<core::Head> head);
  // NOT_FOUND naming the id and the heads that exist.
  absl::StatusOr<std::shared_ptr<HeadEntry>> Get(const std::string& id) const;
  absl::Status Drop(const std::string& id);
  std::vector<std::shared_ptr<HeadEntry>> List() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<HeadEntry>> heads_;
};

}  // namespace remotehead::server
