// A head group's transport inside one process, for tests: the server's ProcessGroup
// (process_group.h) for `size` ranks on threads, without sockets or c10d. Its collectives meet
// through core's in-process group (tests/core/in_process_group.h: one rendezvous, the last rank
// to arrive combines every rank's tensor, in rank order); its store calls go to an
// InProcessStore under the keys C10dGroup uses (<prefix>/commands/<key>), so several groups of
// a mesh can share one store as they share rank 0's TCPStore.
//
// What it reports is what C10dGroup reports:
//   - a collective or store read that waited config.timeout for the others: DEADLINE_EXCEEDED,
//     reason GROUP_TIMEOUT, metadata "op" and "rank", the message "head group: <op> failed on
//     rank <r> of <n>: …" naming the ranks that did not arrive;
//   - a collective of a group already broken by such a failure (c10d cannot resume one), or any
//     call on a closed store: UNAVAILABLE, reason GROUP_UNAVAILABLE;
//   - Bytes(): the calls and bytes of each operation as C10dGroup counts them.
// It also checks what c10d would only hang or crash on: the ranks' n-th collectives must be the
// same operation, with the same root, dtype and shape on every rank; otherwise INTERNAL on every
// rank, naming what each rank called (a test of code whose collectives do not pair up fails
// at once, with a message, instead of combining unrelated tensors).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/in_process_group.h"
#include "remotehead/server/group/process_group.h"
#include "server/in_process_store.h"

namespace remotehead::testing {

class InProcessProcessGroup {
 public:
  // A group of config.size ranks (config.rank is ignored: each member has its own) whose
  // collectives and store reads wait up to config.timeout; its keys live under config.prefix in
  // `store` (a store of its own when nullptr).
  explicit InProcessProcessGroup(server::GroupConfig config,
                                 std::shared_ptr<InProcessStore> store = nullptr);
  ~InProcessProcessGroup();
  InProcessProcessGroup(const InProcessProcessGroup&) = delete;
  InProcessProcessGroup& operator=(const InProcessProcessGroup&) = delete;

  int size() const { return config_.size; }
  const server::GroupConfig& config() const { return config_; }
  InProcessStore& store() { return *store_; }
  // The store key that `key` of this group is kept under.
  std::string StoreKey(const std::string& key) const;

  // Rank `rank`'s member, for the code under test to own (HeadGroup and HeadMesh take theirs);
  // each rank's once (nullptr after that, or for a rank outside [0, size)). It must not outlive
  // this object.
  std::unique_ptr<server::ProcessGroup> Take(int rank);

  // Runs fn(rank) on one thread per rank and returns when every thread has.
  void RunOnAll(const std::function<void(int rank)>& fn) { collectives_.RunOnAll(fn); }

 private:
  class Member;

  // Rank `rank`'s side of one collective: `signature` (operation, root, dtype, shape) recorded
  // as its next call, `in` combined with every other rank's by `combine` (given the inputs by
  // rank, only once they match). The combined tensor, or the failure as C10dGroup reports it.
  absl::StatusOr<torch::Tensor> Meet(int rank, const std::string& op, const std::string& signature,
                                     const torch::Tensor& in,
                                     const InProcessGroup::CombineFn& combine);

  const server::GroupConfig config_;
  const std::shared_ptr<InProcessStore> store_;
  InProcessGroup collectives_;
  std::mutex mu_;
  std::vector<bool> taken_;                      // by rank; guarded by mu_
  std::vector<std::vector<std::string>> calls_;  // by rank: every collective's signature; mu_
};

}  // namespace remotehead::testing
