"""A head whose parameter lives in the trainer (RemoteHead's `local_weight`: tied input
embeddings, or a local optimizer that must see every gradient, e.g. for clipping): the server
is a stateless accelerator for it. The parameter is pushed to the server whenever it changed,
and after a backward the accumulated dW is pulled into `local_weight.grad` (then zeroed on the
server).
"""

from __future__ import annotations

from typing import Optional

import torch

from remotehead.client import Client, HeadInfo, InvalidArgumentError


def head_weight(weight: torch.Tensor) -> torch.Tensor:
    """What a model's lm_head weight is uploaded as: float32 (a bf16 / fp16 model's head trains
    in fp32 on the server, its fp32 master copy), float64 for a float64 model (exact
    comparisons against float64 references)."""
    return weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
from remotehead.cluster import Cluster


class LocalWeightMirror:
    """The server's copy of the trainer's parameter `weight`, kept in step with it (None: the
    head is the server's own, trained by server-side optimizer steps; nothing to mirror)."""

    def __init__(self, weight: Optional[torch.nn.Parameter], cluster: Cluster):
        if weight is not None and cluster.distributed:
            # The server's one accumulator holds every rank's dW: a pull would mix them.
            raise InvalidArgumentError(
                f"local_weight: expected none among {cluster.world_size} data-parallel "
                "processes (the head is trained by the server's synchronous optimizer steps; "
                "offload with gradients=\"server\"); got the trainer's lm_head parameter")
        self.weight = weight
        # The weight the server holds: its identity and version counter when pushed, or None
        # after a pull (the optimizer step that follows may change the weights without bumping
        # the version counter: fused AdamW does not).
        self._pushed = self._state()

    def pulls_after_backward(self, accumulate: bool, pull_gradients: bool) -> bool:
        """Whether a call's backward pulls dW into weight.grad."""
        return accumulate and pull_gradients and self.weight is not None

    def _state(self):
        w = self.weight
        return None if w is None else (w.data_ptr(), w._version)

    def push(self, client: Client, head_id: str) -> Optional[HeadInfo]:
        """Uploads the weight as head `head_id` if it may have changed since the last push;
        the head's new HeadInfo, or None where the server's copy is current (or there is no
        weight)."""
        state = self._state()
        if state is None or state == self._pushed:
            return None
        info = client.upload_head(head_id, head_weight(self.weight), replace=True)
        self._pushed = self._state()
        return info

    def pull(self, client: Client, head_id: str) -> bool:
        """Adds head `head_id`'s accumulated dW into weight.grad and zeroes it on the server;
        whether there was any (no micro-batch accumulated since the last pull: nothing done)."""
        w = self.weight
        if w is None:
            raise ValueError("local_weight: expected a parameter to pull dW into; got None "
                             "(this head is trained by server-side optimizer steps)")
        dw, _, info = client.fetch_gradients(head_id)
        if info.accumulated_micro_batches == 0:
            return False
        client.zero_gradients(head_id)
        dw = dw.to(w.device, w.dtype)
        if w.grad is None:
            w.grad = dw
        else:
            w.grad.add_(dw)
        self._pushed = None  # the optimizer step comes next
        return True
