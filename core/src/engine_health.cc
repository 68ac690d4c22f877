// The head's health (engine.h, HeadHealth) from the logits the chunk loop already holds: per
// block three numbers a row, per chunk one combination over the vocabulary (on a head group, of
// every rank's columns in one all-gather), per call four fp64 sums.
#include <limits>

#include "engine_internal.h"

namespace remotehead::core::engine_internal {

// (m, s, t) with m = max_j z_j, s = Σ_j e_j, t = Σ_j e_j·(z_j − m), e_j = exp(z_j − m): from
// them lse = m + log s and E_p[z] = m + t / s, and the ranks' triples combine exactly (below).
// Taken about the row's max so that neither sum overflows; in the logits dtype (fp32), over a
// block that is still in cache.
torch::Tensor HealthPartials(const torch::Tensor& z) {
  torch::NoGradGuard no_grad;
  const torch::Tensor m = std::get<0>(z.max(1, /*keepdim=*/true));
  // Two [rows, V] temporaries at most (the memory model's kHealthWorkspaceBuffers).
  const torch::Tensor d = z - m;
  torch::Tensor e = d.exp();
  const torch::Tensor s = e.sum(1);
  return torch::stack({m.squeeze(1), s, e.mul_(d).sum(1)}, 1);
}

HealthSums ZeroHealthSums(const torch::TensorOptions& f64) {
  return {.entropy = torch::zeros({}, f64),
          .lse_sq = torch::zeros({}, f64),
          .logit_max_sum = torch::zeros({}, f64),
          .logit_max = torch::full({}, -std::numeric_limits<double>::infinity(), f64)};
}

void AddChunkHealth(const Plan& plan, const torch::Tensor& partials, const torch::Tensor& valid,
                    HealthSums& sums) {
  torch::NoGradGuard no_grad;
  torch::Tensor m, s, t;
  if (plan.shard == nullptr) {
    const torch::Tensor p = partials.to(torch::kDouble);
    m = p.select(1, 0);
    s = p.select(1, 1);
    t = p.select(1, 2);
  } else {
    // Every rank's triples [K, rows, 3], the same on every rank, combined in rank order: so
    // every rank holds the same health bit for bit. About the overall max M:
    //   S = Σ_r s_r·exp(m_r − M),  T = Σ_r exp(m_r − M)·(t_r + (m_r − M)·s_r).
    absl::StatusOr<torch::Tensor> all = plan.shard->group->AllGather(partials.contiguous());
    if (!all.ok()) throw GroupFailure(std::move(all).status());
    const torch::Tensor p = all->to(torch::kDouble);
    const torch::Tensor m_r = p.select(2, 0);
    const torch::Tensor s_r = p.select(2, 1);
    m = std::get<0>(m_r.max(0));
    const torch::Tensor shift = m_r - m;
    const torch::Tensor w = shift.exp();
    s = (w * s_r).sum(0);
    t = (w * (p.select(2, 2) + shift * s_r)).sum(0);
  }
  const torch::Tensor log_s = s.log();
  const torch::Tensor lse = m + log_s;
  const torch::Tensor entropy = log_s - t / s;  // lse − E_p[z]
  // where, not a multiply: an ignored row's values stay out even when not finite.
  auto valid_only = [&](const torch::Tensor& x, double fill) {
    return valid.defined() ? torch::where(valid, x, fill) : x;
  };
  sums.entropy += valid_only(entropy, 0.0).sum();
  sums.lse_sq += valid_only(lse * lse, 0.0).sum();
  sums.logit_max_sum += valid_only(m, 0.0).sum();
  if (m.numel() > 0) {
    sums.logit_max = torch::maximum(
        sums.logit_max, valid_only(m, -std::numeric_limits<double>::infinity()).max());
  }
}

HeadHealth ToHeadHealth(const HealthSums& sums, int64_t tokens) {
  return {.tokens = tokens,
          .entropy_sum = sums.entropy.item<double>(),
          .lse_sq_sum = sums.lse_sq.item<double>(),
          .logit_max_sum = sums.logit_max_sum.item<double>(),
          .logit_max = sums.logit_max.item<double>()};
}

}  // namespace remotehead::core::engine_internal
