// A head group's store inside one process, for tests: the keys and values that c10d's TCPStore
// keeps for every group of a mesh (served by global rank 0), shared by threads. What the group
// log (group_log.h) needs of it, with TCPStore's behaviour: a write overwrites, a read waits for
// its key up to a timeout, deleting a missing key is not an error, and once the store's server
// is gone (Close: rank 0's process died) every call fails at once, waiting ones included.
//
// Statuses are plain here (DEADLINE_EXCEEDED when a key did not come in time, UNAVAILABLE once
// closed); InProcessProcessGroup turns them into the ones C10dGroup reports.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "remotehead/server/group/process_group.h"

namespace remotehead::testing {

class InProcessStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value);
  // The value at `key`, waiting up to `timeout` for it to be set.
  absl::StatusOr<std::string> Get(const std::string& key, std::chrono::milliseconds timeout);
  absl::Status Delete(const std::string& key);
  absl::StatusOr<bool> Exists(const std::string& key);
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired);

  // The store's server gone: every call fails UNAVAILABLE from now on, and every waiting Get
  // returns at once.
  void Close();

  // For tests' assertions (no waiting, works after Close): the value at `key`, and every key that
  // starts with `prefix`, in order.
  std::optional<std::string> Peek(const std::string& key) const;
  std::vector<std::string> Keys(const std::string& prefix = "") const;

 private:
  absl::Status Closed(const std::string& verb, const std::string& key) const;

  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;  // guarded by mu_
  bool closed_ = false;                        // guarded by mu_
};

// A KeyValueStore over `store`, its keys under `prefix` + "/" (what OpenStore gives a process).
class InProcessKeyValueStore final : public server::KeyValueStore {
 public:
  InProcessKeyValueStore(std::shared_ptr<InProcessStore> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix) + "/") {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return store_->Set(prefix_ + key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    return store_->Get(prefix_ + key, timeout);
  }
  absl::Status Delete(const std::string& key) override { return store_->Delete(prefix_ + key); }
  absl::StatusOr<bool> Exists(const std::string& key) override {
    return store_->Exists(prefix_ + key);
  }
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    return store_->CompareSet(prefix_ + key, expected, desired);
  }

 private:
  std::shared_ptr<InProcessStore> store_;
  const std::string prefix_;
};

}  // namespace remotehead::testing
