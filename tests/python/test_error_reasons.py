"""Errors programs can read, and functions clients can discover, over a real server process.

Every failed call carries a google.rpc.ErrorInfo (reason, domain "remotehead.dev", metadata) in
its status details; the Python client raises the exception class of its reason and exposes
`reason` / `metadata`, the CLI prints them with --json, and nothing matches message text (a
status with the same code and message but another reason is not a ServerRestartedError).
ListFunctions lists every function with what the clients need; the Python client sizes and
types a Forward's outputs from it.
"""

import json

import grpc
import pytest
import torch

import remotehead
from remotehead import _errors
from remotehead.v1 import head_service_pb2 as pb

from test_cli import BINARY, cli
from remotehead.local_server import LocalServer


@pytest.fixture(scope="module")
def server():
    with LocalServer(BINARY, ["--device=cpu", "--head=lm:64:8"]) as s:
        yield s


def test_refusals_raise_the_class_of_their_reason_with_its_metadata(server):
    with remotehead.Client(server.target, max_attempts=1) as client:
        with pytest.raises(remotehead.HeadNotFoundError) as missing:
            client.describe_head("missing")
        assert missing.value.reason == "HEAD_NOT_FOUND"
        assert missing.value.metadata == {"head": "missing"}
        assert missing.value.code == grpc.StatusCode.NOT_FOUND

        with pytest.raises(remotehead.HeadExistsError):
            client.create_head("lm", 64, 8)

        hidden, targets = torch.randn(6, 8), torch.randint(0, 64, (6,))
        info = client.describe_head("lm")
        with pytest.raises(remotehead.ServerRestartedError) as restarted:
            client.forward_backward("lm", hidden, targets, expected_incarnation="0" * 16)
        assert restarted.value.metadata["incarnation"] == info.incarnation
        assert restarted.value.metadata["weight_version"] == str(info.weight_version)
        assert restarted.value.metadata["head"] == "lm"

        with pytest.raises(remotehead.WeightVersionMismatchError) as stale:
            client.forward_backward("lm", hidden, targets,
                                    expected_weight_version=info.weight_version + 3)
        assert stale.value.metadata["expected"] == str(info.weight_version + 3)

        with pytest.raises(remotehead.InvalidArgumentError) as bad:
            client.forward_backward("lm", hidden, targets, params={"bogus": 1.0})
        assert bad.value.reason == "INVALID_FIELD"
        assert bad.value.metadata["field"] == 'params["bogus"]'
        assert client.describe_head("lm").accumulated_micro_batches == 0


class _FakeError(grpc.RpcError):
    """A failed call as gRPC hands it to the client."""

    def __init__(self, code, details, reason=None):
        self._code, self._details, self._trailers = code, details, ()
        if reason is not None:
            info = pb.ErrorInfo(reason=reason, domain="remotehead.dev", metadata={"head": "h"})
            status = pb.RpcStatus(code=code.value[0], message=details)
            detail = status.details.add()
            detail.type_url = "type.googleapis.com/google.rpc.ErrorInfo"
            detail.value = info.SerializeToString()
            self._trailers = (("grpc-status-details-bin", status.SerializeToString()),)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def test_the_class_comes_from_the_reason_never_from_the_message():
    text = "expected_incarnation: ... the server restarted ..."
    code = grpc.StatusCode.FAILED_PRECONDITION
    assert type(_errors.from_rpc_error(_FakeError(code, text))) is remotehead.RemoteheadError
    assert type(_errors.from_rpc_error(_FakeError(code, text, "WEIGHT_VERSION_MISMATCH"))) is \
        remotehead.WeightVersionMismatchError
    restarted = _errors.from_rpc_error(_FakeError(code, "any words", "SERVER_RESTARTED"))
    assert isinstance(restarted, remotehead.ServerRestartedError)
    assert restarted.metadata == {"head": "h"}
    # gRPC's own statuses (no details) keep the code's name as their reason.
    assert _errors.from_rpc_error(
        _FakeError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")).reason == \
        "DEADLINE_EXCEEDED"


def test_the_cli_prints_the_reason(server):
    code, _, err = cli("--json", "describe", "missing", server=server.target)
    assert code == 5
    assert json.loads(err) == {"code": "NOT_FOUND", "reason": "HEAD_NOT_FOUND",
                               "metadata": {"head": "missing"}, "message": json.loads(err)[
                                   "message"]}
    code, _, err = cli("describe", "missing", server=server.target)
    assert "NOT_FOUND (HEAD_NOT_FOUND)" in err


def test_list_functions_and_the_cli_describe_every_function(server):
    with remotehead.Client(server.target) as client:
        functions = client.functions()
    assert {"cross_entropy", "grpo", "logits", "sample"} <= functions.keys()
    grpo = functions["grpo"]
    assert grpo.required_aux == ("advantages",)
    assert {p.name for p in grpo.params} >= {"epsilon_low", "beta", "temperature", "softcap"}
    beta = next(p for p in grpo.params if p.name == "beta")
    assert (beta.default, beta.min, beta.max, beta.common) == (0.0, 0.0, float("inf"), False)
    assert grpo.output_kind == "per_token" and grpo.differentiable and grpo.vocab_decomposable
    assert functions["logits"].output_kind == "logits" and not functions["logits"].differentiable
    assert functions["sample"].vocab_decomposable  # the generation loop gathers rows on a group
    assert functions["token_logprobs"].outputs_dtype(torch.float64) == torch.float64
    assert functions["logits"].outputs_dtype(torch.float64) == torch.float32
    assert functions["logits"].outputs_dtype(torch.float32, torch.bfloat16) == torch.bfloat16

    code, out, err = cli("--json", "functions", server=server.target)
    assert code == 0, err
    listed = {f["name"]: f for f in json.loads(out)}
    assert listed.keys() == functions.keys()
    assert listed["grpo"]["required_aux"] == ["advantages"]
    code, out, _ = cli("functions", server=server.target)
    assert code == 0 and "grpo: " in out and "every function also takes: temperature" in out
