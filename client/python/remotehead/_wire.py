"""remotehead.v1.Tensor <-> torch.Tensor, and the row-chunk plan of a streamed tensor.

The twin of the C++ wire codec, proto/remotehead/wire/tensor_codec.cc: the same dtypes,
little-endian bytes in row-major order, and the same row-chunk rule (tests/data/wire_vectors.json
pins the bytes).
"""

import warnings
from typing import List, Optional, Sequence, Tuple

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
    out.data = bytes(encode_head(tensor, out))


def encode_head(tensor: torch.Tensor, out: pb.Tensor) -> memoryview:
    """Writes the dtype and shape of `tensor` into `out` (its data cleared) and returns the bytes
    it would carry, as a view of the wire-layout tensor where it lies (copied by no one here)."""
    t = to_wire_layout(tensor)
    out.dtype = wire_dtype(t.dtype)
    out.shape[:] = list(t.shape)
    out.ClearField("data")
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ----- messages framed around their tensors' bytes (the C++ client's wire::Frames) -----
# Protobuf merges a singular message field that occurs twice, so a tensor's bytes may follow the
# rest of the message as a field of their own; a map entry is written whole (a repeated key
# replaces its value). The pieces are joined once, into the bytes gRPC sends.

def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field_size(number: int, length: int) -> int:
    return len(_varint(number << 3 | 2)) + len(_varint(length)) + length


def _open(path: Sequence[int], number: int, length: int) -> bytes:
    """The framing that starts length-delimited field `number` of `length` bytes under the
    singular message fields `path` (outermost first)."""
    lengths = [length]
    for inner in reversed([*path[1:], number]):
        lengths.insert(0, _field_size(inner, lengths[0]))
    return b"".join(_varint(f << 3 | 2) + _varint(n) for f, n in zip([*path, number], lengths))


def data_frame(path: Sequence[int], data: memoryview) -> List[object]:
    """The pieces that give the tensor at `path` its bytes `data`."""
    if not data.nbytes:
        return []
    return [_open(path, pb.Tensor.DESCRIPTOR.fields_by_name["data"].number, data.nbytes), data]


def map_tensor_frame(path: Sequence[int], number: int, key: str, head: pb.Tensor,
                     data: memoryview) -> List[object]:
    """The pieces of one entry (`key`, `head` with bytes `data`) of map<string, Tensor> `number`
    under `path`."""
    data_number = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
    value_head = head.SerializeToString()
    value_size = len(value_head) + (_field_size(data_number, data.nbytes) if data.nbytes else 0)
    key_bytes = key.encode()
    entry = _field_size(1, len(key_bytes)) + _field_size(2, value_size)
    framing = (_open(path, number, entry) + _varint(1 << 3 | 2) + _varint(len(key_bytes))
               + key_bytes + _varint(2 << 3 | 2) + _varint(value_size) + value_head)
    if not data.nbytes:
        return [framing]
    return [framing + _varint(data_number << 3 | 2) + _varint(data.nbytes), data]


# ----- a message's one large tensor found where its bytes lie (split_rows.h's twin) -----
# The message is walked, not parsed: every occurrence of each field on the path (protobuf merges
# a singular message field that occurs several times) down to the Tensor's data field. The rest
# comes back as a small message that parses as the original with that field empty, the data as
# a view of the bytes received: copied once, into the result (RowAssembler).

def _read_varint(buf: memoryview, pos: int, end: int) -> Tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("malformed varint")


def _next_field(buf: memoryview, pos: int, end: int) -> Tuple[int, int, int, int, int]:
    """(start, number, wire type, body start, end) of the field at `pos`; ValueError if it is
    not a well-formed field within `end`."""
    tag, at = _read_varint(buf, pos, end)
    number, kind = tag >> 3, tag & 7
    if kind == 0:
        _, stop = _read_varint(buf, at, end)
    elif kind in (1, 5):
        stop = at + (8 if kind == 1 else 4)
    elif kind == 2:
        length, at = _read_varint(buf, at, end)
        stop = at + length
    else:
        raise ValueError("a group")
    if stop > end:
        raise ValueError("a field past its message")
    return pos, number, kind, at, stop


def _find_data(buf, start, end, path, level, data_field, enclosing, found) -> None:
    pos = start
    while pos < end:
        field = _next_field(buf, pos, end)
        pos = field[4]
        wanted = path[level] if level < len(path) else data_field
        if level == 0 and field[1] != wanted:
            # The outermost field is a oneof member (StepResponse.part): another member between
            # occurrences would clear what came before it.
            raise ValueError("another field beside the outermost")
        if field[1] != wanted:
            continue
        if field[2] != 2:
            raise ValueError("not length-delimited")
        if level == len(path):
            if found:
                raise ValueError("the data field twice")
            found.append(field)
            continue
        had = bool(found)
        _find_data(buf, field[3], field[4], path, level + 1, data_field, enclosing, found)
        if not had and found:
            enclosing[level] = field


def _length_delimited(number: int, body: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def split_tensor_data(raw: bytes, path: Sequence[int]) -> Optional[Tuple[bytes, memoryview]]:
    """The serialized message `raw` without the data field of its tensor at `path` (field
    numbers of singular message fields, outermost first), and that field's bytes as a view of
    `raw`; None where there is no such field, it occurs twice, or the bytes are malformed."""
    buf = memoryview(raw)
    enclosing: List[Optional[tuple]] = [None] * len(path)
    found: List[tuple] = []
    try:
        _find_data(buf, 0, len(buf), path, 0, pb.Tensor.DESCRIPTOR.fields_by_name["data"].number,
                   enclosing, found)
    except ValueError:
        return None
    if not found:
        return None
    data = found[0]
    inner = bytes(buf[enclosing[-1][3]:data[0]]) + bytes(buf[data[4]:enclosing[-1][4]])
    for level in range(len(path) - 2, -1, -1):
        outer, child = enclosing[level], enclosing[level + 1]
        inner = (bytes(buf[outer[3]:child[0]]) + _length_delimited(path[level + 1], inner)
                 + bytes(buf[child[4]:outer[4]]))
    first = enclosing[0]
    rest = (bytes(buf[:first[0]]) + _length_delimited(path[0], inner) + bytes(buf[first[4]:]))
    return rest, buf[data[3]:data[4]]


def decode(msg: pb.Tensor) -> torch.Tensor:
    """A new CPU tensor holding the bytes of `msg`."""
    return decode_view(msg).clone()


def decode_view(msg: pb.Tensor, data: Optional[memoryview] = None) -> torch.Tensor:
    """The bytes of `msg` as a CPU tensor without a copy, to be read only (copied into a
    preallocated result, RowAssembler) while `msg` lives. `data`: its bytes where they were
    received, when the message was split there (split_tensor_data)."""
    dtype = _FROM_WIRE.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"dtype: unknown wire dtype {msg.dtype}")
    shape = tuple(msg.shape)
    if data is None:
        data = msg.data
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # The message's bytes are immutable: torch warns that the view must not be written.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8)
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
