// The policy-gradient losses of RL trainers, as TRL's GRPOTrainer._compute_loss writes them
// (TRL 1.16), one registry entry per distinct per-token objective:
//
//   grpo   −min(r̃·A, clip(r, 1−ε_low, 1+ε_high)·A), r̃ = min(r, δ) with two-sided clipping
//          (δ > 0): loss types grpo, bnpo, dr_grpo, dapo and luspo, which differ only in their
//          normalisation — per-token weights and a normalizer (weighted_sum), the client's part
//   cispo  −sg(min(r, ε_high))·A·log p
//   sapo   −σ(τ·(r − 1))·4/τ·A, τ = τ_pos where A > 0, else τ_neg
//   vespo  −sg(φ(w))·A·log p, φ(w) = e^{λ + k·log w − λ·w}, w the sequence's ratio (with the
//          importance-sampling correction inside it: Σ of its log over the sequence's tokens,
//          or, with importance_sampling_per_sequence = 1, the sequence's one ratio's log once)
//
// then, for every loss but vespo, × the importance-sampling correction (aux
// importance_sampling_ratio: vLLM's, TRL's vllm_importance_sampling_correction) and the policy
// mask (aux policy_mask: e.g. TRL's top-entropy mask, top_entropy_quantile < 1), × the
// off-policy sequence mask (off_policy_mask = 1), and + β·KL (k3, × r with
// bias_correction_kl). r = exp(log p − old), per token, or with sequence_level = 1 (GSPO,
// importance_sampling_level "sequence") exp of the mean of log p − old over the token's
// sequence. log p is the target's log-probability (sampler-aware with the sampler's params).
//
// Token-level calls are ordinary per-token functions (one fused pass). A call whose tokens see
// their sequence — sequence_level = 1, off_policy_mask = 1, or vespo — is row-coupled
// (functions.h: couples_rows): the engine computes every token's log p first, then the loss
// below on the whole call under autograd, then backpropagates (two passes). Both run the same
// code: PolicyLoss, on a block's tokens or on the call's.
#include <cmath>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "remotehead/core/functions.h"
#include "remotehead/core/sampler_kept_set.h"

namespace remotehead::core {
namespace {

enum class Objective { kClip, kCispo, kSapo, kVespo };

// The tokens a loss is computed on: one block (token level) or the whole call (coupled), with
// the sequences of a coupled call.
struct PolicyTokens {
  torch::Tensor logp;  // [n] log p(target), differentiable
  const AuxTensors* aux = nullptr;
  const FunctionParams* params = nullptr;
  // A coupled call's sequences: each token's sequence as an index in [0, sequences), and the
  // valid tokens (bool) that sums over a sequence count. Undefined at token level.
  torch::Tensor sequence;
  torch::Tensor valid;
  int64_t sequences = 0;

