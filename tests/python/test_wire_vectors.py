"""The Python client's wire codec (remotehead._wire) against tests/data/wire_vectors.json: bytes
made independently of it (tests/data/make_wire_vectors.py: struct and the generated protobuf
class), for every wire dtype, a 0-d scalar, empty [0, 4] tensors, negative and large integers
and values exactly representable in their dtype. The C++ codec is held to the same file."""

import json

import pytest
import torch

from conftest import ROOT
from remotehead import _steps, _wire
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


@pytest.mark.parametrize("offset,count", [(0, 300), (17, 5), (300, 0)])
def test_a_rows_message_framed_around_its_bytes_parses_as_the_message_built_whole(offset, count):
    """_wire.data_frame / map_tensor_frame (what PreparedStep.frames sends): the message without
    its tensors' bytes, then each tensor's bytes as a field of its own and each aux tensor as a
    whole map entry, parse as the message built and serialized whole — large rows (lengths of
    several varint bytes), a bf16 tensor, a map of tensors, no rows at all."""
    hidden = torch.randn(300, 700).to(torch.bfloat16)
    targets = torch.randint(0, 50, (300,))
    aux = {"advantages": torch.randn(300), "teacher_topk_logprobs": torch.randn(300, 4)}
    rows = slice(offset, offset + count)
    whole = pb.StepRequest()
    whole.rows.row_offset = offset
    _wire.encode(hidden[rows], whole.rows.hidden)
    _wire.encode(targets[rows], whole.rows.targets)
    for name, t in aux.items():
        _wire.encode(t[rows], whole.rows.aux[name])

    head = pb.StepRequest()
    head.rows.row_offset = offset
    number = pb.StepRows.DESCRIPTOR.fields_by_name
    rows_field = pb.StepRequest.DESCRIPTOR.fields_by_name["rows"].number
    pieces = [*_wire.data_frame([rows_field, number["hidden"].number],
                                _wire.encode_head(hidden[rows], head.rows.hidden)),
              *_wire.data_frame([rows_field, number["targets"].number],
                                _wire.encode_head(targets[rows], head.rows.targets))]
    for name, t in aux.items():
        value = pb.Tensor()
        pieces += _wire.map_tensor_frame([rows_field], number["aux"].number, name, value,
                                         _wire.encode_head(t[rows], value))
    assert pb.StepRequest.FromString(b"".join([head.SerializeToString(), *pieces])) == whole


def dx_response(offset: int, count: int):
    """A dX chunk as the server sends it (the message's head, then the rows' bytes as a field
    of their own: StepResponseOut) and as one message serialized whole."""
    rows = torch.randn(count, 5, generator=torch.Generator().manual_seed(offset))
    whole = pb.StepResponse()
    whole.grad_hidden.row_offset = offset
    _wire.encode(rows, whole.grad_hidden.values)
    head = pb.StepResponse()
    head.grad_hidden.row_offset = offset
    data = _wire.encode_head(rows, head.grad_hidden.values)
    framed = head.SerializeToString() + b"".join(
        bytes(p) for p in _wire.data_frame(_steps._DX_PATH, data))
    return whole, [whole.SerializeToString(), framed]


@pytest.mark.parametrize("offset,count", [(0, 7), (300, 1), (2 ** 20, 3)])
def test_a_dx_response_is_split_at_its_rows_bytes_as_protobuf_parses_it(offset, count):
    """decode_response: the rows' bytes of a dX chunk as a view of the bytes received, the rest
    parsed — together exactly the message — for both forms the chunk may take; every truncation
    of the framed form is refused or agrees with protobuf."""
    whole, forms = dx_response(offset, count)
    for raw in forms:
        response, data = _steps.decode_response(raw)
        assert data is not None and isinstance(data, memoryview)
        assert data.obj is raw  # a view of the bytes received, not a copy
        rebuilt = pb.StepResponse()
        rebuilt.CopyFrom(response)
        rebuilt.grad_hidden.values.data = bytes(data)
        assert rebuilt == whole
        assert torch.equal(_wire.decode_view(response.grad_hidden.values, data),
                           _wire.decode_view(whole.grad_hidden.values))
    framed = forms[1]
    splits = 0
    for n in range(len(framed)):
        split = _wire.split_tensor_data(framed[:n], _steps._DX_PATH)
        if split is None:
            continue
        splits += 1
        rebuilt = pb.StepResponse.FromString(split[0])
        rebuilt.grad_hidden.values.data = bytes(split[1])
        assert rebuilt == pb.StepResponse.FromString(framed[:n])
    assert splits == 0  # the rows' bytes come last: every prefix cuts them


def test_responses_without_dx_rows_are_parsed_whole():
    summary = pb.StepResponse()
    summary.summary.loss = 1.5
    outputs = pb.StepResponse()
    _wire.encode(torch.ones(3), outputs.outputs.values)
    for message in (summary, outputs):
        response, data = _steps.decode_response(message.SerializeToString())
        assert data is None and response == message
    # The data field twice (protobuf keeps the last): parsed whole, as protobuf does.
    whole, (raw, _) = dx_response(4, 2)
    twice = raw + raw
    response, data = _steps.decode_response(twice)
    assert data is None and response == pb.StepResponse.FromString(twice)
    # Another member of the response's oneof beside the dX chunk (it clears what came before).
    mixed = raw + summary.SerializeToString()
    response, data = _steps.decode_response(mixed)
    assert data is None and response == pb.StepResponse.FromString(mixed)
