"""The head's health on /metrics (docs/metrics.md, "The head's health"): a real server, then a
head group of 2, take training micro-batches and an optimizer step; the step's gauges equal the
float64 reference computed here in torch from the same weights and rows (entropy, max logit,
mean max logit, mean lse² of the logits after softcap and temperature; GRPO's clipped fraction
and KL over its own calls' tokens), Forward calls and ZeroGradients' discarded windows do not
count, every step opens a new window, and a dropped head loses its series."""

import os
import pathlib
import re
import urllib.request

import pytest
import torch

import remotehead
from remotehead.local_server import LocalHeadGroup, LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
ARGS = ["--device=cpu", "--metrics_address=127.0.0.1:0"]
V, D, ROWS = 96, 16, 20
PARAMS = {"softcap": 4.0, "temperature": 0.7}
HEALTH = ["entropy_mean", "logit_max", "logit_max_mean", "z_loss_mean", "clipped_fraction",
          "kl_mean"]
SGD = dict(lr=0.5)


def scrape(port: int, head: str) -> dict:
    """The head's remotehead_head_* samples on /metrics, by the name's tail."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    pattern = rf'^remotehead_head_(\w+)\{{head="{re.escape(head)}"\}} (\S+)$'
    return {name: float(value) for name, value in re.findall(pattern, body, re.M)}


def health(port: int, head: str) -> dict:
    return {k: v for k, v in scrape(port, head).items() if k in HEALTH}


def logits(weight, hidden):
    """What the function sees: z = X·Wᵀ, softcapped, over the temperature (float64)."""
    z = hidden.double() @ weight.double().T
    return torch.tanh(z / PARAMS["softcap"]) * PARAMS["softcap"] / PARAMS["temperature"]


def reference(weight, batches):
    """The step's gauges from its training micro-batches [(hidden, targets)], float64."""
    z = torch.cat([logits(weight, h)[t != -100] for h, t in batches])
    lse = torch.logsumexp(z, 1)
    entropy = -(torch.softmax(z, 1) * torch.log_softmax(z, 1)).sum(1)
    row_max = z.max(1).values
    return {"entropy_mean": entropy.mean().item(), "logit_max": row_max.max().item(),
            "logit_max_mean": row_max.mean().item(), "z_loss_mean": (lse ** 2).mean().item()}


def expect_close(actual: dict, expected: dict):
    assert set(actual) == set(expected), (actual, expected)
    for name, value in expected.items():
        assert actual[name] == pytest.approx(value, rel=2e-5, abs=1e-6), name


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, D, generator=g)
    targets = torch.randint(0, V, (ROWS,), generator=g)
    targets[::4] = -100  # ignored tokens are not the head's health
    return hidden, targets


def run_windows(target: str, ports: list):
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(0)) * 2
    with remotehead.Client(target) as client:
        client.upload_head("lm", weight)
        assert all(health(p, "lm") == {} for p in ports), "no step yet: no health"
        a, b = batch(1), batch(2)
        client.forward_backward("lm", *a, params=PARAMS, gradient_id=("t", 0, 0))
        # A two-phase micro-batch counts at its Backward; the Forward before it (old or
        # reference log-probs) and a Forward on other rows do not.
        client.forward("lm", *b, params=PARAMS)
        client.forward("lm", *batch(3), params=PARAMS)
        client.backward("lm", *b, 1.0, params=PARAMS, reduction="mean",
                        gradient_id=("t", 0, 1))
        assert all(health(p, "lm") == {} for p in ports), "published at the step, not before"
        client.optimizer_step("lm", sgd=SGD, zero_gradients=True)
        expected = reference(weight, [a, b])
        tokens = int(sum((t != -100).sum() for _, t in [a, b]))
        for port in ports:  # on a group: every rank the whole vocabulary's values
            expect_close(health(port, "lm"), expected)
            assert scrape(port, "lm")["step_tokens_total"] == tokens

        # A new window: a zeroed micro-batch is dropped unpublished, the next step sees only
        # its own; the weights are the stepped ones.
        weight = client.export_weights("lm")[0]
        client.forward_backward("lm", *batch(4), params=PARAMS, gradient_id=("t", 1, 0))
        client.zero_gradients("lm")
        c = batch(5)
        client.forward_backward("lm", *c, params=PARAMS, gradient_id=("t", 1, 1))
        client.forward_backward("lm", *c, params=PARAMS, gradient_id=("t", 1, 1))  # a replay
        client.optimizer_step("lm", sgd=SGD, zero_gradients=True)
        for port in ports:
            expect_close(health(port, "lm"), reference(weight, [c]))
            assert scrape(port, "lm")["step_tokens_total"] == tokens + int((c[1] != -100).sum())

        # A step with no training token in its window: nothing to say, no gauge.
        client.optimizer_step("lm", sgd=SGD, zero_gradients=True)
        for port in ports:
            assert health(port, "lm") == {}
            assert "step_tokens_total" in scrape(port, "lm")
        client.drop_head("lm")
        for port in ports:
            assert scrape(port, "lm") == {}, "a dropped head's series are gone"


