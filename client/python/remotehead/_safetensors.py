"""The .safetensors file format, as much of it as writing a head's weights needs: one tensor
written row chunk by row chunk as a server streams it (never held whole) into a file that
appears whole or not at all, and a file's header read without its data.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a
JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
padded with spaces to a multiple of 8, then the tensors' little-endian bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Callable, Iterable, Tuple

import grpc
import torch

from remotehead import _wire
from remotehead._errors import RemoteheadError

# The format caps headers at 100 MB (safetensors' MAX_HEADER_SIZE).
_MAX_HEADER_BYTES = 100_000_000

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}


def write_file(path: str, name: str, dtype: torch.dtype, shape: Tuple[int, int],
               stream: Callable[[Callable[[Iterable], int]], int]) -> int:
    """Writes the tensor `name` [rows, columns] of `dtype` into a new file `path` from the row
    chunks of a stream (write_rows): to `path`.tmp, then renamed, so that `path` never holds
    part of it; a failed write removes `path`.tmp. `stream(read)` hands each attempt's chunks to
    `read` (Client.read_weight_rows: again from the first row after UNAVAILABLE). Returns the
    bytes written."""
    partial = f"{path}.tmp"

    def read(chunks: Iterable) -> int:
        # Every attempt writes the file from its start: a failed one may have written rows.
        return write_rows(partial, name, dtype, shape, chunks)

    try:
        written = stream(read)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        raise
    os.replace(partial, path)
    return written


def write_rows(path: str, name: str, dtype: torch.dtype, shape: Tuple[int, int],
               chunks: Iterable) -> int:
    """Writes the tensor `name` [rows, columns] of `dtype` to a new file `path` from its row
    chunks (remotehead.v1.TensorChunk messages, in order), copying each chunk's bytes straight
    to the file. A chunk out of order, of another dtype or shape, or rows missing at the end is
    a broken server stream: INTERNAL naming the field. Returns the file's size."""
    rows, columns = shape
    row_bytes = columns * torch.empty((), dtype=dtype).element_size()
    header = json.dumps({"__metadata__": {"format": "pt"}, name: {
        "dtype": _DTYPES[dtype], "shape": [rows, columns],
        "data_offsets": [0, rows * row_bytes]}}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    wire = _wire.wire_dtype(dtype)
    next_row = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for chunk in chunks:
            values = chunk.values
            count = values.shape[0] if values.shape else -1
            if (chunk.row_offset != next_row or values.dtype != wire or count < 0
                    or list(values.shape[1:]) != [columns] or next_row + count > rows
                    or len(values.data) != count * row_bytes):
                raise RemoteheadError(
                    grpc.StatusCode.INTERNAL,
                    f"weight_rows: expected rows from {next_row} shaped [rows, {columns}] of "
                    f"{dtype} within {rows} rows; the server sent {list(values.shape)} at row "
                    f"{chunk.row_offset}")
            f.write(values.data)
            next_row += count
        if next_row != rows:
            raise RemoteheadError(grpc.StatusCode.INTERNAL,
                                  f"weight_rows: expected {rows} rows; the server sent {next_row}")
        return f.tell()


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name of a torch dtype ("F32", "BF16", ...)."""
    return _DTYPES[dtype]


def read_header(path: str) -> dict:
    """The JSON header of a .safetensors file (its tensors' names, dtypes, shapes, offsets),
    without reading their data."""
    with open(path, "rb") as f:
        return _header(f)[1]


def read_complete_header(path: str) -> dict:
    """read_header, after checking that the file is whole: exactly the bytes its header
    describes (a file cut short by a crash, or with bytes after its data, is refused with a
    ValueError saying how long it should be)."""
    with open(path, "rb") as f:
        length, header = _header(f)
        size = os.fstat(f.fileno()).st_size
    data = max((entry["data_offsets"][1] for key, entry in header.items()
                if key != "__metadata__"), default=0)
    if size != 8 + length + data:
        raise ValueError(f"expected {8 + length + data} bytes (an 8-byte length, a {length}-byte "
                         f"header and {data} bytes of data); got {size}")
    return header


def _header(f) -> Tuple[int, dict]:
    """(header length, header) of the file open at its start; ValueError for a file too short
    to hold its header or a header that is not a JSON object."""
    prefix = f.read(8)
    if len(prefix) != 8:
        raise ValueError(f"expected an 8-byte header length; got {len(prefix)} bytes")
    (length,) = struct.unpack("<Q", prefix)
    raw = f.read(min(length, _MAX_HEADER_BYTES + 1))
    if length > _MAX_HEADER_BYTES or len(raw) != length:
        raise ValueError(f"expected a header of {length} bytes (at most {_MAX_HEADER_BYTES}); "
                         f"got {len(raw)}")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError(f"expected a JSON object as header; got {type(header).__name__}")
    return length, header


def tensor_bytes(header: dict) -> int:
    """The data bytes of every tensor a header describes."""
    return sum(end - begin for key, entry in header.items() if key != "__metadata__"
               for begin, end in [entry["data_offsets"]])
