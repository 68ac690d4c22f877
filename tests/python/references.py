"""The reference of every function the server computes per token, in one table keyed by the
function's name: y [N] from the logits, written from the function's definition in float64 (the
Python twin of tests/core/reference.cc's ReferencePerToken).

Which functions exist, their parameters with defaults and ranges, and their aux inputs are the
server's registry's (ListFunctions, the `registry` fixture of conftest.py), not lists kept here:
tests/python/test_functions.py runs every function the server lists against its entry in
REFERENCES and fails for a listed per-token function without one. Adding a function is its
registration in C++ plus its entry here (and, for an aux input of a new name, its maker in
AUX_INPUTS). The distillation functions (a teacher head, or [N, k] top-k aux inputs) have theirs
in tests/python/distill_reference.py, run by test_distillation.py.
"""

import dataclasses
import math
from typing import Callable, Dict, Mapping, Optional

import torch
import torch.nn.functional as F

# y [N] = per_token(z [N, V], targets [N] (0 where ignored), aux by name [N], params by name):
# z after the common parameters (COMMON_PARAMS), everything float64; params hold every
# parameter the server lists for the function (its defaults where the test sets none).
PerToken = Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor],
                     Mapping[str, float]], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Reference:
    per_token: PerToken
    # Values other than the defaults to run the function with too (inside the listed ranges).
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)


def _logprobs(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z, 1).gather(1, t[:, None])[:, 0]


def cross_entropy(z, t, aux, p):
    y = F.cross_entropy(z, t, reduction="none", label_smoothing=p["label_smoothing"])
    return y + p["z_loss"] * torch.logsumexp(z, 1) ** 2  # PaLM's z-loss


def sampler_kept_mask(z: torch.Tensor, p: Mapping[str, float]) -> torch.Tensor:
    """The kept set [N, V] bool of a top-k / top-p / min-p sampler (core/sampler_kept_set.h),
    from its definition: each truncation in its order (top-k, top-p over what top-k kept
    renormalised, then min-p; min_p_first = 1: min-p first, vLLM's order) as a mask over the
    sorted distribution, ties with a boundary kept; min-p in probabilities (p >= min_p·p_max).
    Absent params are off."""
    z = z.detach()
    top_k, top_p = int(p.get("top_k", 0)), p.get("top_p", 1.0)
    min_p, first = p.get("min_p", 0.0), p.get("min_p_first", 0.0) != 0
    keep = torch.ones_like(z, dtype=torch.bool)

    def apply_min_p():
        nonlocal keep
        if min_p > 0:
            probs = torch.softmax(z.masked_fill(~keep, -torch.inf), 1)
            keep = keep & (probs >= min_p * probs.max(1, keepdim=True).values)

    if first:
        apply_min_p()
    if 0 < top_k < z.shape[1]:
        kth = z.masked_fill(~keep, -torch.inf).sort(1, descending=True).values[:, top_k - 1:top_k]
        keep = keep & (z >= kth)
    if top_p < 1:
        ordered = z.masked_fill(~keep, -torch.inf).sort(1, descending=True).values
        reached = torch.softmax(ordered, 1).cumsum(1) >= top_p
        last = (~reached).sum(1, keepdim=True).clamp(max=z.shape[1] - 1)
        keep = keep & (z >= ordered.gather(1, last))
    if not first:
        apply_min_p()
    return keep


def token_logprobs(z, t, aux, p):
    """log p(t); with sampler params under the renormalised kept set, −inf (no gradient) for a
    target outside it."""
    keep = sampler_kept_mask(z, p)
    y = _logprobs(z.masked_fill(~keep, -torch.inf), t)
    return torch.where(keep.gather(1, t[:, None])[:, 0], y, -torch.inf)


def entropy(z, t, aux, p):
    return -(torch.softmax(z, 1) * torch.log_softmax(z, 1)).sum(1)


def _by_sign(condition, if_true, if_false):
    """TRL's torch.where of two Python floats (float32 values, promoted where used)."""
    return torch.where(condition, if_true, if_false).to(torch.float64)