def test_a_step_publishes_its_windows_health():
    with LocalServer(BINARY, ARGS) as server:
        run_windows(server.target, [server.metrics_port])


def test_every_rank_of_a_group_publishes_the_whole_vocabularys_health():
    with LocalHeadGroup(BINARY, size=2, args=ARGS) as group:
        run_windows(group.target, [rank.metrics_port for rank in group.ranks])


def test_grpo_clipped_fraction_and_kl_over_the_calls_that_report_them():
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    (h1, t1), (h2, t2), (h3, t3) = batch(1), batch(2), batch(3)
    t1[::4] = 0  # GRPO's rows all count (its ignored ones would be masked by weights)
    t2[::4] = 0

    def logprobs(h, t):
        return torch.log_softmax(logits(weight, h), 1).gather(1, t.clamp(min=0)[:, None])[:, 0]

    # old log-probs away from the clip edges (ratio e^±0.6 clipped, e^±0.05 not), a reference
    # some way off.
    shift = torch.tensor([0.6, -0.05, 0.05, -0.6]).repeat(ROWS // 4)
    lp1, lp2 = logprobs(h1, t1), logprobs(h2, t2)
    aux1 = {"advantages": torch.randn(ROWS), "old_logprobs": (lp1 + shift).float(),
            "ref_logprobs": (lp1 - 0.3).float()}
    aux2 = {"advantages": torch.randn(ROWS), "old_logprobs": (lp2 - shift).float()}
    grpo = dict(function="grpo", params={**PARAMS, "beta": 0.04}, reduction="sum")
    with LocalServer(BINARY, ARGS) as server, remotehead.Client(server.target) as client:
        client.upload_head("lm", weight)
        client.forward_backward("lm", h1, t1, aux=aux1, gradient_id=("t", 0, 0), **grpo)
        client.forward_backward("lm", h2, t2, aux=aux2, gradient_id=("t", 0, 1),
                                function="grpo", params=PARAMS, reduction="sum")
        client.forward_backward("lm", h3, t3, params=PARAMS, gradient_id=("t", 0, 2))
        client.optimizer_step("lm", sgd=SGD, zero_gradients=True)
        got = health(server.metrics_port, "lm")
    # Clipped: |shift| = 0.6 rows, over both GRPO calls' tokens (not the cross-entropy one's).
    clipped = sum(((lp - old).exp() - 1).abs().gt(0.2).sum().item()
                  for lp, old in [(lp1, aux1["old_logprobs"]), (lp2, aux2["old_logprobs"])])
    assert got["clipped_fraction"] == pytest.approx(clipped / (2 * ROWS), rel=1e-6)
    assert got["clipped_fraction"] == pytest.approx(0.5)
    # KL: the k3 estimator over the one call that had a reference.
    d = aux1["ref_logprobs"].double() - lp1
    assert got["kl_mean"] == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-4)
    expected = reference(weight, [(h1, t1), (h2, t2), (h3, t3)])
    expect_close({k: v for k, v in got.items() if k in expected}, expected)
