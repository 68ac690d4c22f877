"""remotehead.v1.Tensor <-> torch.Tensor, and the row-chunk plan of a streamed tensor."""

import torch

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


def wire_dtype(dtype: torch.dtype) -> int:
    if dtype not in _TO_WIRE:
        raise ValueError(f"dtype: expected one of {list(_TO_WIRE)}; got {dtype}")
    return _TO_WIRE[dtype]


def encode(tensor: torch.Tensor, out: pb.Tensor) -> None:
    """Writes `tensor` (any device) into `out` as little-endian bytes with dtype and shape."""
    t = tensor.detach().to("cpu").contiguous()
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


def row_chunks(rows: int, bytes_per_row: int, chunk_bytes: int):
    """[offset, count) pieces of at most `chunk_bytes` (at least one row each)."""
    per_chunk = max(1, chunk_bytes // max(bytes_per_row, 1))
    return [(offset, min(per_chunk, rows - offset)) for offset in range(0, rows, per_chunk)]
