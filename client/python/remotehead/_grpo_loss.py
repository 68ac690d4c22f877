"""TRL's GRPOTrainer._compute_loss (TRL 1.16) as one server call: the server function, params,
per-token inputs, weights and normalizer that reproduce it, and TRL's loss metrics from the
server's outputs. remotehead.trl's RemoteHeadGRPOTrainer uses it; nothing here talks to the
server.

Every loss type is one of the server's policy losses (docs/rl.md):

    grpo, bnpo, dr_grpo, dapo, luspo  ->  "grpo"   (their normalisations: weights, normalizer)
    cispo, sapo, vespo                ->  "cispo", "sapo", "vespo"

with importance_sampling_level "sequence" (params sequence_level, the completions as
sequence_ids), two-sided clipping (delta), the vLLM importance-sampling correction
(aux importance_sampling_ratio; TRL's per-completion (B, 1) ratio of the sequence_* modes with
params importance_sampling_per_sequence = 1, so that vespo counts it once), the off-policy
sequence mask (off_policy_mask, aux sampling_logprobs), the KL (beta, bias_correction_kl) and top_entropy_quantile < 1 (aux
policy_mask: TRL's own get_high_entropy_mask on the server's entropies, gathered over the
processes as TRL gathers them — a quantile over every rank's tokens that no one rank's call can
compute).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from trl.trainer.utils import nanmax, nanmin

# TRL's loss types and the server function that computes each.
LOSS_FUNCTIONS: Dict[str, str] = {
    "grpo": "grpo", "bnpo": "grpo", "dr_grpo": "grpo", "dapo": "grpo", "luspo": "grpo",
    "cispo": "cispo", "sapo": "sapo", "vespo": "vespo",
}
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def fallback_reason(trainer) -> Optional[Dict[str, str]]:
    """Why this trainer's loss cannot be one server call, as data ({"option": ..., "value":
    ..., "reason": ...}), or None when it can. Only options this TRL did not have when this was
    written (a loss type or level it does not know) fall back, to TRL's own loss code on the
    two-phase log-probs."""
    if trainer.loss_type not in LOSS_FUNCTIONS:
        return {"option": "loss_type", "value": str(trainer.loss_type),
                "reason": "a loss type the server has no function for"}
    if trainer.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        return {"option": "importance_sampling_level",
                "value": str(trainer.importance_sampling_level),
                "reason": "an importance-sampling level the server does not know"}
    return None


def coupled(trainer) -> bool:
    """Whether a token's loss reads its sequence (the server then needs sequence_ids)."""
    return (trainer.loss_type == "vespo" or trainer.importance_sampling_level == "sequence"
            or trainer.off_policy_mask_threshold is not None)


def _is_ratio(trainer, inputs) -> Optional[torch.Tensor]:
    """vLLM's importance-sampling ratio as TRL's loss reads it: (B, T) in the token_* modes,
    (B, 1) — one per completion — in the sequence_* modes (TRL's default, sequence_mask); None
    when TRL's loss does not read it. TRL multiplies by it with the vLLM correction on, and
    VESPO reads it whenever it is given."""
    is_ratio = inputs.get("importance_sampling_ratio")
    if is_ratio is not None and (trainer.loss_type == "vespo" or (
            trainer.use_vllm and trainer.vllm_importance_sampling_correction)):
        return is_ratio
    return None


def params(trainer, inputs=None) -> Dict[str, float]:
    args = trainer.args
    is_ratio = None if inputs is None else _is_ratio(trainer, inputs)
    p = {"beta": float(trainer.beta),
         "bias_correction_kl": float(bool(args.use_bias_correction_kl)),
         "sequence_level": float(trainer.importance_sampling_level == "sequence"),
         "off_policy_mask": float(trainer.off_policy_mask_threshold is not None),
         "off_policy_threshold": float(trainer.off_policy_mask_threshold or 0.0),
         # A (B, 1) ratio travels repeated at each token of its completion; this says it is
         # one per sequence, so that vespo counts its log once (TRL: Σ over a (B, 1) tensor),
         # not once per token. The other losses multiply per token either way.
         "importance_sampling_per_sequence": float(is_ratio is not None
                                                   and is_ratio.dim() == 2
                                                   and is_ratio.size(-1) == 1)}
    function = LOSS_FUNCTIONS[trainer.loss_type]
    if function == "grpo":
        p.update(epsilon_low=float(trainer.epsilon_low), epsilon_high=float(trainer.epsilon_high),
                 delta=float(args.delta) if args.delta is not None else 0.0)
    elif function == "cispo":
        p.update(epsilon_high=float(trainer.epsilon_high))
    elif function == "sapo":
        p.update(temperature_pos=float(args.sapo_temperature_pos),
                 temperature_neg=float(args.sapo_temperature_neg))
    else:
        p.update(k_pos=float(args.vespo_k_pos), lambda_pos=float(args.vespo_lambda_pos),
                 k_neg=float(args.vespo_k_neg), lambda_neg=float(args.vespo_lambda_neg))
    return p


