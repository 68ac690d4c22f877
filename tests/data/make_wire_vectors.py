"""Writes tests/data/wire_vectors.json: serialised remotehead.v1.Tensor messages of every wire
dtype, against which the clients' codecs are tested (tests/python/test_wire_vectors.py).

Independent of the codecs under test: the little-endian bytes are built with `struct` (bfloat16
as the top 16 bits of the float32 bit pattern; every value is exactly representable in its
dtype, checked here), the message with the generated protobuf class. Run from the repository
root after a build (the protobuf stubs are generated into client/python/remotehead/v1/):

    PYTHONPATH=client/python python tests/data/make_wire_vectors.py

Format: {"comment": ..., "vectors": [{"name", "dtype" (the DType enum name), "shape", "values"
(flat, row-major; JSON numbers), "data_hex" (Tensor.data), "message_hex" (the serialised
Tensor)}, ...]}
"""

import json
import math
import pathlib
import struct

from remotehead.v1 import head_service_pb2 as pb

OUT = pathlib.Path(__file__).resolve().parent / "wire_vectors.json"


def bf16_bytes(v: float) -> bytes:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    if bits & 0xFFFF:
        raise ValueError(f"{v} is not exactly representable in bfloat16")
    return struct.pack("<H", bits >> 16)


def exact(fmt: str):
    """Packs with `fmt`, refusing a value that does not survive the round trip."""
    def pack(v):
        b = struct.pack(fmt, v)
        back = struct.unpack(fmt, b)[0]
        if back != v and not (math.isnan(back) and math.isnan(v)):
            raise ValueError(f"{v} is not exactly representable as {fmt}")
        return b
    return pack


PACKERS = {
    "DTYPE_FLOAT32": exact("<f"),
    "DTYPE_BFLOAT16": bf16_bytes,
    "DTYPE_FLOAT16": exact("<e"),
    "DTYPE_FLOAT64": exact("<d"),
    "DTYPE_INT64": exact("<q"),
    "DTYPE_INT32": exact("<i"),
}

VECTORS = [
    ("float32_2x3", "DTYPE_FLOAT32", [2, 3], [1.0, -2.5, 0.15625, 2.0 ** -25, 65504.0, -0.0]),
    ("float32_scalar", "DTYPE_FLOAT32", [], [-1.75]),
    ("float32_empty_0x4", "DTYPE_FLOAT32", [0, 4], []),
    ("float32_extremes_4", "DTYPE_FLOAT32", [4],
     [3.4028234663852886e38, 1.1754943508222875e-38, 1.401298464324817e-45, -1024.0]),
    ("bfloat16_2x2", "DTYPE_BFLOAT16", [2, 2], [1.0, -2.5, 0.0078125, 3.3895313892515355e38]),
    ("bfloat16_scalar", "DTYPE_BFLOAT16", [], [-0.5]),
    ("bfloat16_empty_0x4", "DTYPE_BFLOAT16", [0, 4], []),
    ("bfloat16_1x3_large_small", "DTYPE_BFLOAT16", [1, 3], [256.0, 1.5, -(2.0 ** -133)]),
    ("float16_2x3", "DTYPE_FLOAT16", [2, 3], [1.0, -2.5, 2.0 ** -14, 65504.0, -0.0,
                                              2.0 ** -24]),
    ("float16_scalar", "DTYPE_FLOAT16", [], [0.333251953125]),
    ("float16_empty_0x4", "DTYPE_FLOAT16", [0, 4], []),
    ("float64_2x2", "DTYPE_FLOAT64", [2, 2], [0.1, -1e300, 5e-324, 2.0 ** 60]),
    ("float64_scalar", "DTYPE_FLOAT64", [], [3.141592653589793]),
    ("float64_empty_0x4", "DTYPE_FLOAT64", [0, 4], []),
    ("int64_targets_6", "DTYPE_INT64", [6], [0, 1, -100, 31999, 2 ** 40, -(2 ** 40) - 7]),
    ("int64_extremes_2", "DTYPE_INT64", [2], [2 ** 63 - 1, -(2 ** 63)]),
    ("int64_scalar", "DTYPE_INT64", [], [-100]),
    ("int64_empty_0x4", "DTYPE_INT64", [0, 4], []),
    ("int32_2x3", "DTYPE_INT32", [2, 3], [0, 1, -100, 127999, 2 ** 31 - 1, -(2 ** 31)]),
    ("int32_scalar", "DTYPE_INT32", [], [7]),
    ("int32_empty_0x4", "DTYPE_INT32", [0, 4], []),
]


def vector(name, dtype, shape, values):
    if math.prod(shape) != len(values):
        raise ValueError(f"{name}: {len(values)} values for shape {shape}")
    data = b"".join(PACKERS[dtype](v) for v in values)
    message = pb.Tensor(dtype=pb.DType.Value(dtype), shape=shape, data=data)
    return {"name": name, "dtype": dtype, "shape": shape, "values": values,
            "data_hex": data.hex(), "message_hex": message.SerializeToString().hex()}


def main():
    doc = {
        "comment": ("remotehead.v1.Tensor test vectors: raw little-endian bytes (bfloat16: the "
                    "top 16 bits of the float32 pattern), values exactly representable in their "
                    "dtype, flat in row-major order. Made by tests/data/make_wire_vectors.py "
                    "(struct and the generated protobuf class, not the codecs under test)."),
        "vectors": [vector(*v) for v in VECTORS],
    }
    # One vector per line: diffs of a regenerated file stay readable.
    lines = ",\n".join("  " + json.dumps(v) for v in doc["vectors"])
    comment = json.dumps(doc["comment"])
    OUT.write_text(f'{{\n "comment": {comment},\n "vectors": [\n{lines}\n ]\n}}\n')
    assert json.loads(OUT.read_text()) == doc
    print(f"{OUT}: {len(doc['vectors'])} vectors")


if __name__ == "__main__":
    main()
