#include "vocab_ops.h"

#include <algorithm>
#include <limits>

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

// targets [n] give [n]; targets [n, k] (a sparse teacher's top-k ids) give [n, k].
torch::Tensor LocalVocabOps::AtTarget(const torch::Tensor& e, const torch::Tensor& targets) const {
  if (targets.dim() == 2) return e.gather(1, targets);
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

std::vector<torch::Tensor> LocalVocabOps::SumsOfLogSoftmaxPair(const std::vector<PairTerm>& terms,
                                                               const torch::Tensor& a,
                                                               const torch::Tensor& b) const {
  const torch::Tensor la = torch::log_softmax(a, 1);
  const torch::Tensor lb = torch::log_softmax(b, 1);
  std::vector<torch::Tensor> sums = {terms.front()(la, lb).sum(1)};
  torch::NoGradGuard no_grad;
  for (size_t i = 1; i < terms.size(); ++i) sums.push_back(terms[i](la.detach(), lb.detach()).sum(1));
  return sums;
}

torch::Tensor LocalVocabOps::LargestValues(const torch::Tensor& z, int64_t k) const {
  torch::NoGradGuard no_grad;
  return std::get<0>(z.detach().topk(std::min(k, z.size(1)), 1));
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
  const torch::Tensor column = local.clamp(0, range.rows - 1);
  const torch::Tensor values = targets.dim() == 2 ? e.gather(1, column)
                                                  : e.gather(1, column.unsqueeze(1)).squeeze(1);
  return torch::where(held, values, 0.0);
}

// The rank that holds a token's column contributes its value, every other rank 0.
torch::Tensor ShardVocabOps::AtTarget(const torch::Tensor& e, const torch::Tensor& targets) const {
  return GatherWithMine(HeldTargetValues(e, targets)).sum(0);
}

// z_t − lse from each rank's (lse_r, z_t or 0) in one collective; [n, k] targets gather
// (lse_r, z_t1 … z_tk) per token.
torch::Tensor ShardVocabOps::LogSoftmaxAtTarget(const torch::Tensor& z,
                                                const torch::Tensor& targets) const {
  if (targets.dim() == 2) {
    const torch::Tensor all = GatherWithMine(
        torch::cat({torch::logsumexp(z, 1).unsqueeze(1), HeldTargetValues(z, targets)}, 1));
    const int64_t k = targets.size(1);
    return all.narrow(2, 1, k).sum(0) - torch::logsumexp(all.select(2, 0), 0).unsqueeze(1);
  }
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

// Σ_j f(a_j − L_a, b_j − L_b) with L the combined log-sum-exps. Each rank's terms are formed with
// L as constants, so autograd gives only their direct gradient; the gradient through L (every
// rank's Σ_j ∂f/∂L, gathered with the terms) is added back as (L − L̂)·Σ_r ∂partial_r/∂L, which
// is 0 in value and flows into this rank's columns through its own lse_r, exactly as the whole
// vocabulary's expression would. Two collectives whatever the number of terms; the derivatives
// come from autograd.
std::vector<torch::Tensor> ShardVocabOps::SumsOfLogSoftmaxPair(const std::vector<PairTerm>& terms,
                                                               const torch::Tensor& a,
                                                               const torch::Tensor& b) const {
  const torch::Tensor lses =
      GatherWithMine(torch::stack({torch::logsumexp(a, 1), torch::logsumexp(b, 1)}));
  const torch::Tensor la = torch::logsumexp(lses.select(1, 0), 0);
  const torch::Tensor lb = torch::logsumexp(lses.select(1, 1), 0);
  const bool grad = torch::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad());
  torch::Tensor la_const = la.detach().requires_grad_(grad);
  torch::Tensor lb_const = lb.detach().requires_grad_(grad);
  const torch::Tensor log_a = a - la_const.unsqueeze(1);
  const torch::Tensor log_b = b - lb_const.unsqueeze(1);
  const torch::Tensor partial = terms.front()(log_a, log_b).sum(1);
  torch::Tensor d_la = torch::zeros_like(la_const);
  torch::Tensor d_lb = torch::zeros_like(lb_const);
  if (grad) {
    const auto d = torch::autograd::grad({partial}, {la_const, lb_const},
                                         {torch::ones_like(partial)}, /*retain_graph=*/true,
                                         /*create_graph=*/false, /*allow_unused=*/true);
    if (d[0].defined()) d_la = d[0];
    if (d[1].defined()) d_lb = d[1];
  }
  std::vector<torch::Tensor> rows = {partial, d_la, d_lb};
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 1; i < terms.size(); ++i) {
      rows.push_back(terms[i](log_a.detach(), log_b.detach()).sum(1));
    }
  }
  const torch::Tensor sums = GatherWithMine(torch::stack(rows)).sum(0);
  std::vector<torch::Tensor> out = {sums[0] + (la - la.detach()) * sums[1].detach() +
                                    (lb - lb.detach()) * sums[2].detach()};
  for (size_t i = 1; i < terms.size(); ++i) out.push_back(sums[static_cast<int64_t>(i) + 2].detach());
  return out;
}

// The global top-k is inside the union of the ranks' local top-ks. Each rank sends
// min(k, largest shard) values, padded with −inf where its shard is smaller (the gathered tensors
// have one shape), so the union holds at least min(k, V) real values and no padding reaches the
// top k. Not GatherWithMine: values only, no gradient to route.
torch::Tensor ShardVocabOps::LargestValues(const torch::Tensor& z, int64_t k) const {
  torch::NoGradGuard no_grad;
  const int64_t n = z.size(0);
  const int64_t width = std::min(k, shard_.largest_rows());
  torch::Tensor mine = torch::full({n, width}, -std::numeric_limits<double>::infinity(),
                                   z.options().requires_grad(false));
  const int64_t local = std::min(width, z.size(1));
  mine.narrow(1, 0, local).copy_(std::get<0>(z.detach().topk(local, 1)));
  absl::StatusOr<torch::Tensor> all = shard_.group->AllGather(mine);
  if (!all.ok()) throw GroupFailure(std::move(all).status());
  const torch::Tensor candidates = all->permute({1, 0, 2}).reshape({n, -1});
  return std::get<0>(candidates.topk(std::min(k, candidates.size(1)), 1));
}

}  // namespace remotehead::core