  const torch::Tensor* Aux(const char* name) const {
    const auto it = aux->find(name);
    return it == aux->end() ? nullptr : &it->second;
  }
  double param(const char* name) const { return params->at(name); }
  // Σ over each token's sequence of x·valid, broadcast back to the tokens.
  torch::Tensor SequenceSum(const torch::Tensor& x) const {
    // where, not a product: a non-finite value at an ignored row stays out.
    const torch::Tensor sums = torch::zeros({sequences}, x.options())
                                   .index_add(0, sequence, torch::where(valid, x, 0.0));
    return sums.index_select(0, sequence);
  }
  // The mean over each token's sequence's valid tokens (TRL's sum / mask.sum().clamp(min=1)).
  torch::Tensor SequenceMean(const torch::Tensor& x) const {
    return SequenceSum(x) / SequenceSum(torch::ones_like(x)).clamp_min(1.0);
  }
};

// VESPO's gamma weight φ(w) of each token's sequence (TRL's get_gamma_weights, no gradient):
// log w = Σ_seq clamp(log r, ±20) (+ Σ_seq clamp(log ratio_IS, log 1e-8, 20)), clamped to
// [log 1e-8, 20]; log φ = λ + k·log w − λ·w, k and λ by the sign of the advantage.
torch::Tensor GammaWeights(const PolicyTokens& t, const torch::Tensor& log_ratio,
                           const torch::Tensor& adv) {
  torch::NoGradGuard no_grad;
  const double lower = std::log(1e-8);
  torch::Tensor seq_log_ratio = t.SequenceSum(torch::clamp(log_ratio.detach(), -20.0, 20.0));
  if (const torch::Tensor* is = t.Aux("importance_sampling_ratio")) {
    const torch::Tensor log_is = torch::clamp(torch::log(*is), lower, 20.0);
    if (t.param("importance_sampling_per_sequence") != 0) {
      // One ratio per sequence (TRL's (B, 1) ratio of the sequence_* modes), repeated at its
      // tokens (Validate checked they agree): its log counts once, not once per token. Taken
      // from any row of the sequence, valid or not: each holds the same value.
      seq_log_ratio = seq_log_ratio + torch::zeros({t.sequences}, log_is.options())
                                          .index_copy(0, t.sequence, log_is)
                                          .index_select(0, t.sequence);
    } else {
      seq_log_ratio = seq_log_ratio + t.SequenceSum(log_is);
    }
  }
  const torch::Tensor log_w = torch::clamp(seq_log_ratio, lower, 20.0);
  const torch::Tensor nonneg = adv >= 0;
  const torch::Tensor k = torch::where(nonneg, t.param("k_pos"), t.param("k_neg")).to(log_w.dtype());
  const torch::Tensor lambda =
      torch::where(nonneg, t.param("lambda_pos"), t.param("lambda_neg")).to(log_w.dtype()).clamp_min(1e-4);
  const torch::Tensor log_phi = lambda + k * log_w - lambda * torch::exp(log_w);
  return torch::nan_to_num(torch::exp(log_phi), 0.0, 0.0, 0.0);
}

// DeepSeek-V3.2's off-policy sequence mask (TRL's get_off_policy_mask): keep a token unless its
// advantage is negative and its sequence's mean KL(sampler ‖ policy) exceeds the threshold.
torch::Tensor OffPolicyMask(const PolicyTokens& t, const torch::Tensor& old_logp,
                            const torch::Tensor& adv) {
  torch::NoGradGuard no_grad;
  const torch::Tensor* sampling = t.Aux("sampling_logprobs");
  const torch::Tensor kl =
      torch::nan_to_num((sampling != nullptr ? *sampling : old_logp) - t.logp.detach(), 0.0);
  const torch::Tensor keep =
      (adv >= 0).logical_or(t.SequenceMean(kl) <= t.param("off_policy_threshold"));
  return keep.to(t.logp.dtype());
}

FunctionOutput PolicyLossOfKept(Objective objective, const PolicyTokens& t) {
  const torch::Tensor& logp = t.logp;
  const torch::Tensor& adv = t.aux->at("advantages");
  const torch::Tensor* old_in = t.Aux("old_logprobs");
  // On-policy (no old log-probs): the current ones, detached — the ratio is 1 with gradient.
  const torch::Tensor old_logp = old_in != nullptr ? *old_in : logp.detach();
  const torch::Tensor log_ratio = logp - old_logp;
  const bool sequence_level = t.params->at("sequence_level") != 0;
  const torch::Tensor ratio = torch::exp(sequence_level ? t.SequenceMean(log_ratio) : log_ratio);

  FunctionOutput out;
  torch::Tensor loss;
  switch (objective) {
    case Objective::kClip: {
      const double low = 1.0 - t.param("epsilon_low"), high = 1.0 + t.param("epsilon_high");
      const torch::Tensor clipped = torch::clamp(ratio, low, high);
      const double delta = t.param("delta");
      const torch::Tensor unclipped = delta > 0 ? torch::clamp_max(ratio, delta) : ratio;
      loss = -torch::min(unclipped * adv, clipped * adv);
      out.extras["clipped"] = (ratio != clipped).to(logp.dtype()).detach();
      break;
    }
    case Objective::kCispo: {
      const double high = t.param("epsilon_high");
      loss = -torch::clamp_max(ratio, high).detach() * adv * logp;
      out.extras["clipped"] = (ratio > high).to(logp.dtype()).detach();
      break;
    }
    case Objective::kSapo: {
      const torch::Tensor tau = torch::where(adv > 0, t.param("temperature_pos"),
                                             t.param("temperature_neg"))
                                    .to(logp.dtype());
      loss = -torch::sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv;
      break;
    }
    case Objective::kVespo:
      loss = -GammaWeights(t, log_ratio, adv) * adv * logp;
      break;
  }
  if (t.params->at("off_policy_mask") != 0) loss = loss * OffPolicyMask(t, old_logp, adv);
  if (const torch::Tensor* mask = t.Aux("policy_mask")) loss = loss * *mask;
  if (objective != Objective::kVespo) {
    if (const torch::Tensor* is = t.Aux("importance_sampling_ratio")) loss = loss * *is;
  }
  if (const torch::Tensor* ref = t.Aux("ref_logprobs")) {
    const torch::Tensor d = *ref - logp;
    torch::Tensor kl = torch::exp(d) - d - 1.0;
    if (t.param("bias_correction_kl") != 0) kl = kl * ratio;
    if (t.param("beta") != 0) loss = loss + t.param("beta") * kl;
    out.extras["kl"] = kl.detach();
  }
  out.per_token = loss;
  return out;
}

// A target outside the sampler's kept set (log p = −inf, TargetLogProb) contributes nothing:
// its loss, extras and gradient are 0, and its sequence's sums leave it out. (In RL the target
// is a token the sampler drew; under the current policy it may no longer be one it can draw.)
FunctionOutput PolicyLoss(Objective objective, PolicyTokens t) {
  const torch::Tensor kept = t.logp.detach() != -kInf;
  t.logp = torch::where(kept, t.logp, 0.0);
  if (t.valid.defined()) t.valid = t.valid.logical_and(kept);
  FunctionOutput out = PolicyLossOfKept(objective, t);
  out.per_token = torch::where(kept, out.per_token, 0.0);
  for (auto& [name, extra] : out.extras) extra = torch::where(kept, extra, 0.0);
  return out;
}

// A call is row-coupled when a token's loss reads its sequence.
bool Coupled(Objective objective, const FunctionParams& params) {
  return objective == Objective::kVespo || params.at("sequence_level") != 0 ||
         params.at("off_policy_mask") != 0;
}

absl::Status CheckBinary(const FunctionParams& params, const char* name) {
  const double v = params.at(name);
  if (v == 0.0 || v == 1.0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("params[\"", name, "\"]: expected 0 or 1; got ", v));
}

// importance_sampling_per_sequence = 1: the ratio is one value per sequence, so every token of
// a sequence (sequence_ids) must carry the same one — else the sequence's ratio is undefined.
// Named by the caller's sequence id and values, never by a row: rows may have been left out.
absl::Status CheckRatioPerSequence(const FunctionParams& params, const AuxTensors& aux) {
  const auto is = aux.find("importance_sampling_ratio");
  const auto ids = aux.find("sequence_ids");
  if (params.at("importance_sampling_per_sequence") == 0 || is == aux.end() ||
      ids == aux.end() || is->second.numel() == 0) {
    return absl::OkStatus();
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor ratio = is->second.to(torch::kDouble);
  const auto [unique, index] =
      torch::_unique(ids->second, /*sorted=*/true, /*return_inverse=*/true);
  const torch::Tensor init = torch::zeros({unique.size(0)}, ratio.options());
  const torch::Tensor high = init.index_reduce(0, index, ratio, "amax", /*include_self=*/false);
  const torch::Tensor low = init.index_reduce(0, index, ratio, "amin", /*include_self=*/false);
  const torch::Tensor differ = high != low;
  if (!differ.any().item<bool>()) return absl::OkStatus();
  const int64_t s = differ.nonzero()[0][0].item<int64_t>();
  return absl::InvalidArgumentError(absl::StrCat(
      "aux[\"importance_sampling_ratio\"]: expected one ratio per sequence with "
      "params[\"importance_sampling_per_sequence\"] = 1 (the same at every token of a "
      "sequence); got values from ",
      low[s].item<double>(), " to ", high[s].item<double>(), " in sequence ",
      unique[s].item<int64_t>()));
}

absl::Status Validate(Objective objective, const FunctionParams& params, const AuxTensors& aux) {
  for (const char* name : {"sequence_level", "off_policy_mask", "bias_correction_kl",
                           "importance_sampling_per_sequence"}) {
    if (absl::Status s = CheckBinary(params, name); !s.ok()) return s;
  }
  if (absl::Status s = ValidateSamplerParams(params); !s.ok()) return s;
  if (params.at("beta") > 0 && !aux.contains("ref_logprobs")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "aux[\"ref_logprobs\"]: expected per-token reference log-probs because beta = ",
        params.at("beta"), " > 0; got none"));
  }
  if (Coupled(objective, params) && !aux.contains("sequence_ids")) {
    const char* why = objective == Objective::kVespo ? "vespo weighs each sequence by its ratio"
                      : params.at("sequence_level") != 0
                          ? "params[\"sequence_level\"] = 1 takes each sequence's mean log-ratio"
                          : "params[\"off_policy_mask\"] = 1 masks whole sequences";
    return absl::InvalidArgumentError(absl::StrCat(
        "aux[\"sequence_ids\"]: expected the sequence of every token (integers; the tokens of "
        "one completion share one) because ",
        why, "; got none"));
  }
  return CheckRatioPerSequence(params, aux);
}

// The options every policy loss takes (TRL's GRPOConfig names in the help).
std::vector<ParamSpec> CommonPolicyParams() {
  return {
      {"beta", 0.0, 0.0, kInf, "KL coefficient (needs ref_logprobs when > 0)"},
      {"bias_correction_kl", 0.0, 0.0, 1.0,
       "1: the KL is multiplied by the ratio (TRL's use_bias_correction_kl)"},
      {"sequence_level", 0.0, 0.0, 1.0,
       "1: the ratio of each token is its sequence's, exp(mean of log p − old) (GSPO; TRL's "
       "importance_sampling_level \"sequence\"; needs sequence_ids)"},
      {"off_policy_mask", 0.0, 0.0, 1.0,
       "1: tokens of a sequence with a negative advantage and a mean KL(sampler ‖ policy) above "
       "off_policy_threshold contribute nothing (TRL's off_policy_mask_threshold; needs "
       "sequence_ids)"},
      {"off_policy_threshold", 0.0, -kInf, kInf, "the off-policy mask's KL threshold"},
      {"importance_sampling_per_sequence", 0.0, 0.0, 1.0,
       "1: importance_sampling_ratio is one ratio per sequence, the same at each of its tokens "
       "(TRL's vllm_importance_sampling_mode sequence_mask / sequence_truncate, shape (B, 1)): "
       "vespo adds its log once per sequence; the other losses multiply each token's loss by "
       "it as always. With sequence_ids, a sequence whose tokens differ is refused"},
  };
}

const std::vector<std::string>& PolicyAux() {
  static const auto* aux = new std::vector<std::string>{
      "old_logprobs", "ref_logprobs", "importance_sampling_ratio", "policy_mask",
      "sampling_logprobs", "sequence_ids"};
  return *aux;
}

TransformFunction PolicyFunction(Objective objective, std::string name, std::string help,
                                 std::vector<ParamSpec> own_params) {
  std::vector<ParamSpec> params = std::move(own_params);
  for (ParamSpec& p : CommonPolicyParams()) params.push_back(std::move(p));
  for (ParamSpec& p : SamplerParams()) params.push_back(std::move(p));
  std::vector<ExtraSpec> extras = {
      {.name = "kl",
       .help = "the k3 KL to the reference policy (× the ratio with bias_correction_kl)",
       .when_aux = "ref_logprobs"}};
  if (objective == Objective::kClip) {
    extras.push_back({"clipped", "1 where the ratio is outside [1 − ε_low, 1 + ε_high], else 0"});
  } else if (objective == Objective::kCispo) {
    extras.push_back({"clipped", "1 where the ratio is above ε_high (its weight capped), else 0"});
  }
  // VESPO always weighs by its sequence: its sequences are required, the others' optional.
  std::vector<std::string> required = {"advantages"};
  std::vector<std::string> optional;
  for (const std::string& aux : PolicyAux()) {
    (objective == Objective::kVespo && aux == "sequence_ids" ? required : optional).push_back(aux);
  }
  return {
      .name = std::move(name),
      .help = std::move(help),
      .required_aux = std::move(required),
      .optional_aux = std::move(optional),
      .aux_kinds = {{"sequence_ids", AuxKind::kPerTokenIds}},
      .params = std::move(params),
      .extras = std::move(extras),
      .workspace_logit_buffers = 3,
      .surrogate_gradient = objective == Objective::kCispo || objective == Objective::kVespo,
      .ignored_rows_contribute_nothing = true,
      .forward =
          [objective](const ChunkInputs& in) {
            return PolicyLoss(objective,
                              {.logp = TargetLogProb(in), .aux = &in.aux, .params = in.params});
          },
      .validate = [objective](const FunctionParams& params, const AuxTensors& aux,
                              bool) { return Validate(objective, params, aux); },
      .couples_rows = [objective](const FunctionParams& params) {
        return Coupled(objective, params);
      },
      .per_token_value = [](const ChunkInputs& in) { return TargetLogProb(in); },
      .coupled_forward =
          [objective](const CoupledInputs& in) {
            // Sequence ids of any integers: their index among the call's distinct ids.
            const torch::Tensor ids = in.aux.at("sequence_ids");
            const auto [unique, index] = torch::_unique(ids, /*sorted=*/true,
                                                        /*return_inverse=*/true);
            return PolicyLoss(objective, {.logp = in.values,
                                          .aux = &in.aux,
                                          .params = in.params,
                                          .sequence = index,
                                          .valid = in.valid,
                                          .sequences = unique.size(0)});
          },
  };
}

}  // namespace

