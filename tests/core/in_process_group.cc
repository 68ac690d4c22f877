#include "core/in_process_group.h"

#include <stdexcept>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remotehead::testing {

class InProcessGroup::Member final : public core::GroupCollectives {
 public:
  Member(InProcessGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  absl::StatusOr<torch::Tensor> AllGather(const torch::Tensor& t) override {
    return group_->Exchange(
        rank_, t, [](const std::vector<torch::Tensor>& all) { return torch::stack(all); });
  }

  absl::Status ReduceSum(torch::Tensor& t, int root) override {
    absl::StatusOr<torch::Tensor> sum =
        group_->Exchange(rank_, t, [](const std::vector<torch::Tensor>& all) {
          torch::Tensor total = all[0].clone();
          for (size_t r = 1; r < all.size(); ++r) total.add_(all[r]);
          return total;
        });
    if (!sum.ok()) return sum.status();
    if (rank_ == root) t.copy_(*sum);
    return absl::OkStatus();
  }

  absl::Status Broadcast(torch::Tensor& t, int root) override {
    absl::StatusOr<torch::Tensor> value = group_->Exchange(
        rank_, t, [root](const std::vector<torch::Tensor>& all) { return all[root].clone(); });
    if (!value.ok()) return value.status();
    if (rank_ != root) t.copy_(*value);
    return absl::OkStatus();
  }

 private:
  InProcessGroup* group_;
  int rank_;
};

InProcessGroup::InProcessGroup(int size, std::chrono::milliseconds timeout)
    : size_(size), timeout_(timeout), inputs_(size), arrived_(size, false) {
  for (int r = 0; r < size; ++r) members_.push_back(std::make_unique<Member>(this, r));
}

InProcessGroup::~InProcessGroup() = default;

core::GroupCollectives* InProcessGroup::member(int rank) {
  return members_[static_cast<size_t>(rank)].get();
}

void InProcessGroup::RunOnAll(const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size_; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

absl::StatusOr<torch::Tensor> InProcessGroup::Exchange(int rank, const torch::Tensor& in,
                                                       const CombineFn& op) {
  std::unique_lock<std::mutex> lock(mu_);
  if (broken_) return absl::UnavailableError("in-process group: broken by an earlier failure");
  const int64_t generation = generation_;
  inputs_[static_cast<size_t>(rank)] = in;
  arrived_[static_cast<size_t>(rank)] = true;
  if (++arrived_count_ == size_) {
    result_ = op(inputs_);
    for (size_t r = 0; r < inputs_.size(); ++r) {
      inputs_[r] = torch::Tensor();
      arrived_[r] = false;
    }
    arrived_count_ = 0;
    ++generation_;
    cv_.notify_all();
    return result_;
  }
  const bool done =
      cv_.wait_for(lock, timeout_, [&] { return generation_ != generation || broken_; });
  if (generation_ != generation) return result_;
  if (!done) {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (!arrived_[static_cast<size_t>(r)]) missing.push_back(r);
    }
    broken_ = true;
    cv_.notify_all();
    return absl::DeadlineExceededError(absl::StrCat("in-process group: rank ", rank,
                                                    " timed out waiting for rank(s) ",
                                                    absl::StrJoin(missing, ", ")));
  }
  return absl::UnavailableError("in-process group: broken by another rank's failure");
}

std::unique_ptr<core::Head> ShardOf(const core::Head& head, const core::ShardRange& range) {
  auto shard = core::Head::FromTensors(
      head.weight().narrow(0, range.offset, range.rows),
      head.has_bias() ? head.bias().narrow(0, range.offset, range.rows) : torch::Tensor(),
      core::HeadOptions{.grad_dtype = head.grads().weight.scalar_type()});
  if (!shard.ok()) {
    throw std::runtime_error(absl::StrCat("ShardOf: ", shard.status().ToString()));
  }
  return *std::move(shard);
}

void OnShards(InProcessGroup& group, const core::Head& head,
              const std::vector<core::ShardRange>& ranges, const core::StepOptions& options,
              const ShardFn& fn) {
  group.RunOnAll([&](int rank) {
    const auto shard = ShardOf(head, ranges[static_cast<size_t>(rank)]);
    const core::VocabShard vocab_shard{.group = group.member(rank), .ranges = ranges};
    core::StepOptions opts = options;
    opts.shard = &vocab_shard;
    std::unique_ptr<core::Head> teacher_shard;
    if (options.teacher != nullptr) {
      teacher_shard = ShardOf(*options.teacher, ranges[static_cast<size_t>(rank)]);
      opts.teacher = teacher_shard.get();
    }
    fn(rank, *shard, opts);
  });
}

}  // namespace remotehead::testing