def _policy_sequence(kind, logp, aux, p):
    """TRL's GRPOTrainer._compute_loss (TRL 1.16) on the tokens of one sequence (or, at token
    level, on any tokens): the per-token loss before its loss type's normalisation."""
    adv = aux["advantages"]
    old = aux["old_logprobs"] if "old_logprobs" in aux else logp.detach()
    log_ratio = logp - old
    tokens = max(1, logp.shape[0])
    log_w = log_ratio.sum() / tokens if p["sequence_level"] else log_ratio
    coef_1 = torch.exp(log_w)
    is_ratio = aux.get("importance_sampling_ratio")
    if kind == "grpo":
        coef_2 = torch.clamp(coef_1, 1 - p["epsilon_low"], 1 + p["epsilon_high"])
        c1 = torch.clamp(coef_1, max=p["delta"]) if p["delta"] > 0 else coef_1
        loss = -torch.min(c1 * adv, coef_2 * adv)
    elif kind == "cispo":
        loss = -torch.clamp(coef_1, max=p["epsilon_high"]).detach() * adv * logp
    elif kind == "sapo":
        tau = _by_sign(adv > 0, p["temperature_pos"], p["temperature_neg"])
        loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    else:  # vespo
        with torch.no_grad():
            lower = math.log(1e-8)
            seq = torch.clamp(log_ratio, -20.0, 20.0).sum()
            if is_ratio is not None:
                # importance_sampling_per_sequence: one ratio per sequence (TRL's (B, 1)),
                # repeated at its tokens, counted once.
                log_is = torch.clamp(torch.log(is_ratio), lower, 20.0)
                per_sequence = p.get("importance_sampling_per_sequence", 0.0)
                seq = seq + (log_is[0] if per_sequence else log_is.sum())
            lw = torch.clamp(seq, lower, 20.0)
            k = _by_sign(adv >= 0, p["k_pos"], p["k_neg"])
            lam = _by_sign(adv >= 0, p["lambda_pos"], p["lambda_neg"]).clamp(min=1e-4)
            phi = torch.exp(lam + k * lw - lam * torch.exp(lw)).nan_to_num(0.0, 0.0, 0.0)
        loss = -phi * adv * logp
    if p["off_policy_mask"]:
        sampling = aux.get("sampling_logprobs", old)
        kl = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
        loss = loss * ((adv >= 0) | (kl.sum() / tokens <= p["off_policy_threshold"])).double()
    if "policy_mask" in aux:
        loss = loss * aux["policy_mask"]
    if is_ratio is not None and kind != "vespo":
        loss = loss * is_ratio
    if "ref_logprobs" in aux:
        ref = aux["ref_logprobs"]
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if p["bias_correction_kl"]:
            kl = kl * coef_1
        if p["beta"]:
            loss = loss + p["beta"] * kl
    return loss


def _policy(kind):
    """The policy loss `kind` (grpo, cispo, sapo, vespo) on the call's rows: token by token, or
    — when it couples them (sequence_level, off_policy_mask, vespo) — one sequence (the valid rows
    of one sequence_ids value) at a time."""
    def per_token(z, t, aux, p):
        logp = _logprobs(z, t)
        if not (kind == "vespo" or p["sequence_level"] or p["off_policy_mask"]):
            return _policy_sequence(kind, logp, aux, p)
        valid, ids = aux["valid"], aux["sequence_ids"].long()
        y = torch.zeros_like(logp)
        for sequence in ids.unique():
            rows = ((ids == sequence) & valid).nonzero()[:, 0]
            if rows.numel():
                inputs = {k: v[rows] for k, v in aux.items() if k not in ("valid", "sequence_ids")}
                y = y.index_put((rows,), _policy_sequence(kind, logp[rows], inputs, p))
        return y
    return per_token


def mse_onehot(z, t, aux, p):
    return ((z - F.one_hot(t, z.shape[1]).to(z.dtype)) ** 2).mean(1)  # nn.MSELoss per token


def sigmoid_sum(z, t, aux, p):
    return torch.sigmoid(z).sum(1)


