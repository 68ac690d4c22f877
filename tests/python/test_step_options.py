"""The Python client's typed options and its request rules, without a server: StepOptions
documents every option and refuses unknown ones; the StepHeader fields and the row messages
follow the C++ client's PrepareStep (tests/python/test_conformance.py checks the two clients
against each other through a server; these pin the rules themselves)."""

import dataclasses
import pydoc

import pytest
import torch

import remotehead
from remotehead._steps import prepare_step
from remotehead.client import framing_bytes
from remotehead.v1 import head_service_pb2 as pb

OPTIONS = [f.name for f in dataclasses.fields(remotehead.StepOptions)]


def test_help_shows_every_option_with_its_meaning():
    text = pydoc.render_doc(remotehead.StepOptions, renderer=pydoc.plaintext)
    for name in OPTIONS:
        # "name: meaning" in the Attributes section, and the field in the signature.
        assert f"{name}: " in text.split("Attributes:")[1], name
    for method in (remotehead.Client.forward_backward, remotehead.Client.forward,
                   remotehead.Client.backward):
        assert "StepOptions" in pydoc.render_doc(method, renderer=pydoc.plaintext)
    assert set(OPTIONS) >= {
        "function", "params", "reduction", "ignore_index", "normalizer", "valid_tokens",
        "chunk_rows", "memory_budget_bytes", "upstream_scale", "accumulate", "gradient_id",
        "expected_weight_version", "wire_dtype", "retain_inputs_seconds", "inputs_handle"}
    # Per-token inputs are arguments, not options.
    assert not {"weights", "aux", "grad_output"} & set(OPTIONS)


def test_an_unknown_keyword_option_is_a_type_error_listing_the_valid_ones():
    client = remotehead.Client("127.0.0.1:1")  # never reached: refused before any call
    with pytest.raises(TypeError) as unknown:
        client.forward_backward("lm", torch.randn(2, 4), torch.tensor([0, 1]), reducton="sum")
    assert str(unknown.value).startswith("unknown step option 'reducton'; expected one of: "
                                         + ", ".join(OPTIONS))
    with pytest.raises(TypeError, match="unknown step option 'weigths'"):
        remotehead.RemoteHead(client, "lm", weigths=torch.ones(2))
    with pytest.raises(TypeError, match="unknown step option 'foo'"):
        remotehead.StepOptions().replace(foo=1)
    with pytest.raises(remotehead.InvalidArgumentError, match="reduction: expected one of"):
        remotehead.StepOptions(reduction="avg")
    client.close()


def test_keyword_overrides_apply_over_the_options():
    base = remotehead.StepOptions(function="grpo", params={"beta": 0.1}, reduction="sum")
    o = base.replace(reduction="mean", gradient_id=("t", 3, 4))
    assert (o.function, o.params, o.reduction) == ("grpo", {"beta": 0.1}, "mean")
    assert o.gradient_id == remotehead.GradientId("t", 3, 4)
    assert base.reduction == "sum"  # a copy


def prepare(mode, n=10, d=16, options=None, targets=True, weights=False, aux=(),
            grad_output=None, chunk_bytes=1 << 20, hidden_dtype=torch.float32):
    hidden = torch.zeros(n, d, dtype=hidden_dtype)
    t = None
    if targets:
        t = torch.arange(n) % 5
        t[torch.arange(n) % 3 == 0] = -100
    return prepare_step(mode, "lm", hidden, t, torch.ones(n) if weights else None,
                        {name: torch.zeros(n) for name in aux} or None, grad_output,
                        options or remotehead.StepOptions(), chunk_bytes)


