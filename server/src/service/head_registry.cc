#include "remotehead/server/service/head_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::server {
namespace {

std::string ShapeOf(const core::Head& h) {
  return absl::StrCat("[", h.vocab_size(), ", ", h.hidden_size(), "] ", c10::toString(h.dtype()),
                      h.has_bias() ? " with bias" : " without bias");
}

// Only the id asked for: the ids of other tenants' heads are not this caller's business.
absl::Status UnknownHead(const std::string& id) {
  return core::WithReason(
      absl::NotFoundError(absl::StrCat("head_id: expected the id of a head on this server; got \"",
                                       id, "\", which it does not have")),
      core::reason::kHeadNotFound, {{"head", id}});
}

}  // namespace

absl::Status HeadFrozenError(const std::string& id, const std::string& field,
                             const std::string& what) {
  return core::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          field, ": expected a head that is not frozen for ", what, "; got head \"", id,
          "\", which is frozen (created or uploaded with frozen: it is read only — a teacher or a "
          "reference model — and takes neither dW nor optimizer steps)")),
      core::reason::kHeadFrozen, {{"head", id}, {"field", field}});
}

HeadDescription HeadEntry::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {.id = id_,
          .vocab_size =
              shards_.empty() ? head_->vocab_size() : shards_.back().offset + shards_.back().rows,
          .hidden_size = head_->hidden_size(),
          .dtype = head_->dtype(),
          .grad_dtype = head_->grads().weight.scalar_type(),
          .has_bias = head_->has_bias(),
          .device = head_->device().str(),
          .weight_version = head_->version(),
          .accumulated_micro_batches = MicroBatchesLocked(),
          .last_loss = last_loss_,
          .state_id = state_id_,
          .restored_version = restored_version_,
          .shards = shards_,
          .frozen = frozen_,
          .teacher_of = {students_.begin(), students_.end()},
          .step_health = step_health_,
          .step_tokens_total = step_tokens_total_};
}

int64_t HeadEntry::MicroBatchesLocked() const {
  // Keys sort by trainer, step, micro-batch, then use: one micro-batch's keys are adjacent.
  int64_t count = 0;
  const GradientKey* previous = nullptr;
  for (const GradientKey& key : applied_) {
    if (previous == nullptr || previous->trainer != key.trainer || previous->step != key.step ||
        previous->micro_batch != key.micro_batch) {
      ++count;
    }
    previous = &key;
  }
  return count;
}

void HeadEntry::AddStudent(const std::string& student) {
  std::lock_guard<std::mutex> lock(mu_);
  students_.insert(student);
}

HeadPin HeadEntry::Pin() const {
  std::lock_guard<std::mutex> lock(mu_);
  return PinLocked();
}

HeadPin HeadEntry::PinLocked() const {
  return {.weight_version = head_->version(), .gradient_window = gradient_window_};
}

absl::Status HeadEntry::CheckNotDroppedLocked() const {
  if (!dropped_) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("header.teacher_head_id: head \"", id_,
                                         "\" was dropped while this request ran; nothing was "
                                         "committed"));
}

absl::Status HeadEntry::CheckPinLocked(const HeadPin& pin, bool gradient) const {
  if (dropped_) {
    return absl::AbortedError(absl::StrCat("head_id: head \"", id_,
                                           "\" was dropped while this request ran; nothing was "
                                           "committed"));
  }
  if (head_->version() != pin.weight_version) {
    return absl::AbortedError(absl::StrCat(
        "head \"", id_, "\": expected weight version ", pin.weight_version,
        ", the one this request began computing on; got version ", head_->version(),
        " (an optimizer step or a weight replace ran meanwhile). Nothing was committed; send the "
        "request again"));
  }
  if (gradient && gradient_window_ != pin.gradient_window) {
    return absl::AbortedError(absl::StrCat(
        "head \"", id_,
        "\": expected the gradient window this request began in; its gradients were zeroed "
        "while it ran. Nothing was committed; send the request again"));
  }
  return absl::OkStatus();
}

void HeadEntry::Counted() const {
  if (observer_ == nullptr) return;
  std::lock_guard<std::mutex> lock(observer_->mu);
  if (observer_->observer) observer_->observer(id_);
}

absl::StatusOr<CommitResult> HeadEntry::Commit(const StepCommit& commit) {
  absl::StatusOr<CommitResult> result = CommitUnderLock(commit);
  if (result.ok() && commit.key.has_value() && !result->replayed) Counted();
  return result;
}

absl::StatusOr<CommitResult> HeadEntry::CommitUnderLock(const StepCommit& commit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (commit.pin.has_value()) {
    if (absl::Status s = CheckPinLocked(*commit.pin, commit.key.has_value()); !s.ok()) return s;
  } else if (dropped_) {
    return CheckPinLocked(PinLocked(), false);
  }
  CommitResult result;
  if (commit.key.has_value() && frozen_) {
    return HeadFrozenError(id_, "header.accumulate_weight_grad", "accumulating dW");
  }
  if (commit.key.has_value()) {
    if (applied_.insert(*commit.key).second) {
      if (commit.health != nullptr) health_window_.Add(*commit.health);
      if (commit.rows != nullptr) {
        torch::Tensor& dw = head_->grads().weight;
        dw.index_add_(0, commit.rows->index.to(dw.device()),
                      commit.rows->values.to(dw.device(), dw.scalar_type()));
      } else {
        head_->grads().weight.add_(commit.scratch->weight);
        if (commit.scratch->bias.defined()) head_->grads().bias.add_(commit.scratch->bias);
      }
    } else {
      result.replayed = true;
    }
  }
  if (commit.loss.has_value()) last_loss_ = commit.loss;
  result.weight_version = head_->version();
  return result;
}

