"""RemoteHead: the server's head as a differentiable function of the hidden states.

The fused path does the whole LM-head step in one round trip during the forward: the server
returns the loss and dX (and accumulates dW); backward() then only scales the saved dX. The
server's dW corresponds to the upstream gradient declared up front (`upstream_scale`, 1 by
default): while dW is accumulated, a backward with another dL/dloss is refused rather than
leaving dW inconsistent with dX.

Where the head's parameter lives in the trainer (`local_weight`: tied input embeddings, or a
local optimizer that must see every gradient, e.g. for clipping), the server is a stateless
accelerator for it: the parameter is pushed to the server whenever it changed, and after a
backward the accumulated dW is pulled into `local_weight.grad` (then zeroed on the server).
"""

from __future__ import annotations

import uuid
from typing import Optional

import grpc
import torch

from remotehead.client import Client, RemoteheadError, StepResult


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, head, spec, pull):
        result = head.client.forward_backward(head.head_id, hidden, targets, **spec)
        head.last_result = result
        ctx.save_for_backward(result.grad_hidden.to(hidden.device, hidden.dtype)
                              .reshape(hidden.shape))
        ctx.upstream_scale = spec.get("upstream_scale", 1.0)
        ctx.accumulated = spec.get("accumulate", True)
        ctx.head, ctx.pull = head, pull
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
        if ctx.pull:
            ctx.head.pull_gradients()
        # dX is linear in the upstream scalar: the server computed it for `scale`.
        return grad_hidden * (grad_loss / scale), None, None, None, None


class _TwoPhaseOutputs(torch.autograd.Function):
    """Per-token outputs now (a Forward that keeps its rows on the server), dL/dy later (a
    Backward by handle: only dL/dy travels; X is re-sent if the handle has expired)."""

    @staticmethod
    def forward(ctx, hidden, targets, head, spec, pull):
        result = head.client.forward(head.head_id, hidden, targets, reduction="none",
                                     retain_inputs_seconds=head.retain_seconds,
                                     **{k: v for k, v in spec.items()
                                        if k not in ("accumulate", "gradient_id")})
        ctx.head, ctx.spec, ctx.targets, ctx.pull = head, spec, targets, pull
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
        if ctx.pull:
            head.pull_gradients()
        return result.grad_hidden.to(hidden.device, hidden.dtype).reshape(hidden.shape), None, \
            None, None, None


class RemoteHead:
    """The LM head `head_id` on a server, used as `loss = head.loss(hidden, labels)`.

    Each call is one micro-batch of gradient identity (trainer, step, micro_batch): replays
    (client retries) are recognised by the server and not added twice. `next_step()` (called by
    `optimizer_step()`) moves to the next step.
    """

    def __init__(self, client: Client, head_id: str, *, trainer: Optional[str] = None,
                 accumulate: bool = True, local_weight: Optional[torch.nn.Parameter] = None,
                 **spec):
        self.client = client
        self.head_id = head_id
        self.trainer = trainer or f"py-{uuid.uuid4().hex[:12]}"
        self.accumulate = accumulate
        self.local_weight = local_weight
        self.spec = spec  # defaults for every call (function, params, normalizer, ...)
        self.step = 0
        self.micro_batch = 0
        self.last_result: Optional[StepResult] = None
        self.retain_seconds = 600.0  # how long a two-phase Forward's rows wait for the Backward
        # The local_weight the server holds: its identity and version counter when pushed, or
        # None after a pull (the optimizer step that follows may change the weights without
        # bumping the version counter: fused AdamW does not).
        self._pushed = self._local_state()

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, *, pull_gradients: bool = True,
             **spec) -> torch.Tensor:
        """The reduced loss of the head's function over `hidden` [..., D] and `labels` [...].
        With a local_weight, pull_gradients=False defers the pull of dW into local_weight.grad
        (e.g. until the last micro-batch of a gradient-accumulation window)."""
        self.push_weights()
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
        return _FusedHeadLoss.apply(hidden, labels, self, call,
                                    self._pulls_after_backward(accumulate, pull_gradients))

    def token_outputs(self, hidden: torch.Tensor, targets: torch.Tensor, *,
                      pull_gradients: bool = True, **spec) -> torch.Tensor:
        """Per-token outputs of the head's function ([...] like targets), e.g.
        function="token_logprobs", differentiable on the two-phase path: the trainer combines
        them as it likes and backward() sends dL/dy to the server (dW accumulated there)."""
        self.push_weights()
        call = {**self.spec, **spec}
        accumulate = call.pop("accumulate", self.accumulate)
        call.pop("reduction", None)
        call["accumulate"] = accumulate
        if accumulate:
            call["gradient_id"] = (self.trainer, self.step, self.micro_batch)
            self.micro_batch += 1
        return _TwoPhaseOutputs.apply(hidden, targets, self, call,
                                      self._pulls_after_backward(accumulate, pull_gradients))

    def next_step(self) -> None:
        self.step += 1
        self.micro_batch = 0

    def optimizer_step(self, **optimizer) -> None:
        """A server-side optimizer step on the accumulated dW (then zeroed), e.g.
        optimizer_step(adamw=dict(lr=1e-3, weight_decay=0.0))."""
        optimizer.setdefault("zero_gradients", True)
        self.client.optimizer_step(self.head_id, **optimizer)
        self.next_step()

    # ----- a head whose parameter lives in the trainer (local_weight) -----

    def _pulls_after_backward(self, accumulate: bool, pull_gradients: bool) -> bool:
        """Whether this call's backward pulls dW into local_weight.grad."""
        return accumulate and pull_gradients and self.local_weight is not None

    def _local_state(self):
        w = self.local_weight
        return None if w is None else (w.data_ptr(), w._version)

    def push_weights(self) -> None:
        """Sends local_weight to the server if it may have changed since the last push (a pull
        of its gradient, hence an optimizer step; an in-place edit): the server then computes
        with exactly the trainer's parameter."""
        state = self._local_state()
        if state is None or state == self._pushed:
            return
        self.client.upload_head(self.head_id, self.local_weight.detach().float(), replace=True)
        self._pushed = self._local_state()

    def pull_gradients(self) -> None:
        """Adds the server's accumulated dW into local_weight.grad and zeroes it on the server,
        so the local optimizer (and gradient clipping) sees the head's gradient like any other.
        """
        w = self.local_weight
        if w is None:
            raise ValueError("local_weight: expected a parameter to pull dW into; got None "
                             "(this head is trained by server-side optimizer steps)")
        dw, _, info = self.client.fetch_gradients(self.head_id)
        if info.accumulated_micro_batches == 0:
            return
        self.client.zero_gradients(self.head_id)
        dw = dw.to(w.device, w.dtype)
        if w.grad is None:
            w.grad = dw
        else:
            w.grad.add_(dw)
        self._pushed = None  # the optimizer step comes next
        self.next_step()
