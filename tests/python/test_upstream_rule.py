"""The upstream-gradient rule of the fused loss (remotehead.upstream_matches_declared) and the
refusal of a zero or non-finite upstream_scale, against tests/data/upstream_scale_cases.json,
the cases the C++ client is tested against too (tests/client/upstream_rule_test.cc)."""

import json

import grpc
import pytest
import torch

import remotehead
from conftest import ROOT

DATA = json.loads((ROOT / "tests" / "data" / "upstream_scale_cases.json").read_text())


def number(v):
    """A number, or one of "nan", "inf", "-inf" (JSON has no non-finite numbers)."""
    return float(v)


@pytest.mark.parametrize("case", DATA["cases"], ids=[c["why"] for c in DATA["cases"]])
def test_every_case_of_the_shared_file(case):
    declared, got = number(case["declared"]), number(case["got"])
    assert remotehead.upstream_matches_declared(declared, got) is case["matches"]


@pytest.fixture
def head(server_target):
    with remotehead.Client(server_target) as client:
        client.create_head("upstream-rule", 16, 4, seed=0)
        yield client, "upstream-rule"
        client.drop_head("upstream-rule")


@pytest.mark.parametrize("scale", DATA["declared_refused"], ids=str)
def test_a_zero_or_non_finite_upstream_scale_is_refused_up_front(head, scale):
    client, head_id = head
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        remotehead.RemoteHead(client, head_id, upstream_scale=number(scale))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details.startswith("upstream_scale: expected a finite non-zero value")
    # Per call too, before anything reaches the server.
    remote = remotehead.RemoteHead(client, head_id)
    hidden = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(remotehead.InvalidArgumentError):
        remote.loss(hidden, torch.tensor([1, 2, 3]), upstream_scale=number(scale))
    assert client.describe_head(head_id).accumulated_micro_batches == 0


def test_the_fused_backward_applies_the_rule(head):
    """A small declared scale: the old Python rule (1e-6 · max(1, |s|)) let 5e-6 relative
    through; the shared rule refuses it, and takes 5e-7."""
    client, head_id = head
    remote = remotehead.RemoteHead(client, head_id, upstream_scale=1e-3)
    labels = torch.tensor([1, 2, 3])
    for factor, accepted in ((1 + 5e-7, True), (1 + 5e-6, False)):
        hidden = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        loss = remote.loss(hidden, labels)
        if accepted:
            (loss * (1e-3 * factor)).backward()
            assert hidden.grad is not None
        else:
            with pytest.raises(remotehead.RemoteheadError) as refused:
                (loss * (1e-3 * factor)).backward()
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "upstream_scale = 0.001" in refused.value.details
