#include "remotehead/server/head_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remotehead::server {

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
  auto entry = std::shared_ptr<HeadEntry>(new HeadEntry{id, {}, std::move(head), {}, {}});
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

  std::lock_guard<std::mutex> lock(entry->mu);
  core::Head& current = *entry->head;
  if (head->vocab_size() != current.vocab_size() || head->hidden_size() != current.hidden_size() ||
      head->dtype() != current.dtype() || head->has_bias() != current.has_bias()) {
    const auto describe = [](const core::Head& h) {
      return absl::StrCat("[", h.vocab_size(), ", ", h.hidden_size(), "] ",
                          c10::toString(h.dtype()), h.has_bias() ? " with bias" : " without bias");
    };
    return absl::InvalidArgumentError(absl::StrCat(
        "header: expected the shape, dtype and bias of head \"", id, "\" to replace its weights, ",
        describe(current), "; got ", describe(*head)));
  }
  if (!entry->applied.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.replace: expected head \"", id, "\" to have no accumulated gradients (they were "
        "computed with the weights being replaced); got ", entry->applied.size(),
        " micro-batches (fetch and zero them first)"));
  }
  current.mutable_weight().copy_(head->weight());
  if (current.has_bias()) current.mutable_bias().copy_(head->bias());
  current.BumpVersion();
  entry->optimizer = core::OptimizerState{};  // moments of the old trajectory
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
