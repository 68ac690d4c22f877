#include "server/in_process_process_group.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "remotehead/core/error_reason.h"
#include "remotehead/core/status_macros.h"

namespace remotehead::testing {
namespace {

// A failure as C10dGroup's FromException words it: the operation, this rank, the group's size,
// then what the transport said; DEADLINE_EXCEEDED (a wait ran out) with reason GROUP_TIMEOUT,
// anything else UNAVAILABLE with reason GROUP_UNAVAILABLE.
absl::Status AsGroupFailure(const absl::Status& failure, const std::string& op,
                            const server::GroupConfig& config) {
  const std::string message = absl::StrCat("head group: ", op, " failed on rank ", config.rank,
                                           " of ", config.size, ": ", failure.message());
  const std::map<std::string, std::string> metadata = {{"op", op},
                                                       {"rank", absl::StrCat(config.rank)}};
  if (failure.code() == absl::StatusCode::kDeadlineExceeded) {
    return core::WithReason(absl::DeadlineExceededError(message), core::reason::kGroupTimeout,
                            metadata);
  }
  return core::WithReason(absl::UnavailableError(message), core::reason::kGroupUnavailable,
                          metadata);
}

// What a rank's collective is, for checking that the ranks' calls pair up.
std::string Signature(const std::string& op, int root, const torch::Tensor& t) {
  return absl::StrCat(op, root >= 0 ? absl::StrCat("(root ", root, ")") : std::string(), " ",
                      c10::toString(t.scalar_type()), "[", absl::StrJoin(t.sizes(), ", "), "]");
}

// `combine` run only on inputs of one dtype and shape (an undefined tensor otherwise: the
// signatures, compared next, say what differed), so that it never throws inside the rendezvous.
InProcessGroup::CombineFn Checked(InProcessGroup::CombineFn combine) {
  return [combine = std::move(combine)](const std::vector<torch::Tensor>& all) {
    for (const torch::Tensor& t : all) {
      if (t.scalar_type() != all[0].scalar_type() || t.sizes() != all[0].sizes()) {
        return torch::Tensor();
      }
    }
    return combine(all);
  };
}

torch::Tensor Stack(const std::vector<torch::Tensor>& all) { return torch::stack(all); }

}  // namespace

class InProcessProcessGroup::Member final : public server::ProcessGroup {
 public:
  Member(InProcessProcessGroup* group, int rank) : group_(group), config_(group->config_) {
    config_.rank = rank;
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  const server::GroupConfig& config() const override { return config_; }

  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& t) override {
    const torch::Tensor in = t.contiguous();
    ASSIGN_OR_RETURN(
        const torch::Tensor all,
        group_->Meet(rank(), "all_gather", Signature("all_gather", -1, in), in, Stack));
    const int64_t n = in.nbytes() * (size() - 1);
    Count("all_gather", n, n);
    return all.clone();  // each rank's own, as c10d's
  }

  absl::Status ReduceSum(torch::Tensor& t, int root) override {
    // Summed in rank order (as core's in-process group does), once, by the last rank to arrive.
    ASSIGN_OR_RETURN(const torch::Tensor sum,
                     group_->Meet(rank(), "reduce", Signature("reduce", root, t), t,
                                  [](const std::vector<torch::Tensor>& all) {
                                    torch::Tensor total = all[0].clone();
                                    for (size_t r = 1; r < all.size(); ++r) total.add_(all[r]);
                                    return total;
                                  }));
    const int64_t n = t.nbytes();
    if (rank() == root) {
      t.copy_(sum);
      Count("reduce", 0, n * (size() - 1));
    } else {
      Count("reduce", n, 0);
    }
    return absl::OkStatus();
  }

