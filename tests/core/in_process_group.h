// A head group inside one process, for tests: K threads, each with its own shard of a head,
// meeting in collectives implemented with a mutex and a condition variable. The engine cannot
// tell it from the c10d group of K server processes (same GroupCollectives interface), so the
// numerics of every function on a group are tested here without sockets.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "remotehead/core/engine.h"
#include "remotehead/core/head.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead::testing {

class InProcessGroup {
 public:
  // A rank that waits longer than `timeout` for the others gets DEADLINE_EXCEEDED naming the
  // ranks that did not arrive, and the group stays broken (as a real one does).
  explicit InProcessGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~InProcessGroup();

  int size() const { return size_; }
  core::GroupCollectives* member(int rank);

  // Runs fn(rank) on one thread per rank and returns when every thread has.
  void RunOnAll(const std::function<void(int rank)>& fn);

  // Collective `op` over every rank's `in`: each rank's call blocks until all ranks have made
  // theirs; the last to arrive computes op(all inputs, by rank) once for everyone.
  using CombineFn = std::function<torch::Tensor(const std::vector<torch::Tensor>& by_rank)>;
  absl::StatusOr<torch::Tensor> Exchange(int rank, const torch::Tensor& in, const CombineFn& op);

 private:
  class Member;

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Member>> members_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<torch::Tensor> inputs_;
  std::vector<bool> arrived_;
  int arrived_count_ = 0;
  int64_t generation_ = 0;
  torch::Tensor result_;
  bool broken_ = false;
};

// The shard of `head` holding `range` (rows of W and b), with the head's gradient dtype.
std::unique_ptr<core::Head> ShardOf(const core::Head& head, const core::ShardRange& range);

// Runs fn(rank, shard, options) on one thread per rank of `group`: each rank gets its shard of
// `head` (rows ranges[rank]) and a copy of `options` pointing at the group (and at the same rows
// of a two-head function's teacher).
using ShardFn = std::function<void(int rank, const core::Head& shard, core::StepOptions options)>;
void OnShards(InProcessGroup& group, const core::Head& head,
              const std::vector<core::ShardRange>& ranges, const core::StepOptions& options,
              const ShardFn& fn);

}  // namespace remotehead::testing