REFERENCES: Dict[str, Reference] = {
    "cross_entropy": Reference(cross_entropy, {"label_smoothing": 0.1, "z_loss": 1e-3}),
    "token_logprobs": Reference(token_logprobs),
    "entropy": Reference(entropy),
    "grpo": Reference(_policy("grpo"), {"epsilon_low": 0.1, "epsilon_high": 0.28, "delta": 1.2,
                                        "beta": 0.04, "bias_correction_kl": 1.0,
                                        "sequence_level": 1.0}),
    "cispo": Reference(_policy("cispo"), {"epsilon_high": 1.1, "beta": 0.04,
                                          "off_policy_mask": 1.0, "off_policy_threshold": 0.05}),
    "sapo": Reference(_policy("sapo"), {"temperature_pos": 0.8, "temperature_neg": 1.3,
                                        "sequence_level": 1.0, "beta": 0.04}),
    "vespo": Reference(_policy("vespo"), {"k_pos": 1.5, "lambda_pos": 2.5, "k_neg": 2.5,
                                          "lambda_neg": 1.5, "beta": 0.04,
                                          "bias_correction_kl": 1.0}),
    "mse_onehot": Reference(mse_onehot),
    "sigmoid_sum": Reference(sigmoid_sum),
}

# The parameters every function accepts (listed with common=True), applied to the logits in
# this order before the function, each with a value other than its default to run with.
COMMON_PARAMS: Dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "logit_scale": lambda z, scale: z * scale,
    "softcap": lambda z, cap: cap * torch.tanh(z / cap) if cap > 0 else z,
    "temperature": lambda z, temperature: z / temperature,
}
COMMON_PARAM_VALUES = {"logit_scale": 1.3, "softcap": 3.0, "temperature": 0.7}

# An aux input's values by its name, from the rows' current log-probabilities of their targets
# (logp [N]) and a generator: the sampling and reference policies' log-probabilities near the
# current ones, so that GRPO's ratio is clipped on some rows and not on others.
AUX_INPUTS: Dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "advantages": lambda logp, g: torch.randn(logp.shape, generator=g, dtype=logp.dtype),
    "old_logprobs": lambda logp, g: logp + 0.3 * torch.randn(logp.shape, generator=g,
                                                             dtype=logp.dtype),
    "ref_logprobs": lambda logp, g: logp + 0.3 * torch.randn(logp.shape, generator=g,
                                                             dtype=logp.dtype),
    "sampling_logprobs": lambda logp, g: logp + 0.3 * torch.randn(logp.shape, generator=g,
                                                                  dtype=logp.dtype),
    "importance_sampling_ratio": lambda logp, g: torch.exp(
        0.2 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)),
    "policy_mask": lambda logp, g: (torch.rand(logp.shape, generator=g) > 0.3).to(logp.dtype),
    # Integers: four sequences, interleaved.
    "sequence_ids": lambda logp, g: torch.randint(0, 4, logp.shape, generator=g),
}


def logits(hidden: torch.Tensor, weight: torch.Tensor, params: Mapping[str, float]):
    """z = X Wᵀ in float64, with the common parameters applied (differentiable)."""
    z = hidden.to(torch.float64) @ weight.to(torch.float64).t()
    for name, apply in COMMON_PARAMS.items():
        z = apply(z, params[name])
    return z


def per_token(function: str, hidden: torch.Tensor, weight: torch.Tensor,
              targets: Optional[torch.Tensor], aux: Mapping[str, torch.Tensor],
              params: Mapping[str, float], ignore_index: int = -100) -> torch.Tensor:
    """The reference y [N] (float64; 0 where the target is ignore_index) of `function` on the
    rows of `hidden` [N, D] for a head of weight [V, D]; differentiable in hidden and weight."""
    z = logits(hidden, weight, params)
    n = z.shape[0]
    valid = torch.ones(n, dtype=torch.bool)
    safe = torch.zeros(n, dtype=torch.long)
    if targets is not None:
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets))
    aux64 = {name: t.to(torch.float64) if t.dtype.is_floating_point else t
             for name, t in aux.items()}
    aux64["valid"] = valid  # the rows that count (a sequence's sums count only these)
    y = REFERENCES[function].per_token(z, safe, aux64, params)
    return torch.where(valid, y, torch.zeros_like(y))
