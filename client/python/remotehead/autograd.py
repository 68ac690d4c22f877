"""RemoteHead: the server's head as a differentiable function of the hidden states.

The fused path does the whole LM-head step in one round trip during the forward: the server
returns the loss and dX (and accumulates dW); backward() then only scales the saved dX. The
server's dW corresponds to the upstream gradient declared up front (`upstream_scale`, 1 by
default): while dW is accumulated, a backward with another dL/dloss is refused rather than
leaving dW inconsistent with dX.
"""

from __future__ import annotations

import uuid
from typing import Optional

import grpc
import torch

from remotehead.client import Client, RemoteheadError, StepResult


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, head, spec):
        result = head.client.forward_backward(head.head_id, hidden, targets, **spec)
        head.last_result = result
        ctx.save_for_backward(result.grad_hidden.to(hidden.device, hidden.dtype)
                              .reshape(hidden.shape))
        ctx.upstream_scale = spec.get("upstream_scale", 1.0)
        ctx.accumulated = spec.get("accumulate", True)
        return hidden.new_tensor(result.loss)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_hidden,) = ctx.saved_tensors
        scale = ctx.upstream_scale
        if ctx.accumulated and abs(float(grad_loss) - scale) > 1e-6 * max(1.0, abs(scale)):
            raise RuntimeError(
                f"upstream gradient: expected dL/dloss = upstream_scale ({scale}), which the "
                f"server's dW was accumulated with; got {float(grad_loss)}. Pass the loss scale "
                f"as upstream_scale (or accumulate=False for a frozen head)")
        # dX is linear in the upstream scalar: the server computed it for `scale`.
        return grad_hidden * (grad_loss / scale), None, None, None


class _TwoPhaseOutputs(torch.autograd.Function):
    """Per-token outputs now (a Forward that keeps its rows on the server), dL/dy later (a
    Backward by handle: only dL/dy travels; X is re-sent if the handle has expired)."""

    @staticmethod
    def forward(ctx, hidden, targets, head, spec):
        result = head.client.forward(head.head_id, hidden, targets, reduction="none",
                                     retain_inputs_seconds=head.retain_seconds,
                                     **{k: v for k, v in spec.items()
                                        if k not in ("accumulate", "gradient_id")})
        ctx.head, ctx.spec, ctx.targets = head, spec, targets
        ctx.handle = result.summary.inputs_handle
        ctx.save_for_backward(hidden)
        return result.outputs.to(hidden.device).reshape(hidden.shape[:-1])

    @staticmethod
    def backward(ctx, grad_outputs):
        (hidden,) = ctx.saved_tensors
        head, spec = ctx.head, ctx.spec
        grad = grad_outputs.detach().float().reshape(-1)
        try:
            result = head.client.backward(head.head_id, hidden, ctx.targets, grad,
                                          inputs_handle=ctx.handle, **spec)
        except RemoteheadError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            result = head.client.backward(head.head_id, hidden, ctx.targets, grad, **spec)
        return result.grad_hidden.to(hidden.device, hidden.dtype).reshape(hidden.shape), None, \
            None, None


class RemoteHead:
    """The LM head `head_id` on a server, used as `loss = head.loss(hidden, labels)`.

    Each call is one micro-batch of gradient identity (trainer, step, micro_batch): replays
    (client retries) are recognised by the server and not added twice. `next_step()` (called by
    `optimizer_step()`) moves to the next step.
    """

    def __init__(self, client: Client, head_id: str, *, trainer: Optional[str] = None,
                 accumulate: bool = True, **spec):
        self.client = client
        self.head_id = head_id
        self.trainer = trainer or f"py-{uuid.uuid4().hex[:12]}"
        self.accumulate = accumulate
        self.spec = spec  # defaults for every call (function, params, normalizer, ...)
        self.step = 0
        self.micro_batch = 0
        self.last_result: Optional[StepResult] = None
        self.retain_seconds = 600.0  # how long a two-phase Forward's rows wait for the Backward

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, **spec) -> torch.Tensor:
        """The reduced loss of the head's function over `hidden` [..., D] and `labels` [...]."""
        call = {**self.spec, **spec}
        accumulate = call.pop("accumulate", self.accumulate)
        if not torch.is_grad_enabled() or not hidden.requires_grad:
            # Evaluation: a Forward, nothing accumulated.
            call.setdefault("reduction", "mean")
            result = self.client.forward(self.head_id, hidden, labels, **call)
            self.last_result = result
            return hidden.new_tensor(result.loss)
        call["accumulate"] = accumulate
        if accumulate:
            call["gradient_id"] = (self.trainer, self.step, self.micro_batch)
            self.micro_batch += 1
        return _FusedHeadLoss.apply(hidden, labels, self, call)

    def token_outputs(self, hidden: torch.Tensor, targets: torch.Tensor, **spec) -> torch.Tensor:
        """Per-token outputs of the head's function ([...] like targets), e.g.
        function="token_logprobs", differentiable on the two-phase path: the trainer combines
        them as it likes and backward() sends dL/dy to the server (dW accumulated there)."""
        call = {**self.spec, **spec}
        accumulate = call.pop("accumulate", self.accumulate)
        call.pop("reduction", None)
        call["accumulate"] = accumulate
        if accumulate:
            call["gradient_id"] = (self.trainer, self.step, self.micro_batch)
            self.micro_batch += 1
        return _TwoPhaseOutputs.apply(hidden, targets, self, call)

    def next_step(self) -> None:
        self.step += 1
        self.micro_batch = 0

    def optimizer_step(self, **optimizer) -> None:
        """A server-side optimizer step on the accumulated dW (then zeroed), e.g.
        optimizer_step(adamw=dict(lr=1e-3, weight_decay=0.0))."""
        optimizer.setdefault("zero_gradients", True)
        self.client.optimizer_step(self.head_id, **optimizer)
        self.next_step()