  absl::Status Broadcast(torch::Tensor& t, int root) override {
    ASSIGN_OR_RETURN(const torch::Tensor value,
                     group_->Meet(rank(), "broadcast", Signature("broadcast", root, t), t,
                                  [root](const std::vector<torch::Tensor>& all) {
                                    return all[static_cast<size_t>(root)].clone();
                                  }));
    const int64_t n = t.nbytes();
    if (rank() == root) {
      Count("broadcast", n * (size() - 1), 0);
    } else {
      t.copy_(value);
      Count("broadcast", 0, n);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<torch::Tensor> Gather(const torch::Tensor& t, int root) override {
    const torch::Tensor in = t.contiguous();
    ASSIGN_OR_RETURN(const torch::Tensor all,
                     group_->Meet(rank(), "gather", Signature("gather", root, in), in, Stack));
    const int64_t n = in.nbytes();
    if (rank() != root) {
      Count("gather", n, 0);
      return torch::Tensor();
    }
    Count("gather", 0, n * (size() - 1));
    return all.clone();
  }

  absl::Status Set(const std::string& key, const std::string& value) override {
    return Store("set", key, group_->store_->Set(group_->StoreKey(key), value));
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    absl::StatusOr<std::string> value = group_->store_->Get(group_->StoreKey(key), timeout);
    RETURN_IF_ERROR(Store("get", key, value.status()));
    return value;
  }

  absl::Status Delete(const std::string& key) override {
    return Store("delete", key, group_->store_->Delete(group_->StoreKey(key)));
  }

  absl::StatusOr<bool> Exists(const std::string& key) override {
    absl::StatusOr<bool> exists = group_->store_->Exists(group_->StoreKey(key));
    RETURN_IF_ERROR(Store("check", key, exists.status()));
    return exists;
  }

  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected,
                                         const std::string& desired) override {
    absl::StatusOr<std::string> now =
        group_->store_->CompareSet(group_->StoreKey(key), expected, desired);
    RETURN_IF_ERROR(Store("compare-set", key, now.status()));
    return now;
  }

  std::map<std::string, server::CollectiveBytes> Bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }

 private:
  // A store call's status as C10dGroup's StoreCall reports it.
  absl::Status Store(const char* verb, const std::string& key, const absl::Status& status) {
    if (status.ok()) return status;
    return AsGroupFailure(status, absl::StrCat("store ", verb, " \"", key, "\""), config_);
  }

  void Count(const std::string& op, int64_t sent, int64_t received) {
    std::lock_guard<std::mutex> lock(mu_);
    server::CollectiveBytes& b = bytes_[op];
    ++b.calls;
    b.sent += sent;
    b.received += received;
  }

  InProcessProcessGroup* const group_;
  server::GroupConfig config_;
  mutable std::mutex mu_;
  std::map<std::string, server::CollectiveBytes> bytes_;  // guarded by mu_
};

InProcessProcessGroup::InProcessProcessGroup(server::GroupConfig config,
                                             std::shared_ptr<InProcessStore> store)
    : config_(std::move(config)),
      store_(store != nullptr ? std::move(store) : std::make_shared<InProcessStore>()),
      collectives_(config_.size, config_.timeout),
      taken_(static_cast<size_t>(config_.size), false),
      calls_(static_cast<size_t>(config_.size)) {}

InProcessProcessGroup::~InProcessProcessGroup() = default;

std::string InProcessProcessGroup::StoreKey(const std::string& key) const {
  return absl::StrCat(config_.prefix, "/commands/", key);  // C10dGroup's PrefixStore's key
}

std::unique_ptr<server::ProcessGroup> InProcessProcessGroup::Take(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank < 0 || rank >= size() || taken_[static_cast<size_t>(rank)]) return nullptr;
  taken_[static_cast<size_t>(rank)] = true;
  return std::make_unique<Member>(this, rank);
}

absl::StatusOr<torch::Tensor> InProcessProcessGroup::Meet(
    int rank, const std::string& op, const std::string& signature, const torch::Tensor& in,
    const InProcessGroup::CombineFn& combine) {
  size_t index = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls_[static_cast<size_t>(rank)].push_back(signature);
    index = calls_[static_cast<size_t>(rank)].size() - 1;
  }
  server::GroupConfig mine = config_;
  mine.rank = rank;
  absl::StatusOr<torch::Tensor> out = collectives_.Exchange(rank, in, Checked(combine));
  if (!out.ok()) return AsGroupFailure(out.status(), op, mine);
  // Every rank made its index-th call before this rendezvous completed: compare them.
  std::vector<std::string> calls;
  bool alike = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::vector<std::string>& by_rank : calls_) {
      calls.push_back(by_rank.size() > index ? by_rank[index] : std::string("nothing"));
      alike = alike && calls.back() == signature;
    }
  }
  if (!alike || !out->defined()) {
    std::vector<std::string> named;
    for (size_t r = 0; r < calls.size(); ++r)
      named.push_back(absl::StrCat("rank ", r, ": ", calls[r]));
    return absl::InternalError(
        absl::StrCat("in-process group (prefix ", config_.prefix, "): collective #", index,
                     " does not pair up across the ranks (", absl::StrJoin(named, "; "), ")"));
  }
  return out;
}

}  // namespace remotehead::testing
