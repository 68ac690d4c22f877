"""What the server says of a head (DescribeHead, and every call that changes one): HeadInfo, and
its reading from the wire. Re-exported by client.py, where it has always been imported from."""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from remotehead import _wire
from remotehead.v1 import head_service_pb2 as pb


@dataclasses.dataclass
class HeadInfo:
    head_id: str
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    has_bias: bool
    device: str
    weight_version: int
    accumulated_micro_batches: int
    incarnation: str = ""  # the server process: a new one after every restart
    state_id: str = ""  # the saved training state last saved or restored ("" if none)
    # A head group: its processes, and each one's (offset, rows) of the vocabulary by rank.
    group_size: int = 1
    shards: Tuple[Tuple[int, int], ...] = ()
    # A frozen head (create_head / upload_head with frozen=True): no dW, no optimizer step; the
    # only kind that may be a distillation teacher. teacher_of: the heads whose steps named it
    # as their teacher (StepOptions.teacher) on this server, sorted.
    frozen: bool = False
    teacher_of: Tuple[str, ...] = ()
    # The dW (and db) accumulators' dtype: float32 (float64 for a float64 head), or the head's
    # own half-precision dtype (the memory mode: create_head / upload_head with grad_dtype).
    grad_dtype: torch.dtype = torch.float32


def head_info(msg: pb.HeadInfo) -> HeadInfo:
    """A HeadInfo message as the client's HeadInfo."""
    return HeadInfo(msg.head_id, msg.vocab_size, msg.hidden_size, _wire._FROM_WIRE[msg.dtype],
                    msg.has_bias, msg.device, msg.weight_version, msg.accumulated_micro_batches,
                    msg.incarnation, msg.state_id, max(1, msg.group_size),
                    tuple((r.offset, r.rows) for r in msg.shards), msg.frozen,
                    tuple(msg.teacher_of), _wire._FROM_WIRE.get(msg.grad_dtype, torch.float32))
