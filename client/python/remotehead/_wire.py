"""remotehead.v1.Tensor <-> torch.Tensor, and the row-chunk plan of a streamed tensor.

The twin of the C++ client's client/cpp/src/wire.cc: the same dtypes, little-endian bytes in
row-major order, and the same row-chunk rule (tests/data/wire_vectors.json pins the bytes).
"""

from typing import List, Optional, Tuple

import torch

from remotehead._errors import InvalidArgumentError
from remotehead.v1 import head_service_pb2 as pb

_TO_WIRE = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.float64: pb.DTYPE_FLOAT64,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
}
_FROM_WIRE = {wire: dtype for dtype, wire in _TO_WIRE.items()}


def wire_dtype(dtype: torch.dtype, field: str = "dtype") -> int:
    """The wire DType of `dtype`; InvalidArgumentError (a ValueError) naming `field` for one
    the wire cannot carry."""
    if dtype not in _TO_WIRE:
        raise InvalidArgumentError(f"{field}: expected float32, bfloat16, float16, float64, "
                                   f"int64 or int32; got {dtype}")
    return _TO_WIRE[dtype]


def to_wire_layout(tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The CPU, contiguous version of `tensor` in `dtype` (default: its own): one copy at most,
    none when it already is one."""
    return tensor.detach().to("cpu", dtype if dtype is not None else tensor.dtype).contiguous()


def encode(tensor: torch.Tensor, out: pb.Tensor) -> None:
    """Writes `tensor` (any device) into `out` as little-endian bytes with dtype and shape."""
    t = to_wire_layout(tensor)
    out.dtype = wire_dtype(t.dtype)
    out.shape[:] = list(t.shape)
    out.data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def decode(msg: pb.Tensor) -> torch.Tensor:
    """A new CPU tensor holding the bytes of `msg`."""
    dtype = _FROM_WIRE.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"dtype: unknown wire dtype {msg.dtype}")
    shape = tuple(msg.shape)
    if not msg.data:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def shape_text(t: torch.Tensor) -> str:
    return str(list(t.shape))  # "[2, 3]", as the C++ client's c10::str(sizes)


# Protobuf framing of one request message beyond its tensor bytes (tags, lengths, dtype and
# shape fields, map keys); generous, so that chunk_bytes bounds the whole message. The C++
# client's FramingBytes: both clients must plan the same row messages.
def framing_bytes(tensors: int, name_bytes: int) -> int:
    return 64 + 64 * tensors + name_bytes


def plan_row_chunks(rows: int, bytes_per_row: int, overhead_bytes: int,
                    max_message_bytes: int) -> List[Tuple[int, int]]:
    """[offset, count) pieces whose messages stay within `max_message_bytes` once
    `overhead_bytes` of framing are added (the C++ client's PlanRowChunks).
    InvalidArgumentError naming chunk_bytes when one row alone does not fit."""
    room = max_message_bytes - overhead_bytes
    if bytes_per_row > room:
        raise InvalidArgumentError(
            f"chunk_bytes: expected room for at least one row ({bytes_per_row} bytes + "
            f"{overhead_bytes} bytes of framing); got {max_message_bytes}")
    per_chunk = max(1, room // max(bytes_per_row, 1))
    return [(offset, min(per_chunk, rows - offset)) for offset in range(0, rows, per_chunk)]
