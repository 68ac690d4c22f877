// Inputs a Forward kept on the server so that the two-phase Backward can reference them by
// handle instead of re-sending X. Each entry has a bounded lifetime and its bytes are reserved
// in the admission budget for as long as it lives: a sweeper thread drops expired entries on
// time, so an abandoned handle frees its memory without waiting for another request.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "remotehead/core/engine.h"
#include "remotehead/server/service/admission.h"

namespace remotehead::server {

struct RetainedInputs {
  std::string head_id;
  int64_t weight_version = 0;   // the head's version when the Forward ran
  core::TokenBatch batch;       // all rows, on the head's device (teacher_hidden included)
  std::string teacher_head_id;  // a two-head Forward's teacher (empty: none)
  int64_t teacher_version = 0;  // the teacher's version when the Forward ran
};

class RetainedInputStore {
 public:
  RetainedInputStore(AdmissionController* admission, double max_seconds);
  ~RetainedInputStore();

  // Keeps `inputs` for min(seconds, max_seconds) and returns their handle. RESOURCE_EXHAUSTED
  // if their bytes do not fit the memory budget.
  absl::StatusOr<std::string> Put(RetainedInputs inputs, double seconds);
  // NOT_FOUND for an unknown, released or expired handle.
  absl::StatusOr<std::shared_ptr<const RetainedInputs>> Get(const std::string& handle);
  void Release(const std::string& handle);

 private:
  struct Entry {
    std::shared_ptr<const RetainedInputs> inputs;
    std::chrono::steady_clock::time_point expires;
    uint64_t ticket;
  };
  void DropExpiredLocked();
  void Sweep();  // the sweeper thread: drops entries as they expire, until stopping_

  AdmissionController* admission_;
  const double max_seconds_;
  std::mutex mu_;
  std::condition_variable changed_;  // an entry was added, or the store is stopping
  bool stopping_ = false;
  std::map<std::string, Entry> entries_;
  std::thread sweeper_;  // last: started once everything above exists
};

}  // namespace remotehead::server
