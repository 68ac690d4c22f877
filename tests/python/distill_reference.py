"""The distillation functions' references: plain PyTorch autograd over the full [N, V] logits of
both heads, written from the definitions in docs/distillation.md (and TRL's
trl.trainer.distillation_trainer._chunked_divergence_loss, which the two-head divergences
equal), in float64.

- `transform`: the common parameters on one side's logits, in the server's order: z · scale,
  then softcap·tanh(z / softcap) when softcap > 0, then z / temperature.
- `divergence`: the per-token divergence of the student's distribution from the teacher's:
  "distill_kl" KL(p_t ‖ p_s), "distill_reverse_kl" KL(p_s ‖ p_t), "distill_jsd" TRL's
  generalized JSD (beta 0: forward KL, 1: reverse KL, else β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m),
  m = (1 − β)·p_s + β·p_t).
- `sparse_divergence`: "distill_topk_kl" / "distill_topk_reverse_kl" against a teacher's top-k
  log-probabilities: tail 0 compares the (k + 1)-bucket coarsenings of both distributions (the
  k ids, and the rest of each one's mass as one bucket), tail 1 both renormalised over the k ids.
- `per_token`: (1 − α)·divergence + α·CE(student logits at temperature 1, targets), 0 on rows
  whose target is ignore_index; `extras`: the sums the server reports in StepSummary.extras.
- `reduce`: none / sum / mean / weighted_sum, with a normalizer.
"""

from typing import Dict, Mapping, Optional, Tuple

import torch

TWO_HEAD = ("distill_kl", "distill_reverse_kl", "distill_jsd")
SPARSE = ("distill_topk_kl", "distill_topk_reverse_kl")


def transform(z: torch.Tensor, scale: float = 1.0, softcap: float = 0.0,
              temperature: float = 1.0) -> torch.Tensor:
    z = z * scale
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def logits(hidden: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    z = hidden.to(torch.float64) @ weight.to(torch.float64).t()
    return z if bias is None else z + bias.to(torch.float64)


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row of two log-probability rows [n, V]."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def divergence(function: str, zs: torch.Tensor, zt: torch.Tensor, beta: float = 0.5):
    """Per-token divergence [n] of a two-head function from both transformed logits."""
    log_ps, log_pt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if function == "distill_kl":
        beta = 0.0
    elif function == "distill_reverse_kl":
        beta = 1.0
    if beta == 0.0:
        return kl(log_pt, log_ps)
    if beta == 1.0:
        return kl(log_ps, log_pt)
    log_m = torch.logaddexp(log_ps + torch.log1p(torch.tensor(-beta, dtype=zs.dtype)),
                            log_pt + torch.log(torch.tensor(beta, dtype=zs.dtype)))
    return beta * kl(log_pt, log_m) + (1 - beta) * kl(log_ps, log_m)


def sparse_divergence(function: str, zs: torch.Tensor, ids: torch.Tensor,
                      teacher_logprobs: torch.Tensor, tail: float = 0.0) -> torch.Tensor:
    """Per-token divergence [n] of a sparse function: the student's log-probabilities of the
    teacher's top-k ids against the teacher's, with the tail as one bucket or renormalised."""
    student = torch.log_softmax(zs, -1).gather(1, ids.long())
    teacher = teacher_logprobs.to(torch.float64)
    if tail != 0:
        student = student - torch.logsumexp(student, 1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, 1, keepdim=True)
    else:
        student_tail = 1 - student.exp().sum(1, keepdim=True)
        teacher_tail = 1 - teacher.exp().sum(1, keepdim=True)
        student = torch.cat([student, student_tail.log()], 1)
        teacher = torch.cat([teacher, teacher_tail.log()], 1)
    if function == "distill_topk_kl":
        return kl(teacher, student)
    return kl(student, teacher)


def per_token(function: str, params: Mapping[str, float], student_z: torch.Tensor,
              teacher_z: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None,
              aux: Optional[Mapping[str, torch.Tensor]] = None, ignore_index: int = -100
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(y [n], per-token extras) of `function` from the raw logits of the student [n, V] (and
    the teacher's, two-head functions), 0 on ignored rows. `params`: the call's (absent ones
    take the server's defaults)."""
    p = {"logit_scale": 1.0, "softcap": 0.0, "temperature": 1.0, "teacher_logit_scale": 1.0,
         "teacher_softcap": 0.0, "alpha": 0.0, "beta": 0.5, "tail": 0.0, **params}
    n = student_z.shape[0]
    valid = torch.ones(n, dtype=torch.bool)
    safe = torch.zeros(n, dtype=torch.long)
    if targets is not None:
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    untempered = transform(student_z, p["logit_scale"], p["softcap"])
    zs = untempered / p["temperature"]
    if function in TWO_HEAD:
        zt = transform(teacher_z, p["teacher_logit_scale"], p["teacher_softcap"],
                       p["temperature"])
        div = divergence(function, zs, zt, p["beta"])
    else:
        div = sparse_divergence(function, zs, aux["teacher_topk_ids"],
                                aux["teacher_topk_logprobs"], p["tail"])
    y = div
    extras = {"divergence": div.detach()}
    if p["alpha"] > 0:
        nll = -torch.log_softmax(untempered, -1).gather(1, safe[:, None])[:, 0]
        y = (1 - p["alpha"]) * div + p["alpha"] * nll
        extras["nll"] = nll.detach()
    with torch.no_grad():
        log_ps = torch.log_softmax(zs, -1)
        extras["entropy"] = -(log_ps.exp() * log_ps).sum(-1)
    zero = torch.zeros_like(y)
    y = torch.where(valid, y, zero)
    extras = {k: torch.where(valid, v, torch.zeros_like(v)) for k, v in extras.items()}
    return y, extras


def reduce(y: torch.Tensor, reduction: str, valid_count: int,
           weights: Optional[torch.Tensor] = None,
           normalizer: Optional[float] = None) -> torch.Tensor:
    """The server's reductions of per-token outputs (0 on ignored rows): the sum (weighted with
    weighted_sum), divided by the normalizer when given, else by the valid count for mean."""
    if reduction == "none":
        return y
    total = (y * weights.to(y.dtype)).sum() if reduction == "weighted_sum" else y.sum()
    if normalizer is not None:
        return total / normalizer
    if reduction == "mean":
        return total / max(valid_count, 1)
    return total


def trl_loss(student_hidden, teacher_hidden, student_weight, teacher_weight, mask, beta,
             num_items_in_batch=None, student_bias=None, teacher_bias=None, student_scale=1.0,
             teacher_scale=1.0, student_softcap=None, teacher_softcap=None, temperature=1.0):
    """TRL's _chunked_divergence_loss, in float64 over full logits (what the server's two-head
    functions compute): (loss, entropy sum, valid count) — the formula its docstring gives."""
    zs = logits(student_hidden.reshape(-1, student_hidden.shape[-1]), student_weight,
                student_bias)
    zt = logits(teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), teacher_weight,
                teacher_bias)
    zs = transform(zs, student_scale, student_softcap or 0.0, temperature)
    zt = transform(zt, teacher_scale, teacher_softcap or 0.0, temperature)
    valid = mask.reshape(-1) != 0
    div = divergence("distill_jsd", zs, zt, beta)[valid]
    log_ps = torch.log_softmax(zs, -1)[valid]
    entropy = -(log_ps.exp() * log_ps).sum()
    n = valid.sum()
    loss = div.sum() / (n.clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    return loss, entropy, n