def test_header_fields_follow_the_cpp_client():
    forward = prepare("Forward", options=remotehead.StepOptions(
        reduction="mean", accumulate=True, gradient_id=("t", 0, 0), upstream_scale=2.0,
        retain_inputs_seconds=5.0)).header
    # Nothing of a gradient call on a Forward; chunking always; valid_tokens counted.
    assert not forward.HasField("upstream_scale") and not forward.HasField("gradient_id")
    assert not forward.accumulate_weight_grad and forward.grad_hidden_dtype == 0
    assert forward.HasField("chunking") and forward.retain_inputs_seconds == 5.0
    assert forward.valid_tokens == 6  # rows 0, 3, 6, 9 ignored

    fused = prepare("ForwardBackward", hidden_dtype=torch.bfloat16,
                    options=remotehead.StepOptions(
                        reduction="sum", upstream_scale=0.25, gradient_id=("t", 1, 2),
                        chunk_rows=3, retain_inputs_seconds=5.0, inputs_handle="h")).header
    assert fused.upstream_scale == 0.25 and fused.accumulate_weight_grad
    assert fused.grad_hidden_dtype == pb.DTYPE_BFLOAT16  # dX in the caller's dtype
    assert (fused.gradient_id.trainer, fused.gradient_id.step, fused.gradient_id.micro_batch) \
        == ("t", 1, 2)
    assert fused.chunking.chunk_rows == 3 and not fused.HasField("valid_tokens")
    # Forward-only and Backward-only options are not sent on other calls.
    assert fused.retain_inputs_seconds == 0 and fused.inputs_handle == ""

    scalar = prepare("Backward", options=remotehead.StepOptions(reduction="mean",
                                                                upstream_scale=3.0),
                     grad_output=0.5)
    assert scalar.header.upstream_scale == 0.5  # dL/dloss, not the option
    assert all(not m.rows.HasField("grad_output") for m in list(scalar.messages())[1:])
    given = prepare("Backward", options=remotehead.StepOptions(reduction="mean",
                                                               valid_tokens=4),
                    grad_output=1.0).header
    assert given.valid_tokens == 4
    untargeted = prepare("Forward", targets=False, options=remotehead.StepOptions(
        reduction="mean")).header
    assert untargeted.valid_tokens == 10  # no targets: every row


def test_a_mean_backward_by_handle_needs_targets_or_valid_tokens():
    options = remotehead.StepOptions(reduction="mean", inputs_handle="h")
    with pytest.raises(remotehead.InvalidArgumentError,
                       match="targets: a backward by inputs_handle"):
        prepare("Backward", targets=False, options=options, grad_output=1.0)
    by_handle = prepare("Backward", options=options, grad_output=1.0)
    assert by_handle.header.valid_tokens == 6 and by_handle.chunks == []  # no rows at all
    assert prepare("Backward", targets=False, grad_output=1.0,
                   options=options.replace(valid_tokens=3)).header.valid_tokens == 3


def test_rows_are_split_on_all_the_bytes_of_a_row():
    # hidden 16 × 4 + targets 8 + weights 4 + two aux 4 each = 84 bytes a row; framing
    # 64 + 64·5 tensors + 22 bytes of aux names = 406: (1024 − 406) // 84 = 7 rows a message.
    p = prepare("ForwardBackward", n=20, weights=True, aux=("advantages", "old_logprobs"),
                options=remotehead.StepOptions(reduction="weighted_sum"), chunk_bytes=1024)
    assert framing_bytes(5, 22) == 406
    assert p.chunks == [(0, 7), (7, 7), (14, 6)]
    messages = list(p.messages())
    assert [m.rows.row_offset for m in messages[1:]] == [0, 7, 14]
    assert max(m.ByteSize() for m in messages[1:]) <= 1024
    # By handle only grad_output travels: 4 bytes a row, framing 128.
    per_token = prepare("Backward", n=300, grad_output=torch.ones(300), chunk_bytes=1024,
                        options=remotehead.StepOptions(reduction="none", inputs_handle="h"))
    assert per_token.chunks == [(0, 224), (224, 76)]


def test_a_row_larger_than_chunk_bytes_is_refused():
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        prepare("ForwardBackward", d=300, chunk_bytes=1024,
                options=remotehead.StepOptions(gradient_id=("t", 0, 0)))
    assert refused.value.details == ("chunk_bytes: expected room for at least one row (1208 "
                                     "bytes + 192 bytes of framing); got 1024")
    with pytest.raises(remotehead.InvalidArgumentError, match="chunk_bytes: expected >= 1024"):
        remotehead.Client("127.0.0.1:1", chunk_bytes=512)
