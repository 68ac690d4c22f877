#include "vocab_ops.h"

namespace remotehead::core {
namespace {

// The softmax-weighted mean of e over the columns at hand: Σ_j exp(z_j − lse)·e_j.
torch::Tensor ColumnsSoftmaxMean(const torch::Tensor& e, const torch::Tensor& z,
                                 const torch::Tensor& lse) {
  return (torch::exp(z - lse.unsqueeze(1)) * e).sum(1);
}

}  // namespace

torch::Tensor LocalVocabOps::LogSumExp(const torch::Tensor& z) const {
  return torch::logsumexp(z, 1);
}

torch::Tensor LocalVocabOps::Sum(const torch::Tensor& e) const { return e.sum(1); }

torch::Tensor LocalVocabOps::AtTarget(const torch::Tensor& e, const torch::Tensor& targets) const {
  return e.gather(1, targets.unsqueeze(1)).squeeze(1);
}

// log_softmax's fused kernels (one pass forward, one backward) rather than logsumexp's several.
torch::Tensor LocalVocabOps::LogSoftmaxAtTarget(const torch::Tensor& z,
                                                const torch::Tensor& targets) const {
  return AtTarget(torch::log_softmax(z, 1), targets);
}

torch::Tensor LocalVocabOps::SoftmaxMean(const torch::Tensor& e, const torch::Tensor& z) const {
  return ColumnsSoftmaxMean(e, z, torch::logsumexp(z, 1));
}

torch::Tensor ShardVocabOps::GatherWithMine(const torch::Tensor& partial) const {
  absl::StatusOr<torch::Tensor> all = shard_.group->AllGather(partial.detach().contiguous());
  if (!all.ok()) throw GroupFailure(std::move(all).status());
  const int64_t rank = shard_.group->rank();
  const int64_t after = all->size(0) - rank - 1;
  return torch::cat(
      {all->narrow(0, 0, rank), partial.unsqueeze(0), all->narrow(0, rank + 1, after)});
}

// lse = log Σ_r exp(lse_r).
torch::Tensor ShardVocabOps::LogSumExp(const torch::Tensor& z) const {
  return torch::logsumexp(GatherWithMine(torch::logsumexp(z, 1)), 0);
}

torch::Tensor ShardVocabOps::Sum(const torch::Tensor& e) const {
  return GatherWithMine(e.sum(1)).sum(0);
}

torch::Tensor ShardVocabOps::HeldTargetValues(const torch::Tensor& e,
                                              const torch::Tensor& targets) const {
  const ShardRange& range = shard_.mine();
  const torch::Tensor local = targets - range.offset;
  const torch::Tensor held = local.ge(0).logical_and(local.lt(range.rows));
  const torch::Tensor column = local.clamp(0, range.rows - 1).unsqueeze(1);
  return torch::where(held, e.gather(1, column).squeeze(1), 0.0);
}

// The rank that holds a token's column contributes its value, every other rank 0.
torch::Tensor ShardVocabOps::AtTarget(const torch::Tensor& e, const torch::Tensor& targets) const {
  return GatherWithMine(HeldTargetValues(e, targets)).sum(0);
}

// z_t − lse from each rank's (lse_r, z_t or 0) in one collective.
torch::Tensor ShardVocabOps::LogSoftmaxAtTarget(const torch::Tensor& z,
                                                const torch::Tensor& targets) const {
  const torch::Tensor all =
      GatherWithMine(torch::stack({torch::logsumexp(z, 1), HeldTargetValues(z, targets)}));
  return all.select(1, 1).sum(0) - torch::logsumexp(all.select(1, 0), 0);
}

// E_p[e] = Σ_r exp(lse_r − lse)·E_{p_r}[e], from each rank's (lse_r, E_{p_r}[e]).
torch::Tensor ShardVocabOps::SoftmaxMean(const torch::Tensor& e, const torch::Tensor& z) const {
  const torch::Tensor lse_mine = torch::logsumexp(z, 1);
  const torch::Tensor all =
      GatherWithMine(torch::stack({lse_mine, ColumnsSoftmaxMean(e, z, lse_mine)}));
  const torch::Tensor lse_r = all.select(1, 0);
  const torch::Tensor mean_r = all.select(1, 1);
  return (torch::exp(lse_r - torch::logsumexp(lse_r, 0)) * mean_r).sum(0);
}

}  // namespace remotehead::core
