// The policy losses' references (policy_losses.cc): TRL's GRPOTrainer._compute_loss (TRL 1.16)
// written again one sequence at a time — each sequence's valid tokens selected and computed as
// TRL computes one row of its [B, T] batch — on float64 logits; NaiveReference differentiates
// them with autograd.
#include "core/policy_reference.h"

#include <cmath>
#include <limits>
#include <string>

namespace remotehead::reference {
namespace {

torch::Tensor Get(const core::AuxTensors& aux, const std::string& name) {
  const auto it = aux.find(name);
  return it == aux.end() ? torch::Tensor() : it->second;
}

// TRL's torch.where of two Python floats: float32 values, promoted by what they multiply.
torch::Tensor BySign(const torch::Tensor& condition, double if_true, double if_false) {
  return torch::where(condition, torch::tensor(static_cast<float>(if_true)),
                      torch::tensor(static_cast<float>(if_false)))
      .to(torch::kDouble);
}

// One sequence's per-token loss (or, at token level, any tokens'): logp [T] and inputs [T].
torch::Tensor SequenceLoss(PolicyLoss kind, const torch::Tensor& logp, const core::AuxTensors& in,
                           const core::FunctionParams& p) {
  const torch::Tensor adv = Get(in, "advantages");
  const torch::Tensor given_old = Get(in, "old_logprobs");
  const torch::Tensor old = given_old.defined() ? given_old : logp.detach();
  const torch::Tensor log_ratio = logp - old;
  const double tokens = std::max<double>(1.0, static_cast<double>(logp.size(0)));
  const torch::Tensor coef_1 =
      torch::exp(p.at("sequence_level") != 0 ? log_ratio.sum() / tokens : log_ratio);
  const torch::Tensor is = Get(in, "importance_sampling_ratio");
  torch::Tensor loss;
  switch (kind) {
    case PolicyLoss::kClip: {
      const torch::Tensor coef_2 =
          torch::clamp(coef_1, 1 - p.at("epsilon_low"), 1 + p.at("epsilon_high"));
      const torch::Tensor c1 =
          p.at("delta") > 0 ? torch::clamp(coef_1, std::nullopt, p.at("delta")) : coef_1;
      loss = -torch::min(c1 * adv, coef_2 * adv);
      break;
    }
    case PolicyLoss::kCispo:
      loss = -torch::clamp(coef_1, std::nullopt, p.at("epsilon_high")).detach() * adv * logp;
      break;
    case PolicyLoss::kSapo: {
      const torch::Tensor tau = BySign(adv > 0, p.at("temperature_pos"), p.at("temperature_neg"));
      loss = -torch::sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv;
      break;
    }
    case PolicyLoss::kVespo: {
      torch::Tensor phi;
      {
        torch::NoGradGuard no_grad;
        const double lower = std::log(1e-8);
        torch::Tensor seq = torch::clamp(log_ratio.detach(), -20.0, 20.0).sum();
        if (is.defined() && is.numel() > 0) {
          // importance_sampling_per_sequence: one ratio per sequence (TRL's (B, 1)), repeated
          // at its tokens, counted once; else one per token, each counted.
          const torch::Tensor log_is = torch::clamp(torch::log(is), lower, 20.0);
          const bool per_sequence = p.contains("importance_sampling_per_sequence") &&
                                    p.at("importance_sampling_per_sequence") != 0;
          seq = seq + (per_sequence ? log_is[0] : log_is.sum());
        }
        const torch::Tensor lw = torch::clamp(seq, lower, 20.0);
        const torch::Tensor k = BySign(adv >= 0, p.at("k_pos"), p.at("k_neg"));
        const torch::Tensor lam =
            BySign(adv >= 0, p.at("lambda_pos"), p.at("lambda_neg")).clamp_min(1e-4);
        phi = torch::nan_to_num(torch::exp(lam + k * lw - lam * torch::exp(lw)), 0.0, 0.0, 0.0);
      }
      loss = -phi * adv * logp;
      break;
    }
  }
  if (p.at("off_policy_mask") != 0) {
    const torch::Tensor given = Get(in, "sampling_logprobs");
    const torch::Tensor kl = torch::nan_to_num((given.defined() ? given : old) - logp.detach(), 0.0);
    const torch::Tensor keep = (adv >= 0).logical_or(kl.sum() / tokens <= p.at("off_policy_threshold"));
    loss = loss * keep.to(torch::kDouble);
  }
  if (Get(in, "policy_mask").defined()) loss = loss * Get(in, "policy_mask");
  if (is.defined() && kind != PolicyLoss::kVespo) loss = loss * is;
  const torch::Tensor ref = Get(in, "ref_logprobs");
  if (ref.defined()) {
    torch::Tensor kl = torch::exp(ref - logp) - (ref - logp) - 1;
    if (p.at("bias_correction_kl") != 0) kl = kl * coef_1;
    if (p.at("beta") != 0) loss = loss + p.at("beta") * kl;
  }
  return loss;
}

}  // namespace

torch::Tensor PolicyReference(PolicyLoss kind, const torch::Tensor& sampled_logp,
                              const core::AuxTensors& aux, const core::FunctionParams& p) {
  // A target outside the sampler's kept set (−inf) contributes nothing and is left out of its
  // sequence's sums.
  const torch::Tensor kept = sampled_logp.detach() != -std::numeric_limits<double>::infinity();
  const torch::Tensor logp = torch::where(kept, sampled_logp, 0.0);
  const bool coupled =
      kind == PolicyLoss::kVespo || p.at("sequence_level") != 0 || p.at("off_policy_mask") != 0;
  if (!coupled) return torch::where(kept, SequenceLoss(kind, logp, aux, p), 0.0);
  const torch::Tensor valid = Get(aux, "valid").logical_and(kept);
  const torch::Tensor ids = Get(aux, "sequence_ids");
  torch::Tensor y = torch::zeros_like(logp);
  const torch::Tensor distinct = std::get<0>(torch::_unique(ids)).to(torch::kLong).contiguous();
  for (int64_t i = 0; i < distinct.numel(); ++i) {
    const int64_t id = distinct[i].item<int64_t>();
    const torch::Tensor rows = ((ids == id).logical_and(valid)).nonzero().squeeze(1);
    if (rows.numel() == 0) continue;
    core::AuxTensors sequence;
    for (const auto& [name, tensor] : aux) {
      if (name != "valid" && name != "sequence_ids") sequence[name] = tensor.index_select(0, rows);
    }
    y = y.index_put({rows}, SequenceLoss(kind, logp.index_select(0, rows), sequence, p));
  }
  return y;
}

}  // namespace remotehead::reference