def weights(trainer, mask: torch.Tensor, inputs, mode: str) -> Tuple[torch.Tensor, float]:
    """TRL's loss-type normalisation as per-token weights w and a normalizer:
    loss = Σ w·ℓ / normalizer. Per rank, as TRL's: under W processes grpo, sapo, bnpo, dr_grpo
    and luspo see only this rank's micro-batch, and dapo's, cispo's and vespo's
    num_items_in_batch is the count gathered over all ranks' generation batch, / W."""
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    mask = mask.double()  # the server rounds them to its logits' dtype once
    loss_type = trainer.loss_type
    if loss_type in ("grpo", "sapo"):  # mean over sequences of each sequence's token mean
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0), mask.size(0) * accumulation
    if loss_type == "bnpo":
        return mask, mask.sum().clamp(min=1.0).item() * accumulation
    if loss_type == "dr_grpo":
        return mask, mask.size(0) * trainer.max_completion_length * accumulation
    if loss_type == "luspo":  # Σ over each sequence's tokens, mean over sequences
        return mask, mask.size(0) * accumulation
    # dapo, cispo, vespo: num_items_in_batch spans the generation batch, rescaled to one window.
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":
        normalizer = (normalizer * trainer.current_gradient_accumulation_steps
                      / trainer.args.steps_per_generation)
    return mask, float(normalizer)


def _per_token(t: Optional[torch.Tensor], shape) -> Optional[torch.Tensor]:
    """A (B, T) or (B, 1) tensor as (B, T)."""
    return None if t is None else t.expand(shape)


def aux(trainer, inputs, mask: torch.Tensor, advantages: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The per-token inputs (B, T) of TRL's loss, but the entropy mask (policy_mask)."""
    shape = mask.shape
    out = {"advantages": advantages.expand(shape)}
    old = inputs.get("old_per_token_logps")
    if old is not None:  # else the server's default: logp.detach(), as TRL
        out["old_logprobs"] = old
    if trainer.beta != 0.0:
        out["ref_logprobs"] = inputs["ref_per_token_logps"]
    is_ratio = _is_ratio(trainer, inputs)
    if is_ratio is not None:  # a (B, 1) ratio repeated at each token (params says so)
        out["importance_sampling_ratio"] = _per_token(is_ratio, shape)
    if trainer.off_policy_mask_threshold is not None and "sampling_per_token_logps" in inputs:
        out["sampling_logprobs"] = inputs["sampling_per_token_logps"]
    if coupled(trainer):  # each completion is a sequence
        out["sequence_ids"] = torch.arange(shape[0], device=mask.device)[:, None].expand(shape)
    return out


def entropy_mask(trainer, mask: torch.Tensor):
    """top_entropy_quantile < 1: a function of the completions' entropies (B, T) giving TRL's
    get_high_entropy_mask (its quantile over every process's tokens: a collective every rank
    makes), or None."""
    if trainer.top_entropy_quantile >= 1.0:
        return None
    return lambda entropies: trainer.get_high_entropy_mask(
        entropies, mask, 1 - trainer.top_entropy_quantile).to(entropies.dtype)


def log_metrics(trainer, mode, out, logits_to_keep, mask, advantages, inputs, kl_sum):
    """TRL's loss metrics (kl, entropy, the clip ratios, VESPO's φ) from the server's outputs,
    reduced over the processes as TRL's are. `kl_sum`: the server's Σ of the KL over this rank's
    tokens (None without beta). Every rank calls the same collectives in the same order."""
    metrics = trainer._metrics[mode]
    maskf = mask.float()
    old = inputs.get("old_per_token_logps")
    sequence = trainer.importance_sampling_level == "sequence"

    def global_mean(local_sum, local_count):
        # As TRL stacks them: the sum in its own dtype, the count in float32 (promoted).
        totals = trainer.accelerator.reduce(torch.stack([local_sum, local_count]),
                                            reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def global_masked_mean(x):  # TRL's: (B, 1) counts sequences, (B, T) the valid tokens
        if x.shape[1] == 1:
            return global_mean(x.sum(), torch.tensor(float(x.shape[0]), device=x.device))
        return global_mean((x * mask).sum(), mask.sum().float())

    def masked_seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

    if trainer.beta != 0.0:
        kl = torch.tensor(kl_sum if mask.any() else 0.0, dtype=out.entropy.dtype,
                          device=mask.device)
        metrics["kl"].append(global_mean(kl, mask.sum().float()))
    metrics["entropy"].append(global_masked_mean(out.entropy[:, -logits_to_keep:]))
    if old is None:  # on-policy: every ratio is exactly 1
        log_ratio = torch.zeros_like(maskf)
    else:
        log_ratio = out.log_probs[:, -logits_to_keep:] - old
    if sequence:
        coef_1 = torch.exp((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0))[:, None]
    else:
        coef_1 = torch.exp(log_ratio)
    if trainer.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        if trainer.args.delta is not None:  # TRL's metrics see the two-sided clip's ratio
            coef_1 = torch.clamp(coef_1, max=trainer.args.delta)
        is_low = ((coef_1 < 1 - trainer.epsilon_low) & (advantages < 0)).float()
        is_high = ((coef_1 > 1 + trainer.epsilon_high) & (advantages > 0)).float()
        metrics["clip_ratio/low_mean"].append(global_masked_mean(is_low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(is_high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(is_low, is_high)))
        low = trainer.accelerator.gather(masked_seq_mean(is_low))
        metrics["clip_ratio/low_min"].append(nanmin(low).item())
        high = trainer.accelerator.gather(masked_seq_mean(is_high))
        metrics["clip_ratio/high_max"].append(nanmax(high).item())
    elif trainer.loss_type == "cispo":
        clipped = ((coef_1 > trainer.epsilon_high) & (advantages > 0)).float()
        metrics["cispo_clip_ratio"].append(global_masked_mean(clipped))
    elif trainer.loss_type == "vespo":
        args = trainer.args
        phi = trainer.get_gamma_weights(
            advantages=advantages, log_ratio_per_token=log_ratio, mask=maskf,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
            k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
            lambda_neg=args.vespo_lambda_neg)
        metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi))
