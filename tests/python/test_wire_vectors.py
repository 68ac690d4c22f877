"""The Python client's wire codec (remotehead._wire) against tests/data/wire_vectors.json: bytes
made independently of it (tests/data/make_wire_vectors.py: struct and the generated protobuf
class), for every wire dtype, a 0-d scalar, empty [0, 4] tensors, negative and large integers
and values exactly representable in their dtype. The C++ codec is held to the same file."""

import json

import pytest
import torch

from conftest import ROOT
from remotehead import _wire
from remotehead.v1 import head_service_pb2 as pb

VECTORS = json.loads((ROOT / "tests" / "data" / "wire_vectors.json").read_text())["vectors"]
DTYPES = {"DTYPE_FLOAT32": torch.float32, "DTYPE_BFLOAT16": torch.bfloat16,
          "DTYPE_FLOAT16": torch.float16, "DTYPE_FLOAT64": torch.float64,
          "DTYPE_INT64": torch.int64, "DTYPE_INT32": torch.int32}


def test_the_vectors_cover_every_wire_dtype_and_the_edge_cases():
    assert {v["dtype"] for v in VECTORS} == set(DTYPES)
    assert set(DTYPES) == {name for name in pb.DType.keys() if name != "DTYPE_UNSPECIFIED"}
    assert any(v["shape"] == [] for v in VECTORS)
    assert {v["dtype"] for v in VECTORS if v["shape"] == [0, 4]} == set(DTYPES)
    assert any(-100 in v["values"] for v in VECTORS if v["dtype"] == "DTYPE_INT64")
    assert any(2 ** 40 in v["values"] for v in VECTORS if v["dtype"] == "DTYPE_INT64")


def expected_tensor(v):
    """The vector's values as a tensor of its dtype (through float64 / int64, exact for every
    value in the file)."""
    dtype = DTYPES[v["dtype"]]
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    return torch.tensor(v["values"], dtype=wide).reshape(v["shape"]).to(dtype)


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_encode_gives_the_vectors_bytes(v):
    message = pb.Tensor()
    _wire.encode(expected_tensor(v), message)
    assert message.data.hex() == v["data_hex"]
    assert message.SerializeToString().hex() == v["message_hex"]


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_decode_gives_the_vectors_values_bit_for_bit(v):
    decoded = _wire.decode(pb.Tensor.FromString(bytes.fromhex(v["message_hex"])))
    expected = expected_tensor(v)
    assert decoded.dtype == expected.dtype
    assert list(decoded.shape) == v["shape"]
    # Bit for bit: the raw bytes (which tell -0.0 from 0.0), then the values themselves.
    assert decoded.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex() \
        == v["data_hex"]
    wide = torch.float64 if expected.dtype.is_floating_point else torch.int64
    assert decoded.to(wide).reshape(-1).tolist() == v["values"]
