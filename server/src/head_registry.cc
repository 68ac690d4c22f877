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
