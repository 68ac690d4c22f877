"""The Python client against a head group of 2 real server processes (one head split by
vocabulary, Gloo on loopback): a tiny Llama (built from a config, no download) trained for 10
steps with gradient accumulation 2 and server-side AdamW gives the same per-step losses as the
same run against one server (fp32, relative 1e-5), and the same head weights at the end. The
group's HeadInfo reports its size and each rank's rows.
"""

import copy
import os
import pathlib

import pytest

import remotehead
import remotehead.hf
from remotehead.local_server import LocalHeadGroup

from test_hf_llama import tiny_llama, train

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 10


@pytest.fixture(scope="module")
def group():
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    group = LocalHeadGroup(binary, size=2, args=("--device=cpu", "--torch_threads=1")).start()
    yield group
    assert group.stop() == [0, 0], "".join(group.ranks[0].log + group.ranks[1].log)


@pytest.fixture(scope="module")
def group_target(group):
    return group.target


def test_group_of_two_trains_like_one_server(server_target, group_target):
    base = tiny_llama()
    single_model, group_model = copy.deepcopy(base), copy.deepcopy(base)
    with remotehead.Client(server_target) as single, remotehead.Client(group_target) as group:
        single_head = remotehead.hf.offload_lm_head(single_model, single, "llama-single")
        group_head = remotehead.hf.offload_lm_head(group_model, group, "llama-group")
        info = group.describe_head("llama-group")
        assert info.group_size == 2
        assert info.vocab_size == 257
        assert info.shards == ((0, 129), (129, 128))

        single_losses = train(single_model, single_head, steps=STEPS)
        group_losses = train(group_model, group_head, steps=STEPS)
        for step, (a, b) in enumerate(zip(group_losses, single_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: group {a} vs one server {b}"
        assert group_losses[-1] < group_losses[0]
        w_group, _ = group.export_weights("llama-group")
        w_single, _ = single.export_weights("llama-single")
        assert (w_group - w_single).abs().max().item() <= 1e-5
        group.drop_head("llama-group")
        single.drop_head("llama-single")


def test_generation_through_a_group_equals_one_server(server_target, group_target):
    """Logits and sampling on a head group (each chunk's rows all-gathered over the vocabulary on
    every rank): the front answers what one server answers for the same weights: the logits to
    fp32 rounding, the drawn tokens and their log-probabilities for greedy and seeded top-k /
    top-p draws; the CLI's listing says both run on groups."""
    import torch
    torch.manual_seed(5)
    weight, bias = torch.randn(257, 24) * 0.5, torch.randn(257) * 0.1
    hidden = torch.randn(3, 7, 24)
    with remotehead.Client(server_target) as single, remotehead.Client(group_target) as group:
        single.upload_head("gen", weight, bias)
        group.upload_head("gen", weight, bias)
        assert group.describe_head("gen").shards == ((0, 129), (129, 128))
        assert group.functions()["logits"].vocab_decomposable
        expected = hidden @ weight.double().t().float() + bias
        for params in ({}, {"softcap": 3.0, "temperature": 0.7}):
            a = group.logits("gen", hidden, params=params)
            b = single.logits("gen", hidden, params=params)
            assert a.shape == (3, 7, 257) and a.dtype == torch.float32
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
            if not params:
                assert torch.allclose(a, expected, rtol=1e-4, atol=1e-4)
        half = group.logits("gen", hidden, dtype=torch.bfloat16)
        assert half.dtype == torch.bfloat16
        for kwargs in ({"greedy": True}, {"top_k": 20, "seed": 4, "temperature": 0.9},
                       {"top_p": 0.8, "seed": 11}):
            ids_group, logp_group = group.sample("gen", hidden, **kwargs)
            ids_single, logp_single = single.sample("gen", hidden, **kwargs)
            assert torch.equal(ids_group, ids_single), kwargs
            assert torch.allclose(logp_group, logp_single, rtol=1e-5, atol=1e-6), kwargs
        assert torch.equal(group.sample("gen", hidden, greedy=True)[0], expected.argmax(-1))
        group.drop_head("gen")
        single.drop_head("gen")


def test_a_rank_that_is_not_the_front_names_the_front(group):
    """A client that dials rank 1 is told where the front is (NotTheFrontError, reason
    NOT_THE_FRONT, metadata "front" = the address the front announced through the group's log)
    instead of gRPC's bare UNIMPLEMENTED; rank 1 still answers health; following the address
    works; the CLI prints the reason and the address with --json."""
    import json
    import subprocess
    import sys
    import time
    rank1 = group.ranks[1].target
    deadline = time.monotonic() + 10
    with remotehead.Client(rank1) as client:
        assert client.health() == "SERVING"
        while True:
            with pytest.raises(remotehead.NotTheFrontError) as refused:
                client.list_heads()
            if refused.value.front or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # the front announces its address once it listens
    error = refused.value
    assert error.reason == "NOT_THE_FRONT" and error.code.name == "FAILED_PRECONDITION"
    assert error.front == group.target, error
    assert error.metadata["rank"] == "1"
    assert error.metadata["method"] == "/remotehead.v1.HeadService/ListHeads"
    assert group.target in error.details
    with remotehead.Client(error.front) as front:
        assert isinstance(front.list_heads(), list)
    cli = subprocess.run([sys.executable, "-m", "remotehead.cli", "--server", rank1, "--json",
                          "heads"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "client" / "python")})
    assert cli.returncode != 0
    printed = json.loads(cli.stderr.strip().splitlines()[-1])
    assert printed["reason"] == "NOT_THE_FRONT" and printed["metadata"]["front"] == group.target
