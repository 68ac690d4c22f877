// The two implementations of VocabOps (functions.h): over a whole head's logits, and over one
// shard's columns combined across a head group. Private to the engine.
#pragma once

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/torch_api.h"
#include "remotehead/core/vocab_group.h"

namespace remotehead::core {

// A collective failed inside a function's forward, where no status can be returned: thrown
// through the function and turned back into `status` by the engine.
struct GroupFailure : std::exception {
  explicit GroupFailure(absl::Status s) : status(std::move(s)), message(status.ToString()) {}
  const char* what() const noexcept override { return message.c_str(); }
  absl::Status status;
  std::string message;
};

// Reductions over dim 1 of a whole head's [n, V] logits.
class LocalVocabOps final : public VocabOps {
 public:
  explicit LocalVocabOps(int64_t vocab_size) : vocab_size_(vocab_size) {}
  int64_t vocab_size() const override { return vocab_size_; }
  torch::Tensor LogSumExp(const torch::Tensor& z) const override;
  torch::Tensor Sum(const torch::Tensor& e) const override;
  torch::Tensor AtTarget(const torch::Tensor& e, const torch::Tensor& targets) const override;
  torch::Tensor LogSoftmaxAtTarget(const torch::Tensor& z,
                                   const torch::Tensor& targets) const override;
  torch::Tensor SoftmaxMean(const torch::Tensor& e, const torch::Tensor& z) const override;
  std::vector<torch::Tensor> SumsOfLogSoftmaxPair(const std::vector<PairTerm>& terms,
                                                  const torch::Tensor& a,
                                                  const torch::Tensor& b) const override;
  torch::Tensor LargestValues(const torch::Tensor& z, int64_t k) const override;

 private:
  int64_t vocab_size_;
};

// Reductions over one shard's columns: each rank's per-token partial result is all-gathered
// (one collective per call) and the partials are combined in rank order, with this rank's own
// partial (which carries autograd) in place of its gathered copy. Every rank computes the same
// combined value bit for bit; autograd sees the combination with the other ranks' partials as
// constants, which gives exactly this rank's columns of the whole-vocabulary gradient (each
// partial depends on this rank's columns only), and no gradient passes through a collective.
class ShardVocabOps final : public VocabOps {
 public:
  explicit ShardVocabOps(const VocabShard& shard) : shard_(shard) {}
  int64_t vocab_size() const override { return shard_.vocab_size(); }
  torch::Tensor LogSumExp(const torch::Tensor& z) const override;
  torch::Tensor Sum(const torch::Tensor& e) const override;
  torch::Tensor AtTarget(const torch::Tensor& e, const torch::Tensor& targets) const override;
  torch::Tensor LogSoftmaxAtTarget(const torch::Tensor& z,
                                   const torch::Tensor& targets) const override;
  torch::Tensor SoftmaxMean(const torch::Tensor& e, const torch::Tensor& z) const override;
  std::vector<torch::Tensor> SumsOfLogSoftmaxPair(const std::vector<PairTerm>& terms,
                                                  const torch::Tensor& a,
                                                  const torch::Tensor& b) const override;
  torch::Tensor LargestValues(const torch::Tensor& z, int64_t k) const override;

 private:
  // Every rank's `partial` stacked by rank ([K, partial.shape…]), this rank's row being
  // `partial` itself. Throws GroupFailure when the collective fails.
  torch::Tensor GatherWithMine(const torch::Tensor& partial) const;
  // This rank's e at the targets it holds ([n] or [n, k] like the targets), 0 at the others.
  torch::Tensor HeldTargetValues(const torch::Tensor& e, const torch::Tensor& targets) const;

  const VocabShard& shard_;
};

}  // namespace remotehead::core
