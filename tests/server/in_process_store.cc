#include "server/in_process_store.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace remotehead::testing {

absl::Status InProcessStore::Closed(const std::string& verb, const std::string& key) const {
  return absl::UnavailableError(
      absl::StrCat("in-process store: ", verb, " \"", key, "\": the store's server is gone"));
}

absl::Status InProcessStore::Set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return Closed("set", key);
  values_[key] = value;
  changed_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> InProcessStore::Get(const std::string& key,
                                                std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool ready =
      changed_.wait_for(lock, timeout, [&] { return closed_ || values_.count(key) > 0; });
  if (closed_) return Closed("get", key);
  if (!ready) {
    return absl::DeadlineExceededError(
        absl::StrCat("in-process store: wait timeout after ", timeout.count(), "ms, keys: ", key));
  }
  return values_.at(key);
}

absl::Status InProcessStore::Delete(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return Closed("delete", key);
  values_.erase(key);  // as TCPStore's deleteKey: a missing key is no error
  return absl::OkStatus();
}

absl::StatusOr<bool> InProcessStore::Exists(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return Closed("check", key);
  return values_.count(key) > 0;
}

absl::StatusOr<std::string> InProcessStore::CompareSet(const std::string& key,
                                                       const std::string& expected,
                                                       const std::string& desired) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return Closed("compare-set", key);
  const auto it = values_.find(key);
  // As TCPStore's: a missing key is set only when `expected` is empty.
  if (it == values_.end()) {
    if (!expected.empty()) return expected;
    values_[key] = desired;
    changed_.notify_all();
    return desired;
  }
  if (it->second == expected) {
    it->second = desired;
    changed_.notify_all();
  }
  return it->second;
}

void InProcessStore::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  changed_.notify_all();
}

std::optional<std::string> InProcessStore::Peek(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = values_.find(key);
  return it == values_.end() ? std::nullopt : std::optional<std::string>(it->second);
}

std::vector<std::string> InProcessStore::Keys(const std::string& prefix) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> keys;
  for (const auto& [key, value] : values_) {
    if (absl::StartsWith(key, prefix)) keys.push_back(key);
  }
  return keys;
}

}  // namespace remotehead::testing
