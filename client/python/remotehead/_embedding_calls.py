"""The tied-embedding RPCs' requests and answers (Client.embedding_lookup and
Client.embedding_gradient; the C++ client's Client::EmbeddingLookup / EmbeddingGradient).

A model whose input embedding is its head reads the rows W[ids] of its input ids from the server
(EmbeddingLookup: ids up, the rows streamed back in chunks, then the HeadInfo whose
weight_version the rows are of) and sends their gradient back (EmbeddingGradient: a header with
the ids, the gradient id and the version the lookup read, then the gradient rows in chunks by the
row-chunk rule of every streamed tensor), which the server adds into the head's dW exactly once
per gradient id, apart from the head steps' contributions under the same id.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from remotehead import _wire
from remotehead._errors import InvalidArgumentError
from remotehead.step_options import GradientId
from remotehead.v1 import head_service_pb2 as pb

Ids = Union[torch.Tensor, Sequence[int]]


@dataclasses.dataclass
class EmbeddingGradientResult:
    """What EmbeddingGradient answers: whether the gradient id had been applied already (then
    nothing was added), and the head's state after the call (a HeadInfo)."""

    replayed: bool
    info: object


def id_list(ids: Ids, field: str = "ids") -> List[int]:
    """The token ids as a list for the wire: a 1-D integer tensor (any device) or a sequence of
    ints; InvalidArgumentError naming `field` otherwise. Their range is the server's to check
    (it names the value and its position)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex \
                or ids.dtype == torch.bool:
            raise InvalidArgumentError(f"{field}: expected integer token ids [n]; got a "
                                       f"{ids.dtype} tensor of shape {_wire.shape_text(ids)}")
        return ids.detach().to("cpu", torch.int64).tolist()
    values = list(ids)
    for position, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{field}[{position}]: expected an int token id; got "
                                       f"{value!r}")
    return values


def lookup_request(head_id: str, ids: Ids, dtype: Optional[torch.dtype],
                   expected_incarnation: str,
                   expected_weight_version: Optional[int]) -> pb.EmbeddingLookupRequest:
    request = pb.EmbeddingLookupRequest(head_id=head_id, ids=id_list(ids),
                                        expected_incarnation=expected_incarnation)
    if dtype is not None:
        request.dtype = _wire.wire_dtype(dtype)
    if expected_weight_version is not None:
        request.expected_weight_version = expected_weight_version
    return request


def lookup_rows(pieces, count: int, info, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The streamed row chunks (offset, tensor) as one [count, D] tensor (empty for no ids)."""
    rows = (torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]) if pieces
            else torch.empty(0, info.hidden_size, dtype=dtype or info.dtype))
    if rows.shape[0] != count:
        raise RuntimeError(f"EmbeddingLookup: expected {count} rows (one per id); the server "
                           f"streamed {rows.shape[0]}")
    return rows


def _gradient_id(value) -> GradientId:
    if value is None:
        raise InvalidArgumentError("gradient_id: expected the contribution's identity "
                                   "(trainer, step, micro_batch); got none")
    gid = GradientId(*value)
    if not gid.trainer:
        raise InvalidArgumentError("gradient_id.trainer: expected the trainer's identity; got "
                                   "an empty one")
    return gid


def gradient_messages(head_id: str, ids: Ids, grad: torch.Tensor, gradient_id,
                      expected_incarnation: str, expected_weight_version: Optional[int],
                      chunk_bytes: int):
    """A function giving the request stream of one EmbeddingGradient attempt (every attempt
    sends the same messages, under the same gradient id). The gradient is checked here, before
    anything travels: a gradient for rows the call did not read (another row count) is an
    InvalidArgumentError naming `grad`; its width is the server's to check (`grad_rows`)."""
    id_values = id_list(ids)
    if not isinstance(grad, torch.Tensor) or grad.dim() != 2 \
            or grad.shape[0] != len(id_values) or not grad.dtype.is_floating_point:
        got = (f"a {grad.dtype} tensor of shape {_wire.shape_text(grad)}"
               if isinstance(grad, torch.Tensor) else type(grad).__name__)
        raise InvalidArgumentError(f"grad: expected a floating [{len(id_values)}, D] tensor "
                                   f"(one row per id); got {got}")
    gid = _gradient_id(gradient_id)
    header = pb.EmbeddingGradientRequest()
    h = header.header
    h.head_id = head_id
    h.ids.extend(id_values)
    h.gradient_id.trainer, h.gradient_id.step, h.gradient_id.micro_batch = gid
    h.expected_incarnation = expected_incarnation
    if expected_weight_version is not None:
        h.expected_weight_version = expected_weight_version
    rows = _wire.to_wire_layout(grad)
    chunks: List[Tuple[int, int]] = _wire.plan_row_chunks(
        rows.shape[0], rows.shape[1] * rows.element_size(), _wire.framing_bytes(1, 0),
        chunk_bytes) if rows.shape[0] else []

    def messages() -> Iterator[pb.EmbeddingGradientRequest]:
        yield header
        for offset, n in chunks:
            m = pb.EmbeddingGradientRequest()
            m.grad_rows.row_offset = offset
            _wire.encode(rows[offset:offset + n], m.grad_rows.values)
            yield m

    return messages