absl::Status ChangeOptimizerState(const core::OptimizerState& state, int64_t expected_bytes,
                                  const HeadEntry::ResizeState& resize,
                                  const std::function<absl::Status()>& change) {
  const int64_t before = core::OptimizerStateBytes(state);
  const int64_t reserved = std::max<int64_t>(expected_bytes - before, 0);
  RETURN_IF_ERROR(resize(reserved));
  const absl::Status changed = change();
  resize(core::OptimizerStateBytes(state) - before - reserved).IgnoreError();  // gives back
  return changed;
}

absl::Status HeadEntry::OptimizerStep(
    const std::function<absl::Status(core::Head&, core::OptimizerState&)>& step,
    bool zero_gradients) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (frozen_) return HeadFrozenError(id_, "head_id", "an optimizer step");
    if (absl::Status s = step(*head_, optimizer_); !s.ok()) return s;
    step_tokens_total_ += health_window_.health.tokens;
    step_health_ = health_window_.health.tokens > 0 ? std::optional(health_window_) : std::nullopt;
    health_window_ = {};
    if (!zero_gradients) return absl::OkStatus();
    ZeroGradientsLocked();
  }
  Counted();
  return absl::OkStatus();
}

void HeadEntry::ZeroGradients() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ZeroGradientsLocked();
  }
  Counted();
}

void HeadEntry::ZeroGradientsLocked() {
  head_->ZeroGrad();
  applied_.clear();
  health_window_ = {};
  ++gradient_window_;
}

core::HeadState HeadEntry::CaptureState(const std::string& state_id) {
  std::lock_guard<std::mutex> lock(mu_);
  state_id_ = state_id;
  core::HeadState state = core::CaptureHeadState(id_, state_id, *head_, optimizer_);
  state.frozen = frozen_;
  return state;
}

int64_t HeadEntry::OptimizerStateBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return core::OptimizerStateBytes(optimizer_);
}

absl::Status HeadEntry::RestoreState(const core::HeadState& state, bool at_start,
                                     const ResizeState& resize) {
  std::lock_guard<std::mutex> lock(mu_);
  return ChangeOptimizerState(
      optimizer_, core::OptimizerStateBytes(state.optimizer), resize, [&]() -> absl::Status {
        core::OptimizerState optimizer;
        RETURN_IF_ERROR(core::ApplyHeadState(state, head_.get(), &optimizer));
        optimizer_ = std::move(optimizer);
        ZeroGradientsLocked();
        state_id_ = state.state_id;
        if (at_start) restored_version_ = state.weight_version;
        return absl::OkStatus();
      });
}

void HeadEntry::MarkDropped() {
  std::lock_guard<std::mutex> lock(mu_);
  dropped_ = true;
}

absl::Status HeadEntry::ReplaceWeights(const core::Head& head, const ResizeState& resize) {
  std::lock_guard<std::mutex> lock(mu_);
  core::Head& current = *head_;
  if (head.vocab_size() != current.vocab_size() || head.hidden_size() != current.hidden_size() ||
      head.dtype() != current.dtype() || head.has_bias() != current.has_bias()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header: expected the shape, dtype and bias of head \"", id_,
                     "\" to replace its weights, ", ShapeOf(current), "; got ", ShapeOf(head)));
  }
  if (!applied_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("header.replace: expected head \"", id_,
                     "\" to have no accumulated gradients (they were "
                     "computed with the weights being replaced); got ",
                     MicroBatchesLocked(), " micro-batches (fetch and zero them first)"));
  }
  current.mutable_weight().copy_(head.weight());
  if (current.has_bias()) current.mutable_bias().copy_(head.bias());
  current.BumpVersion();
  resize(-core::OptimizerStateBytes(optimizer_)).IgnoreError();  // giving back cannot fail
  optimizer_ = core::OptimizerState{};                           // moments of the old trajectory
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<HeadEntry>> HeadRegistry::Add(const std::string& id,
                                                             std::unique_ptr<core::Head> head,
                                                             uint64_t reservation,
                                                             std::vector<core::ShardRange> shards,
                                                             bool frozen) {
  if (id.empty()) {
    return absl::InvalidArgumentError("head_id: expected a non-empty id; got \"\"");
  }
  auto entry =
      std::make_shared<HeadEntry>(id, std::move(head), reservation, std::move(shards), frozen);
  entry->observer_ = observer_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (heads_.contains(id)) {
      return core::WithReason(
          absl::AlreadyExistsError(
              absl::StrCat("head_id: expected a new id; got \"", id, "\", which already exists")),
          core::reason::kHeadExists, {{"head", id}});
    }
    heads_.emplace(id, entry);
  }
  entry->Counted();
  return entry;
}

absl::StatusOr<std::shared_ptr<HeadEntry>> HeadRegistry::Get(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = heads_.find(id);
  if (it == heads_.end()) return UnknownHead(id);
  return it->second;
}

absl::StatusOr<std::shared_ptr<HeadEntry>> HeadRegistry::Drop(const std::string& id) {
  std::shared_ptr<HeadEntry> entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = heads_.find(id);
    if (it == heads_.end()) return UnknownHead(id);
    entry = std::move(it->second);
    heads_.erase(it);
  }
  entry->MarkDropped();
  entry->Counted();
  return entry;
}

void HeadRegistry::set_count_observer(CountObserver observer) {
  std::lock_guard<std::mutex> lock(observer_->mu);
  observer_->observer = std::move(observer);
}

std::vector<std::shared_ptr<HeadEntry>> HeadRegistry::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<HeadEntry>> out;
  for (const auto& [id, entry] : heads_) out.push_back(entry);
  return out;
}

}  // namespace remotehead::server