std::vector<TransformFunction> PolicyLossFunctions() {
  return {
      PolicyFunction(
          Objective::kClip, "grpo",
          "GRPO's clipped policy loss (TRL loss types grpo, bnpo, dr_grpo, dapo, luspo: their "
          "normalisations are weights and a normalizer) with an optional k3 KL to a reference",
          {{"epsilon_low", 0.2, 0.0, 1.0, "lower clip: ratio >= 1 - epsilon_low"},
           {"epsilon_high", 0.2, 0.0, kInf, "upper clip: ratio <= 1 + epsilon_high"},
           {"delta", 0.0, 0.0, kInf,
            "if > 0: two-sided clipping, the unclipped ratio capped at delta (TRL's delta)"}}),
      PolicyFunction(Objective::kCispo, "cispo",
                     "CISPO: the log-probability weighted by the advantage and the ratio capped "
                     "at epsilon_high (no gradient through the weight)",
                     {{"epsilon_high", 5.0, 0.0, kInf,
                       "the ratio's cap (TRL's epsilon_high; ScaleRL recommends 5)"}}),
      PolicyFunction(Objective::kSapo, "sapo",
                     "SAPO: a soft, sigmoid gate on the ratio in place of clipping",
                     {{"temperature_pos", 1.0, 1e-6, kInf,
                       "the gate's temperature where the advantage is > 0"},
                      {"temperature_neg", 1.05, 1e-6, kInf,
                       "the gate's temperature where the advantage is <= 0"}}),
      PolicyFunction(Objective::kVespo, "vespo",
                     "VESPO: the log-probability weighted by the advantage and a gamma weight of "
                     "its sequence's ratio (needs sequence_ids)",
                     {{"k_pos", 2.0, 0.0, kInf, "the weight's power where the advantage is >= 0"},
                      {"lambda_pos", 3.0, 0.0, kInf, "its decay where the advantage is >= 0"},
                      {"k_neg", 3.0, 0.0, kInf, "the weight's power where the advantage is < 0"},
                      {"lambda_neg", 2.0, 0.0, kInf, "its decay where the advantage is < 0"}}),
  };
}

}  // namespace remotehead::core
