"""RemoteEmbedding: a tied input embedding served by the server, as a differentiable module.

A model whose input embedding is its head (Gemma, Llama 3.2, Qwen) keeps no [V, D] matrix: the
forward sends the distinct ids of its input (torch.unique) and gets their rows of the head's W
back (Client.embedding_lookup, in the body's dtype); the backward sums the gradient of each
distinct id in fp32, leaves out padding_idx (nn.Embedding's rule: its row gets no gradient) and
sends the rest (Client.embedding_gradient), which the server adds into the head's dW — one
parameter, one accumulator, one optimizer step, as autograd does with a local tied matrix.

Identity and version: the gradient carries the gradient id of the micro-batch it belongs to,
the one the head step of the same micro-batch carries (StepState.embedding_gradient_id; the
server keeps the two apart and counts the micro-batch once), so a retried or replayed gradient
adds nothing; and it is pinned to the weight version the lookup read (the server refuses it,
FAILED_PRECONDITION, once an optimizer step moved the head on). Among data-parallel processes
each rank sends under its own trainer identity, and the synchronous optimizer step applies the
sum once (× 1/W, as DDP averages gradients).
"""

from __future__ import annotations

from typing import Optional

import torch

from remotehead.autograd import RemoteHead
from remotehead.client import InvalidArgumentError


class _Rows(torch.autograd.Function):
    """rows [U, D] (the distinct ids' rows) -> rows[inverse] [N, D]; backward sends the fp32
    sums per distinct id to the server and gives `rows` no gradient of its own."""

    @staticmethod
    def forward(ctx, rows, inverse, send):
        ctx.save_for_backward(inverse)
        ctx.unique_rows, ctx.send = rows.shape[0], send
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        sums = torch.zeros(ctx.unique_rows, grad.shape[-1], dtype=torch.float32,
                           device=grad.device)
        sums.index_add_(0, inverse, grad.reshape(-1, grad.shape[-1]).float())
        ctx.send(sums)
        return None, None, None


class RemoteEmbedding(torch.nn.Module):
    """The input embedding of a model whose embedding matrix is the head `head` (a RemoteHead,
    e.g. offload_lm_head's OffloadedHead): `forward(input_ids)` gives [..., D] rows of the
    server's W, in `dtype` (default the head's; a model's body dtype), times `embed_scale` (a
    scalar tensor, e.g. Gemma's √hidden, applied as Gemma's embedding does: after a cast to
    `dtype`). `padding_idx`: that id's rows get no gradient, as in torch.nn.Embedding.

    With gradients enabled and a trainable head (head.accumulate), the backward adds the rows'
    gradient into the head's dW on the server (see the module's documentation); under no_grad,
    or for a frozen head, it is a lookup only. Holds no [V, D] tensor: per call, the distinct
    ids' rows [U, D] and the output."""

    def __init__(self, head: RemoteHead, *, padding_idx: Optional[int] = None,
                 embed_scale: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
                 device=None):
        super().__init__()
        info = head.info
        self.head = head
        self.num_embeddings, self.embedding_dim = info.vocab_size, info.hidden_size
        if padding_idx is not None:
            if not -info.vocab_size <= padding_idx < info.vocab_size:
                raise InvalidArgumentError(f"padding_idx: expected an id in [-{info.vocab_size}, "
                                           f"{info.vocab_size}); got {padding_idx}")
            padding_idx %= info.vocab_size
        self.padding_idx = padding_idx
        # nn.Embedding's attributes that code reading an input embedding may look at.
        self.max_norm, self.norm_type = None, 2.0
        self.scale_grad_by_freq = self.sparse = False
        # The rows' dtype and device follow the module's .to() / .half() / .cuda() as a
        # parameter would: a 0-element buffer that Module._apply converts.
        self.register_buffer("_like", torch.empty(0, dtype=dtype or info.dtype, device=device),
                             persistent=False)
        if embed_scale is not None:
            self.register_buffer("embed_scale", torch.as_tensor(embed_scale).detach().clone(),
                                 persistent=False)
        else:
            self.embed_scale = None
        self.last_weight_version: Optional[int] = None  # the version of the last lookup's rows

    @property
    def dtype(self) -> torch.dtype:
        return self._like.dtype

    @property
    def trainable(self) -> bool:
        return self.head.accumulate

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, head={self.head.head_id!r}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point \
                or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids)
            raise InvalidArgumentError(f"input_ids: expected an integer tensor; got {got}")
        bad = (input_ids < 0) | (input_ids >= self.num_embeddings)
        if bool(bad.any()):
            position = tuple(int(i) for i in bad.nonzero()[0])
            raise InvalidArgumentError(
                f"input_ids: expected token ids in [0, {self.num_embeddings}) (the vocabulary of "
                f"head {self.head.head_id!r}); got {int(input_ids[position])} at position "
                f"{list(position)}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(input_ids)
        head = self.head
        unique, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        gradients = torch.is_grad_enabled() and self.trainable
        # Taken before the head's step of this micro-batch, which then carries the same id.
        gradient_id = head._state.embedding_gradient_id() if gradients else None
        rows, version = head._resilient(lambda: head.client.embedding_lookup(
            head.head_id, unique, dtype=self.dtype, expected_incarnation=head.incarnation))
        self.last_weight_version = version
        device = self._like.device
        rows, inverse = rows.to(device), inverse.to(device)
        if gradients:
            keep = (unique != self.padding_idx) if self.padding_idx is not None else None

            def send(sums: torch.Tensor) -> None:
                ids = unique if keep is None else unique[keep.to(unique.device)]
                if keep is not None:
                    sums = sums[keep.to(sums.device)]
                if ids.numel():
                    head._resilient(lambda: head.client.embedding_gradient(
                        head.head_id, ids, sums, gradient_id=gradient_id,
                        expected_incarnation=head.incarnation, expected_weight_version=version))
                    head._journal_embedding(ids, sums, gradient_id, version)

            out = _Rows.apply(rows.requires_grad_(), inverse, send)
        else:
            out = rows.index_select(0, inverse)
        out = out.reshape(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out
