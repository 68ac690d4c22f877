#include "remotehead/server/head_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remotehead::server {
namespace {

std::string ShapeOf(const core::Head& h) {
  return absl::StrCat("[", h.vocab_size(), ", ", h.hidden_size(), "] ", c10::toString(h.dtype()),
                      h.has_bias() ? " with bias" : " without bias");
}

}  // namespace

HeadDescription HeadEntry::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {.id = id_,
          .vocab_size = head_->vocab_size(),
          .hidden_size = head_->hidden_size(),
          .dtype = head_->dtype(),
          .has_bias = head_->has_bias(),
          .device = head_->device().str(),
          .weight_version = head_->version(),
          .accumulated_micro_batches = static_cast<int64_t>(applied_.size()),
          .last_loss = last_loss_};
}

CommitResult HeadEntry::Commit(const StepCommit& commit) {
  std::lock_guard<std::mutex> lock(mu_);
  CommitResult result;
  if (commit.key.has_value()) {
    if (applied_.insert(*commit.key).second) {
      head_->grads().weight.add_(commit.scratch->weight);
      if (commit.scratch->bias.defined()) head_->grads().bias.add_(commit.scratch->bias);
    } else {
      result.replayed = true;
    }
  }
  if (commit.loss.has_value()) last_loss_ = commit.loss;
  result.weight_version = head_->version();
  return result;
}

absl::Status HeadEntry::OptimizerStep(
    const std::function<absl::Status(core::Head&, core::OptimizerState&)>& step,
    bool zero_gradients) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = step(*head_, optimizer_); !s.ok()) return s;
  if (zero_gradients) {
    head_->ZeroGrad();
    applied_.clear();
  }
  return absl::OkStatus();
}

void HeadEntry::ZeroGradients() {
  std::lock_guard<std::mutex> lock(mu_);
  head_->ZeroGrad();
  applied_.clear();
}

absl::Status HeadEntry::ReplaceWeights(const core::Head& head) {
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
                     applied_.size(), " micro-batches (fetch and zero them first)"));
  }
  current.mutable_weight().copy_(head.weight());
  if (current.has_bias()) current.mutable_bias().copy_(head.bias());
  current.BumpVersion();
  optimizer_ = core::OptimizerState{};  // moments of the old trajectory
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<HeadEntry>> HeadRegistry::Add(const std::string& id,
                                                             std::unique_ptr<core::Head> head) {
  if (id.empty()) {
    return absl::InvalidArgumentError("head_id: expected a non-empty id; got \"\"");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (heads_.contains(id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("head_id: expected a new id; got \"", id, "\", which already exists"));
  }
  auto entry = std::make_shared<HeadEntry>(id, std::move(head));
  heads_.emplace(id, entry);
  return entry;
}

absl::StatusOr<std::shared_ptr<HeadEntry>> HeadRegistry::AddOrReplace(
    const std::string& id, std::unique_ptr<core::Head> head) {
  std::shared_ptr<HeadEntry> entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = heads_.find(id);
    if (it != heads_.end()) entry = it->second;
  }
  if (entry == nullptr) return Add(id, std::move(head));
  if (absl::Status s = entry->ReplaceWeights(*head); !s.ok()) return s;
  return entry;
}

absl::StatusOr<std::shared_ptr<HeadEntry>> HeadRegistry::Get(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = heads_.find(id);
  if (it == heads_.end()) {
    std::vector<std::string> ids;
    for (const auto& [known, entry] : heads_) ids.push_back(known);
    return absl::NotFoundError(absl::StrCat("head_id: expected one of [", absl::StrJoin(ids, ", "),
                                            "]; got \"", id, "\""));
  }
  return it->second;
}

absl::Status HeadRegistry::Drop(const std::string& id) {
  auto entry = Get(id);
  if (!entry.ok()) return entry.status();
  std::lock_guard<std::mutex> lock(mu_);
  heads_.erase(id);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<HeadEntry>> HeadRegistry::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<HeadEntry>> out;
  for (const auto& [id, entry] : heads_) out.push_back(entry);
  return out;
}

}  // namespace remotehead::server
