"""Distillation on head groups of 2 and 3 server processes (one head split by vocabulary rows,
Gloo on loopback) against one server: the student and its frozen teacher uploaded to both, every
distillation function the server lists (two-head and sparse top-k), non-default params and alpha
with targets: a Forward's per-token outputs and extras, a fused sum's loss, dX and dW (fetched
from the group, every rank's rows) with every extra row by row (token_extras), and a two-phase
Backward by inputs handle — float64 heads,
to 1e-12 relative (dW too: a float64 accumulator), and against the full-logits reference.
The teacher accumulates nothing on any rank and lists the student in teacher_of."""

import os
import pathlib

import pytest
import torch

import distill_reference as ref
import numerics
import remotehead
from remotehead.local_server import LocalHeadGroup

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
V, D, DT, N, K = 131, 16, 24, 29, 5
PARAMS = {
    "distill_kl": {"temperature": 0.8, "softcap": 4.0, "teacher_logit_scale": 1.2},
    "distill_reverse_kl": {"logit_scale": 0.9, "teacher_softcap": 3.0, "alpha": 0.3},
    "distill_jsd": {"beta": 0.3, "temperature": 1.1, "alpha": 0.2},
    "distill_topk_kl": {"tail": 0.0, "alpha": 0.3, "temperature": 0.8},
    "distill_topk_reverse_kl": {"tail": 1.0, "softcap": 5.0},
}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda k: f"group{k}")
def group_target(request):
    group = LocalHeadGroup(BINARY, size=request.param,
                           args=("--device=cpu", "--torch_threads=1")).start()
    yield group.target, request.param
    codes = group.stop()
    assert codes == [0] * request.param, "".join(line for r in group.ranks for line in r.log)


def data():
    g = torch.Generator().manual_seed(21)
    ws = torch.randn(V, D, generator=g, dtype=torch.float64) / 4
    bs = 0.2 * torch.randn(V, generator=g, dtype=torch.float64)
    wt = torch.randn(V, DT, generator=g, dtype=torch.float64) / 4
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    xt = torch.randn(N, DT, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    t[::6] = -100
    lp, ids = torch.log_softmax(2 * torch.randn(N, V, generator=g, dtype=torch.float64),
                                -1).topk(K, dim=-1)
    grad_output = torch.randn(N, generator=g, dtype=torch.float64)
    return ws, bs, wt, x, xt, t, ids, lp, grad_output


def run(client, function, fn, x, xt, t, ids, lp, grad_output, tag):
    """Forward outputs, fused sum (loss, dX, dW), two-phase dX and dW of `function`."""
    common = dict(function=function, params=PARAMS[function])
    if fn.needs_teacher:
        common.update(teacher="teacher", teacher_hidden=xt)
    else:
        common["aux"] = {"teacher_topk_ids": ids, "teacher_topk_logprobs": lp}
    forward = client.forward("student", x, t, reduction="none", **common)
    # Every extra the call reports, row by row (the group's front returns its combined values).
    names = [e.name for e in fn.extras if not e.when_param or PARAMS[function].get(e.when_param)]
    fused = client.forward_backward("student", x, t, reduction="sum",
                                    gradient_id=(tag, 0, 0), token_extras=names, **common)
    dw, db, _ = client.fetch_gradients("student")
    client.zero_gradients("student")
    first = client.forward("student", x, t, reduction="none", retain_inputs_seconds=60, **common)
    back = client.backward("student", x, t, grad_output, reduction="none",
                           inputs_handle=first.summary.inputs_handle, gradient_id=(tag, 1, 0),
                           **{k: v for k, v in common.items() if k != "teacher_hidden"})
    dw2, _, _ = client.fetch_gradients("student")
    client.zero_gradients("student")
    return dict(outputs=forward.outputs, extras=forward.summary.extras, loss=fused.loss,
                dx=fused.grad_hidden, dw=dw, db=db, dx2=back.grad_hidden, dw2=dw2,
                token_extras=fused.token_extras)


def test_every_distillation_function_on_a_group_equals_one_server(server_target, group_target):
    target, size = group_target
    ws, bs, wt, x, xt, t, ids, lp, grad_output = data()
    with remotehead.Client(server_target) as single, remotehead.Client(target) as group:
        functions = [f for f in group.functions().values()
                     if f.needs_teacher or f.topk_aux]
        assert sorted(f.name for f in functions) == sorted(PARAMS), functions
        assert all(f.vocab_decomposable for f in functions)
        for c in (single, group):
            c.upload_head("student", ws, bs)
            c.upload_head("teacher", wt, frozen=True)
        info = group.describe_head("teacher")
        assert info.group_size == size and info.frozen
        assert info.shards == group.describe_head("student").shards
        failures = []
        try:
            for fn in functions:
                a = run(single, fn.name, fn, x, xt, t, ids, lp, grad_output, f"one-{fn.name}")
                b = run(group, fn.name, fn, x, xt, t, ids, lp, grad_output, f"grp-{fn.name}")
                # The reference, for the single server's (and so the group's) numbers.
                x64 = x.clone().requires_grad_()
                w64 = ws.clone().requires_grad_()
                y, ref_extras = ref.per_token(fn.name, PARAMS[fn.name], ref.logits(x64, w64, bs),
                                     ref.logits(xt, wt), t,
                                     {"teacher_topk_ids": ids, "teacher_topk_logprobs": lp})
                gx, gw = torch.autograd.grad(y.sum(), (x64, w64))
                checks = [("outputs", b["outputs"], a["outputs"], 1e-12),
                          ("loss", b["loss"], a["loss"], 1e-12),
                          ("dX", b["dx"], a["dx"], 1e-12),
                          ("two-phase dX", b["dx2"], a["dx2"], 1e-12),
                          ("dW", b["dw"], a["dw"], 1e-12), ("db", b["db"], a["db"], 1e-12),
                          ("two-phase dW", b["dw2"], a["dw2"], 1e-12),
                          ("reference outputs", a["outputs"], y.detach(), 1e-12),
                          ("reference dX", a["dx"], gx, 1e-12),
                          ("reference dW", a["dw"], gw, 1e-12)]
                for key in a["extras"]:
                    checks.append((f"extras[{key}]", b["extras"].get(key), a["extras"][key],
                                   1e-12))
                if sorted(a["token_extras"]) != sorted(ref_extras):
                    failures.append(f"{fn.name} token_extras {sorted(a['token_extras'])} != "
                                    f"the reference's {sorted(ref_extras)}")
                for key, values in a["token_extras"].items():
                    checks.append((f"token_extras[{key}]", b["token_extras"].get(key), values,
                                   1e-12))
                    checks.append((f"reference token_extras[{key}]", values, ref_extras[key],
                                   1e-12))
                for what, actual, expected, rel in checks:
                    error = numerics.relative_error(actual, expected)
                    if not error <= rel:
                        failures.append(f"{fn.name} {what}: relative error {error:.3g} > {rel}")
            assert not failures, "\n".join(failures)
            assert group.describe_head("teacher").accumulated_micro_batches == 0
            assert "student" in group.describe_head("teacher").teacher_of
        finally:
            for c in (single, group):
                c.drop_head("student")
                c.drop_head("teacher")
