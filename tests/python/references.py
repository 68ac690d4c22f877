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


def token_logprobs(z, t, aux, p):
    return _logprobs(z, t)


def entropy(z, t, aux, p):
    return -(torch.softmax(z, 1) * torch.log_softmax(z, 1)).sum(1)


def grpo(z, t, aux, p):
    """As TRL's GRPOTrainer._compute_loss writes it: the clipped ratio to the sampling policy
    (old_logprobs; without them, the current one, detached), plus beta · the k3 KL to the
    reference policy (times the ratio with bias_correction_kl)."""
    logp = _logprobs(z, t)
    old = aux["old_logprobs"] if "old_logprobs" in aux else logp.detach()
    adv = aux["advantages"]
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - p["epsilon_low"], 1 + p["epsilon_high"])
    loss = -torch.min(ratio * adv, clipped * adv)
    if p["beta"] != 0:
        ref = aux["ref_logprobs"]
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if p["bias_correction_kl"] != 0:
            kl = kl * ratio
        loss = loss + p["beta"] * kl
    return loss


def mse_onehot(z, t, aux, p):
    return ((z - F.one_hot(t, z.shape[1]).to(z.dtype)) ** 2).mean(1)  # nn.MSELoss per token


def sigmoid_sum(z, t, aux, p):
    return torch.sigmoid(z).sum(1)


REFERENCES: Dict[str, Reference] = {
    "cross_entropy": Reference(cross_entropy, {"label_smoothing": 0.1, "z_loss": 1e-3}),
    "token_logprobs": Reference(token_logprobs),
    "entropy": Reference(entropy),
    "grpo": Reference(grpo, {"epsilon_low": 0.1, "epsilon_high": 0.28, "beta": 0.04,
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
    aux64 = {name: t.to(torch.float64) for name, t in aux.items()}
    y = REFERENCES[function].per_token(z, safe, aux64, params)
    return torch.where(valid, y, torch.zeros_like(y))
