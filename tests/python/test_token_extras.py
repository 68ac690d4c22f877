"""Per-token extras over the wire (StepOptions.token_extras): a function's diagnostics row by row,
through the Python client and the real server.

- What the server lists (FunctionInfo.extras, with their conditions) is what a call reports:
  for every listed function with extras, a fused sum asking for each one the call reports
  returns [N] tensors whose sums are the summary's extras.
- A distillation's per-token divergence, student entropy (what TRL logs) and nll: float64 heads
  against the full-logits reference (tests/python/distill_reference.py) to 1e-12 in the three
  modes (fused, Forward, Backward by inputs handle), and through RemoteHead.distill; float32
  hidden gives float32 rows.
- A name the call does not report is refused naming token_extras[i] (InvalidArgumentError,
  field metadata), and nothing is accumulated.
- `remotehead functions --json` lists the extras.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import distill_reference as ref
import numerics
import remotehead

ROOT = pathlib.Path(__file__).resolve().parents[2]
V, D, DT, N = 97, 12, 20, 41


@pytest.fixture(scope="module")
def client(server_target):
    # Small messages: each call's rows travel in several, and come back batch by batch.
    with remotehead.Client(server_target, chunk_bytes=1024) as c:
        yield c


@pytest.fixture(scope="module")
def heads(client):
    g = torch.Generator().manual_seed(5)
    ws = torch.randn(V, D, generator=g, dtype=torch.float64) / 3
    bs = 0.2 * torch.randn(V, generator=g, dtype=torch.float64)
    wt = torch.randn(V, DT, generator=g, dtype=torch.float64) / 4
    client.upload_head("extras-student", ws, bs)
    client.upload_head("extras-teacher", wt, frozen=True)
    yield ws, bs, wt
    client.drop_head("extras-student")
    client.drop_head("extras-teacher")


def rows(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype)
    xt = torch.randn(N, DT, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100
    return x, xt, t


def aux_for(fn, x, g):
    """The aux inputs a listed function takes, drawn as plausible values."""
    aux = {}
    for name in (*fn.required_aux, *fn.optional_aux):
        if name in fn.integral_aux and name in fn.topk_aux:
            aux[name] = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(N)])
        elif name in fn.integral_aux:  # e.g. the sequence of each row
            aux[name] = torch.randint(0, 3, (N,), generator=g)
        elif name in fn.topk_aux:
            aux[name] = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64),
                                          -1).topk(4, -1).values
        else:
            aux[name] = 0.1 * torch.randn(N, generator=g, dtype=torch.float64) - 1.0
    return aux


def test_every_listed_extra_comes_back_row_by_row_and_sums_to_the_summary(client, heads,
                                                                          registry):
    with_extras = [f for f in registry.values() if f.extras]
    assert {"cross_entropy", "grpo", "distill_kl", "distill_jsd"} <= {f.name for f in with_extras}
    failures = []
    g = torch.Generator().manual_seed(9)
    for fn in with_extras:
        x, xt, t = rows(1)
        params = {p.name: (0.3 if p.max >= 0.3 else p.max) for p in fn.params
                  if not p.common and p.name in {e.when_param for e in fn.extras}}
        names = [e.name for e in fn.extras]  # every condition met: params > 0, every aux sent
        common = dict(function=fn.name, params=params, reduction="sum", token_extras=names,
                      gradient_id=(f"extras-{fn.name}", 0, 0), aux=aux_for(fn, x, g))
        if fn.needs_teacher:
            common.update(teacher="extras-teacher", teacher_hidden=xt)
        result = client.forward_backward("extras-student", x, t, **common)
        client.zero_gradients("extras-student")
        if sorted(result.token_extras) != sorted(names):
            failures.append(f"{fn.name}: token_extras {sorted(result.token_extras)} != {names}")
        if sorted(result.summary.extras) != sorted(names):
            failures.append(f"{fn.name}: the summary reports {sorted(result.summary.extras)}, "
                            f"the listing {sorted(names)}")
        for name, values in result.token_extras.items():
            if values.shape != (N,) or values.dtype != torch.float64:
                failures.append(f"{fn.name} {name}: {values.dtype} {tuple(values.shape)}")
                continue
            if not torch.all(values[t == -100] == 0):
                failures.append(f"{fn.name} {name}: not 0 at ignored rows")
            error = numerics.relative_error(values.sum().item(), result.summary.extras[name],
                                            floor=values.abs().sum().item())
            if not error <= 1e-12:
                failures.append(f"{fn.name} {name}: sum off by {error:.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("function,params", [
    ("distill_kl", {"temperature": 0.8, "softcap": 4.0, "alpha": 0.3}),
    ("distill_jsd", {"beta": 0.3, "teacher_logit_scale": 1.4}),
    ("distill_reverse_kl", {"logit_scale": 0.7, "teacher_softcap": 2.0, "alpha": 0.5}),
])
def test_a_distillations_divergence_entropy_and_nll_per_token(client, heads, function, params):
    ws, bs, wt = heads
    x, xt, t = rows(2)
    _, expected = ref.per_token(function, params, ref.logits(x, ws, bs), ref.logits(xt, wt), t)
    names = sorted(expected)
    common = dict(function=function, params=params, teacher="extras-teacher",
                  teacher_hidden=xt, token_extras=names)
    fused = client.forward_backward("extras-student", x, t, reduction="mean",
                                    gradient_id=("extras-distill", 0, 0), **common)
    forward = client.forward("extras-student", x, t, reduction="none", retain_inputs_seconds=60,
                             **common)
    backward = client.backward("extras-student", x, t, torch.ones(N, dtype=torch.float64),
                               reduction="none", gradient_id=("extras-distill", 0, 1),
                               inputs_handle=forward.summary.inputs_handle,
                               **{k: v for k, v in common.items() if k != "teacher_hidden"})
    client.zero_gradients("extras-student")
    for mode, result in (("fused", fused), ("forward", forward), ("backward", backward)):
        assert sorted(result.token_extras) == names, mode
        for name in names:
            assert numerics.close(result.token_extras[name], expected[name], 1e-12), (mode, name)

    # RemoteHead.distill: the extras of its call are in last_result; float32 rows for float32
    # hidden (the server computes in the head's dtype: hidden goes over as float64).
    head = remotehead.RemoteHead(client, "extras-student", teacher="extras-teacher",
                                 wire_dtype=torch.float64)
    hidden = x.float().requires_grad_()
    loss = head.distill(hidden, xt, t, function=function, params=params, token_extras=("entropy",))
    loss.backward()
    client.zero_gradients("extras-student")
    entropy = head.last_result.token_extras["entropy"]
    assert entropy.dtype == torch.float32
    assert numerics.close(entropy, expected["entropy"], 1e-6)


def test_a_name_the_call_does_not_report_is_refused_naming_it(client, heads):
    x, xt, t = rows(3)
    before = client.describe_head("extras-student").accumulated_micro_batches
    common = dict(function="distill_kl", teacher="extras-teacher", teacher_hidden=xt,
                  reduction="sum", gradient_id=("extras-refused", 0, 0))
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        client.forward_backward("extras-student", x, t, token_extras=["entropy", "nll"], **common)
    assert refused.value.metadata.get("field") == "token_extras[1]"
    assert ('expected one of the extras function distill_kl reports (divergence, entropy); got '
            '"nll", reported only with params["alpha"] > 0') in str(refused.value)
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        client.forward("extras-student", x, t, function="token_logprobs",
                       token_extras=["entropy"])
    assert refused.value.metadata.get("field") == "token_extras[0]"
    assert client.describe_head("extras-student").accumulated_micro_batches == before


def test_the_cli_lists_each_functions_extras(server_target):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client" / "python")}
    out = subprocess.run([sys.executable, "-m", "remotehead.cli", "--server", server_target,
                          "--json", "functions"], capture_output=True, text=True, env=env,
                         check=True, timeout=60).stdout
    listed = {f["name"]: f["extras"] for f in json.loads(out)}
    assert {e["name"]: e["when_param"] for e in listed["cross_entropy"]} == {
        "nll": "", "z_loss": "z_loss"}
    assert {e["name"]: e["when_aux"] for e in listed["grpo"]} == {
        "kl": "ref_logprobs", "clipped": ""}
    assert sorted(e["name"] for e in listed["distill_jsd"]) == ["divergence", "entropy", "nll"]
    text = subprocess.run([sys.executable, "-m", "remotehead.cli", "--server", server_target,
                           "functions"], capture_output=True, text=True, env=env, check=True,
                          timeout=60).stdout
    assert "extra nll (when alpha > 0): the hard-label cross-entropy at temperature 1" in text
