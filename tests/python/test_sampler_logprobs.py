"""token_logprobs under the sampler's distribution (top_k / top_p / min_p / min_p_first, the
kept set of core/sampler_kept_set.h), through the Python client, against a real server process
and a head group of 2 server processes:

- the per-token log-probs (−inf outside the kept set) and the "kept" token extra against the
  float64 torch reference (references.sampler_kept_mask: sort, cumulative sum, mask,
  log_softmax), for each truncation, their combination and both orders, with a temperature;
- the gradients: the fused step's loss, dX and dW, and a two-phase Backward's dX, against
  torch autograd of the reference (the kept set a constant);
- a token the server draws ("sample" with the same params, min-p included) is kept, and its
  log-prob is the log of the probability torch.multinomial drew it with;
- ListFunctions lists the four params for token_logprobs and sample.
"""

import os
import pathlib

import pytest
import torch

import numerics
import references
import remotehead
from remotehead.local_server import LocalHeadGroup

ROOT = pathlib.Path(__file__).resolve().parents[2]
V, D, N = 300, 12, 53
REL = 1e-10  # float64 heads

CASES = [
    {"top_k": 9},
    {"top_p": 0.8},
    {"top_p": 0.97, "temperature": 3.0},  # flat rows: the server asks for 64, 256, then all
    {"min_p": 0.1},
    {"top_k": 50, "top_p": 0.8, "min_p": 0.2, "temperature": 1.3},
    {"top_k": 50, "top_p": 0.8, "min_p": 0.2, "min_p_first": 1.0, "temperature": 1.3},
]


@pytest.fixture(scope="module")
def group_target():
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    group = LocalHeadGroup(binary, size=2, args=("--device=cpu", "--torch_threads=1")).start()
    yield group.target
    assert group.stop() == [0, 0], "".join(group.ranks[0].log + group.ranks[1].log)


@pytest.fixture(scope="module", params=["one server", "group of 2"])
def client(request, server_target, group_target):
    target = server_target if request.param == "one server" else group_target
    with remotehead.Client(target, chunk_bytes=4096) as c:
        yield c


@pytest.fixture(scope="module")
def head(client):
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5
    client.upload_head("sampler", weight)
    yield "sampler", weight
    client.drop_head("sampler")


def full_params(params):
    return {"temperature": 1.0, "softcap": 0.0, "logit_scale": 1.0, "top_k": 0.0, "top_p": 1.0,
            "min_p": 0.0, "min_p_first": 0.0, **params}


def batch(weight, params, seed):
    """Rows and targets: random (mostly outside a truncated set), the largest logit, a kept token
    drawn at random, and every fifth row ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    z = references.logits(x, weight, full_params(params))
    keep = references.sampler_kept_mask(z, full_params(params))
    kind = torch.arange(N) % 3
    t = torch.where(kind == 0, torch.randint(0, V, (N,), generator=g), z.argmax(1))
    t = torch.where(kind == 2, torch.multinomial(keep.double(), 1, generator=g)[:, 0], t)
    t[::5] = -100
    return x, t


def reference(x, weight, t, params):
    """The reference per-token log-probs (0 at ignored rows) and the kept flags, differentiable in
    x and weight."""
    y = references.per_token("token_logprobs", x, weight, t, {}, full_params(params))
    z = references.logits(x, weight, full_params(params))
    kept = references.sampler_kept_mask(z, full_params(params)).gather(1, t.clamp(min=0)[:, None])
    return y, torch.where(t >= 0, kept[:, 0].double(), 0.0)


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_logprobs_and_kept_match_the_reference(client, head, params):
    head_id, weight = head
    x, t = batch(weight, params, seed=len(params))
    y, kept = reference(x, weight, t, params)
    out = client.forward(head_id, x, t, function="token_logprobs", params=params,
                         token_extras=["kept"])
    assert torch.equal(out.outputs.isneginf(), y.isneginf())
    assert numerics.relative_error(out.outputs, y) <= REL
    assert torch.equal(out.token_extras["kept"], kept)
    assert kept.sum() > 0


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_gradients_match_torch_autograd(client, head, params):
    """The fused sum over kept targets, and a two-phase Backward with a per-token upstream over
    targets inside and outside the set (−inf there, no gradient)."""
    head_id, weight = head
    x, t = batch(weight, params, seed=10 + len(params))
    _, kept = reference(x, weight, t, params)
    t_kept = torch.where(kept > 0, t, -100)
    xr = x.clone().requires_grad_()
    wr = weight.clone().requires_grad_()
    y, _ = reference(xr, wr, t_kept, params)
    y.sum().backward()
    gid = ("sampler", CASES.index(params), 0)
    fused = client.forward_backward(head_id, x, t_kept, function="token_logprobs", params=params,
                                    reduction="sum", gradient_id=gid)
    assert numerics.relative_error(fused.loss, y.sum().item()) <= REL
    assert numerics.relative_error(fused.grad_hidden, xr.grad) <= REL
    dw, _, _ = client.fetch_gradients(head_id)
    client.zero_gradients(head_id)
    assert numerics.relative_error(dw, wr.grad) <= 1e-6  # the server accumulates dW in fp32

    upstream = torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    xr = x.clone().requires_grad_()
    y, _ = reference(xr, weight, t, params)
    y.backward(torch.where(y.isfinite(), upstream, 0.0))
    back = client.backward(head_id, x, t, upstream, function="token_logprobs", params=params,
                           accumulate=False)
    assert numerics.relative_error(back.grad_hidden, xr.grad) <= REL


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_a_drawn_token_is_kept_with_the_probability_it_was_drawn_with(client, head, params):
    head_id, weight = head
    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    sampler = {k: v for k, v in params.items() if k != "temperature"}
    ids, _ = client.sample(head_id, x, seed=77, temperature=params.get("temperature", 1.0),
                           top_k=int(sampler.get("top_k", 0)), top_p=sampler.get("top_p", 1.0),
                           min_p=sampler.get("min_p", 0.0),
                           min_p_first=bool(sampler.get("min_p_first", 0)))
    z = references.logits(x, weight, full_params(params))
    keep = references.sampler_kept_mask(z, full_params(params))
    probs = torch.softmax(z.masked_fill(~keep, -torch.inf), 1)
    expected = torch.stack([torch.multinomial(probs[i], 1,
                                              generator=torch.Generator().manual_seed(77 + i))[0]
                            for i in range(N)])
    assert torch.equal(ids, expected)
    out = client.forward(head_id, x, ids, function="token_logprobs", params=params,
                         token_extras=["kept"])
    assert torch.equal(out.token_extras["kept"], torch.ones(N, dtype=torch.float64))
    used = probs.gather(1, ids[:, None])[:, 0]
    assert numerics.relative_error(out.outputs, used.log()) <= REL


def test_the_listing_names_the_sampler_params(client):
    functions = client.functions()
    for name in ("token_logprobs", "sample"):
        listed = {p.name: (p.default, p.min, p.max) for p in functions[name].params}
        assert listed["top_k"][0] == 0 and listed["top_p"] == (1.0, 1e-9, 1.0)
        assert listed["min_p"] == (0.0, 0.0, 1.0) and listed["min_p_first"] == (0.0, 0.0, 1.0)
    assert "kept" in {e.name for e in functions["token_logprobs"].extras}
