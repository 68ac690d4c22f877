"""Distillation on the real server: a trainable student head and a frozen teacher head side by
side (issue 30), through the Python client, against plain PyTorch over full logits
(tests/python/distill_reference.py).

- Two-head functions (distill_kl, distill_reverse_kl, distill_jsd), every alpha (0; 0.4 with
  targets), default and non-default params (logit scale, softcap and temperature on the student;
  the teacher's scale and softcap; beta), both heads with a bias, D_teacher ≠ D, targets with
  ignored rows or none, two chunk sizes: Forward "none" (outputs), fused sum (with a
  normalizer), mean and weighted_sum (loss, dX, dW, db, extras), two-phase by inputs handle
  (per-token dL/dy) and scalar (mean): dX, dW. float64 heads to 1e-12 relative (dW and db
  too: a float64 head accumulates in float64), fp32 heads to 1e-5. The teacher accumulates
  nothing and is left bit-identical; it lists the student in teacher_of.
- Sparse top-k (distill_topk_kl / distill_topk_reverse_kl): tail 0 and 1, alpha 0 and 0.5,
  ids int64 and int32, [B, T, k] aux beside [B, T, D] hidden: against the documented
  (k + 1)-bucket / renormalised formulas.
- Autograd (RemoteHead.distill, token_outputs): dX reaches the student's hidden states only
  (a teacher_hidden that requires grad gets none), dW the student's head; the mask argument.
- Data-parallel scaling as for the remote loss: two ranks (threads, each its own client and
  RemoteHead with a Cluster of 2) with the TRL-style per-rank normaliser (global count / W)
  and a synchronous SGD step equal one process over the whole batch.
- Bad inputs raise the exception of their reason, naming the field.
- The example (client/python/examples/distill_tiny_llama.py) runs against the server and its
  per-step losses equal the same run with both heads local (fp32, 1e-4).
Against TRL's own chunked loss: test_distillation_trl_loss.py. Head groups of 2 and 3 are in
test_distillation_groups.py.
"""

import contextlib
import math
import pathlib
import sys
import threading

import pytest
import torch

import distill_reference as ref
import numerics
import remotehead
from remotehead.cluster import Cluster
from remotehead.v1 import head_service_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
V, D, DT, N = 131, 16, 24, 37
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
GRAD_TOLERANCE = TOLERANCE  # dW / db: accumulated in the head's dtype (float64 for float64)
VARIED = {"temperature": 0.7, "logit_scale": 1.3, "softcap": 4.0, "teacher_logit_scale": 0.8,
          "teacher_softcap": 3.0}


@pytest.fixture(scope="module")
def client(server_target):
    # Small messages: every step's rows (and the teacher's) travel in several row messages.
    with remotehead.Client(server_target, chunk_bytes=4096) as c:
        yield c


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


@pytest.fixture(scope="module")
def heads(client):
    """A student and a frozen teacher (both with a bias, D_teacher = 24 ≠ D = 16) per dtype."""
    made = {}
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(7)
        ws = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
        bs = (0.3 * torch.randn(V, generator=g)).to(dtype)
        wt = (1.5 * torch.randn(V, DT, generator=g) / DT**0.5).to(dtype)
        bt = (0.3 * torch.randn(V, generator=g)).to(dtype)
        student, teacher = f"student-{dtype_name(dtype)}", f"teacher-{dtype_name(dtype)}"
        client.upload_head(student, ws, bs)
        info = client.upload_head(teacher, wt, bt, frozen=True)
        assert info.frozen and not client.describe_head(student).frozen
        made[dtype] = (student, teacher, ws, bs, wt, bt)
    yield made
    for student, teacher, *_ in made.values():
        client.drop_head(student)
        client.drop_head(teacher)


def inputs(dtype, seed, targets="masked"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    xt = torch.randn(N, DT, generator=g).to(dtype)
    t = None
    if targets == "masked":
        t = torch.randint(0, V, (N,), generator=g)
        t[::4] = -100
    weights = torch.rand(N, generator=g).to(dtype)
    grad_output = torch.randn(N, generator=g).to(dtype)
    return x, xt, t, weights, grad_output


class Problems(list):
    def check(self, what, actual, expected, rel, floor=0.0):
        error = numerics.relative_error(actual, expected, floor)
        if not error <= rel:
            self.append(f"{what}: relative error {error:.3g} > {rel}")


def reference(function, params, x, xt, t, ws, bs, wt, bt):
    """(y, extras, x64, w64, b64) with y differentiable in x64, w64 and b64."""
    x64 = x.to(torch.float64).requires_grad_()
    w64 = ws.to(torch.float64).requires_grad_()
    b64 = bs.to(torch.float64).requires_grad_()
    zs = ref.logits(x64, w64, b64)
    zt = ref.logits(xt, wt, bt)
    y, extras = ref.per_token(function, params, zs, zt, t)
    return y, extras, x64, w64, b64


def grads(y_total, *tensors):
    return torch.autograd.grad(y_total, tensors, retain_graph=True)


def fetch(client, head_id):
    dw, db, info = client.fetch_gradients(head_id)
    client.zero_gradients(head_id)
    return dw, db, info


def two_head_case(client, heads, dtype, function, alpha, params, chunk_rows, targets, seed):
    student, teacher, ws, bs, wt, bt = heads[dtype]
    rel, grad_rel = TOLERANCE[dtype], GRAD_TOLERANCE[dtype]
    x, xt, t, weights, grad_output = inputs(dtype, seed, targets)
    params = {**params, "alpha": alpha}
    y, extras, x64, w64, b64 = reference(function, params, x, xt, t, ws, bs, wt, bt)
    valid = int((t != -100).sum()) if t is not None else N
    problems = Problems()
    common = dict(function=function, params=params, teacher=teacher, teacher_hidden=xt,
                  chunk_rows=chunk_rows)
    ids = iter(range(1000))

    def gid():
        return (f"distill-{seed}", 0, next(ids))

    def check_extras(what, got):
        expected = {k: v.sum().item() for k, v in extras.items()}
        if set(got) != set(expected):
            problems.append(f"{what} extras: {sorted(got)} != {sorted(expected)}")
        for k in expected.keys() & got.keys():
            problems.check(f"{what} extras[{k}]", got[k], expected[k], rel,
                           floor=extras[k].abs().sum().item())

    forward = client.forward(student, x, t, reduction="none", **common)
    problems.check("forward outputs", forward.outputs, y.detach(), rel)
    check_extras("forward", forward.summary.extras)

    for reduction, normalizer in (("sum", 13.0), ("mean", None), ("weighted_sum", None)):
        total = ref.reduce(y, reduction, valid, weights, normalizer)
        gx, gw, gb = grads(total, x64, w64, b64)
        fused = client.forward_backward(student, x, t, reduction=reduction,
                                        normalizer=normalizer, gradient_id=gid(),
                                        weights=weights if reduction == "weighted_sum" else None,
                                        **common)
        what = f"fused {reduction}"
        problems.check(f"{what} loss", fused.loss, total.item(), rel,
                       floor=ref.reduce(y.abs(), reduction, valid, weights.abs(),
                                        normalizer).item())
        problems.check(f"{what} dX", fused.grad_hidden, gx, rel)
        if fused.grad_hidden.dtype != dtype:
            problems.append(f"{what} dX dtype {fused.grad_hidden.dtype}")
        check_extras(what, fused.summary.extras)
        dw, db, _ = fetch(client, student)
        problems.check(f"{what} dW", dw, gw, grad_rel)
        problems.check(f"{what} db", db, gb, grad_rel)

    # Two-phase: per-token dL/dy by inputs handle (only dL/dy travels the second time).
    gx, gw, gb = grads((y * grad_output.to(torch.float64)).sum(), x64, w64, b64)
    first = client.forward(student, x, t, reduction="none", retain_inputs_seconds=60, **common)
    if not first.summary.inputs_handle:
        problems.append("two-phase: no inputs handle")
    back = client.backward(student, x, t, grad_output, reduction="none", gradient_id=gid(),
                           inputs_handle=first.summary.inputs_handle,
                           **{k: v for k, v in common.items() if k != "teacher_hidden"})
    problems.check("two-phase dX", back.grad_hidden, gx, rel)
    dw, db, _ = fetch(client, student)
    problems.check("two-phase dW", dw, gw, grad_rel)
    problems.check("two-phase db", db, gb, grad_rel)

    # Two-phase with a scalar reduction, the rows sent again: dL/d(loss) = 0.5.
    total = ref.reduce(y, "mean", valid)
    gx, gw, _ = grads(0.5 * total, x64, w64, b64)
    loss = client.forward(student, x, t, reduction="mean", **common)
    problems.check("two-phase mean loss", loss.loss, total.item(), rel,
                   floor=ref.reduce(y.abs(), "mean", valid).item())
    back = client.backward(student, x, t, 0.5, reduction="mean", gradient_id=gid(), **common)
    problems.check("two-phase mean dX", back.grad_hidden, gx, rel)
    dw, _, _ = fetch(client, student)
    problems.check("two-phase mean dW", dw, gw, grad_rel)
    return problems


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_name)
def test_two_head_functions_match_full_logits(client, heads, registry, dtype):
    student, teacher, _, _, wt, bt = heads[dtype]
    for name in ref.TWO_HEAD:
        fn = registry[name]
        assert fn.needs_teacher and not fn.needs_targets and fn.differentiable, fn
    failures, seed = [], 0
    for function in ref.TWO_HEAD:
        for alpha in (0.0, 0.4):
            for label, params in (("defaults", {}),
                                  ("varied", {**VARIED, "beta": 0.3}
                                   if function == "distill_jsd" else VARIED)):
                for chunk_rows in (0, 5):
                    targets = "none" if alpha == 0 and chunk_rows else "masked"
                    try:
                        problems = two_head_case(client, heads, dtype, function, alpha, params,
                                                 chunk_rows, targets, seed)
                    except Exception as e:  # this case's failure, with the others still run
                        problems = [f"{type(e).__name__}: {e}"]
                    failures += [f"{function} alpha={alpha} {label} chunk_rows={chunk_rows} "
                                 f"targets={targets}: {p}" for p in problems]
                    seed += 1
    assert not failures, "\n".join(failures)
    info = client.describe_head(teacher)
    assert info.frozen and info.accumulated_micro_batches == 0
    assert student in info.teacher_of
    w, b = client.export_weights(teacher)
    assert torch.equal(w, wt) and torch.equal(b, bt)  # the teacher is never touched


def test_jsd_at_beta_zero_and_one_is_the_kl(client, heads):
    """distill_jsd with beta 0 / 1 is distill_kl / distill_reverse_kl (TRL's beta)."""
    student, teacher, *_ = heads[torch.float64]
    x, xt, t, *_ = inputs(torch.float64, 99)
    for beta, same in ((0.0, "distill_kl"), (1.0, "distill_reverse_kl")):
        common = dict(teacher=teacher, teacher_hidden=xt, reduction="none")
        jsd = client.forward(student, x, t, function="distill_jsd", params={"beta": beta},
                             **common)
        kl = client.forward(student, x, t, function=same, **common)
        assert numerics.close(jsd.outputs, kl.outputs, 1e-12), beta


# ----- sparse top-k -----

def sparse_inputs(dtype, seed, k=6, shape=(N,)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, D, generator=g).to(dtype)
    # A teacher distribution of its own over V: its k most likely ids and their log-probs.
    teacher_logp = torch.log_softmax(2.0 * torch.randn(*shape, V, generator=g,
                                                       dtype=torch.float64), -1)
    lp, ids = teacher_logp.topk(k, dim=-1)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[::5] = -100
    return x, ids, lp.to(dtype), t


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_name)
def test_sparse_topk_matches_the_documented_formula(client, heads, registry, dtype):
    student, _, ws, bs, _, _ = heads[dtype]
    rel, grad_rel = TOLERANCE[dtype], GRAD_TOLERANCE[dtype]
    for name in ref.SPARSE:
        fn = registry[name]
        assert not fn.needs_teacher and fn.required_aux == ("teacher_topk_ids",
                                                            "teacher_topk_logprobs"), fn
        assert set(fn.topk_aux) == {"teacher_topk_ids", "teacher_topk_logprobs"}
        assert fn.integral_aux == ("teacher_topk_ids",)
    failures, seed = [], 100
    for function in ref.SPARSE:
        for tail in (0.0, 1.0):
            for alpha in (0.0, 0.5):
                for ids_dtype, shape in ((torch.int64, (N,)), (torch.int32, (4, 9))):
                    seed += 1
                    x, ids, lp, t = sparse_inputs(dtype, seed, shape=shape)
                    params = {"tail": tail, "alpha": alpha, **({"temperature": 0.8,
                                                               "logit_scale": 1.2,
                                                               "softcap": 5.0}
                                                              if seed % 2 else {})}
                    aux = {"teacher_topk_ids": ids.to(ids_dtype), "teacher_topk_logprobs": lp}
                    label = f"{function} tail={tail} alpha={alpha} ids {ids_dtype} {shape}"
                    x2 = x.reshape(-1, D)
                    x64 = x2.to(torch.float64).requires_grad_()
                    w64 = ws.to(torch.float64).requires_grad_()
                    y, extras = ref.per_token(
                        function, params, ref.logits(x64, w64, bs), targets=t.reshape(-1),
                        aux={k: v.reshape(x2.shape[0], -1) for k, v in aux.items()})
                    total = y.sum()
                    gx, gw = torch.autograd.grad(total, (x64, w64))
                    problems = Problems()
                    try:
                        out = client.forward(student, x, t, function=function, params=params,
                                             aux=aux, reduction="none")
                        problems.check("outputs", out.outputs.reshape(-1), y.detach(), rel)
                        fused = client.forward_backward(student, x, t, function=function,
                                                        params=params, aux=aux,
                                                        reduction="sum",
                                                        gradient_id=("sparse", seed, 0))
                        problems.check("loss", fused.loss, total.item(), rel,
                                       floor=y.abs().sum().item())
                        problems.check("dX", fused.grad_hidden.reshape(-1, D), gx, rel)
                        for k, v in extras.items():
                            problems.check(f"extras[{k}]", fused.summary.extras.get(k, math.nan),
                                           v.sum().item(), rel, floor=v.abs().sum().item())
                        dw, _, _ = fetch(client, student)
                        problems.check("dW", dw, gw, grad_rel)
                    except Exception as e:
                        problems.append(f"{type(e).__name__}: {e}")
                    failures += [f"{label}: {p}" for p in problems]
    assert not failures, "\n".join(failures)


# ----- autograd -----

def test_remote_head_distill_gives_dx_to_the_student_only(client, heads):
    student, teacher, ws, bs, wt, bt = heads[torch.float32]
    g = torch.Generator().manual_seed(5)
    body = torch.nn.Linear(8, D)  # a "student body": dX must reach its parameters
    tokens = torch.randn(2, 6, 8, generator=g)
    teacher_hidden = torch.randn(2, 6, DT, generator=g, requires_grad=True)  # not detached
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    head = remotehead.RemoteHead(client, student, teacher=teacher, trainer="autograd")
    hidden = body(tokens)
    loss = head.distill(hidden, teacher_hidden, mask=mask, function="distill_jsd",
                        params={"beta": 0.3, "temperature": 0.9})
    loss.backward()
    assert teacher_hidden.grad is None
    assert body.weight.grad is not None and body.weight.grad.abs().sum() > 0

    x64 = body(tokens).detach().reshape(-1, D).to(torch.float64).requires_grad_()
    w64 = ws.to(torch.float64).requires_grad_()
    targets = torch.where(mask.reshape(-1) != 0, 0, -100)
    y, _ = ref.per_token("distill_jsd", {"beta": 0.3, "temperature": 0.9},
                         ref.logits(x64, w64, bs), ref.logits(teacher_hidden.detach()
                                                              .reshape(-1, DT), wt, bt),
                         targets)
    expected = y.sum() / (mask.sum())
    assert numerics.close(loss.item(), expected.item(), 1e-5)
    gx, gw = torch.autograd.grad(expected, (x64, w64))
    dw, _, info = fetch(client, student)
    assert info.accumulated_micro_batches == 1
    assert numerics.close(dw, gw, 1e-5)
    assert client.describe_head(teacher).accumulated_micro_batches == 0

    # Two-phase: per-token divergences, combined here, dL/dy back to the server.
    hidden = body(tokens)
    per_token = head.token_outputs(hidden, targets.reshape(2, 6), function="distill_kl",
                                   teacher_hidden=teacher_hidden)
    assert per_token.shape == (2, 6)
    (per_token * torch.arange(12.0).reshape(2, 6)).sum().backward()
    assert teacher_hidden.grad is None
    y, _ = ref.per_token("distill_kl", {}, ref.logits(x64, w64, bs),
                         ref.logits(teacher_hidden.detach().reshape(-1, DT), wt, bt), targets)
    assert numerics.close(per_token.detach().reshape(-1), y.detach(), 1e-5)
    dw, _, _ = fetch(client, student)
    gw = torch.autograd.grad((y * torch.arange(12.0, dtype=torch.float64)).sum(), w64)[0]
    assert numerics.close(dw, gw, 1e-5)

    # Without gradients: a Forward, nothing accumulated; the teacher's dtype is the head's.
    with torch.no_grad():
        head.distill(body(tokens), teacher_hidden.double(), mask=mask)
    assert client.describe_head(student).accumulated_micro_batches == 0


def test_two_ranks_scale_like_ddp(client):
    """Two data-parallel ranks (threads, each with its own client and RemoteHead of a 2-process
    Cluster): each rank's loss is its sum / (global count / 2), as TRL's DistillationTrainer
    normalises; the synchronous SGD step averages the ranks' dW — the same new head as one
    process over the whole batch with sum / global count."""
    g = torch.Generator().manual_seed(11)
    ws, wt = torch.randn(V, D, generator=g) / 4, torch.randn(V, DT, generator=g) / 5
    x = torch.randn(2, 10, D, generator=g)
    xt = torch.randn(2, 10, DT, generator=g)
    mask = (torch.rand(2, 10, generator=g) > 0.3).long()
    total = int(mask.sum())
    client.upload_head("ddp-teacher", wt, frozen=True)
    for head_id in ("ddp-student", "one-student"):
        client.upload_head(head_id, ws)
    target = client.target
    try:
        one = remotehead.RemoteHead(client, "one-student", teacher="ddp-teacher")
        whole = x.reshape(20, D).clone().requires_grad_()
        loss = one.distill(whole, xt.reshape(20, DT), mask=mask.reshape(20), reduction="sum",
                           normalizer=float(total))
        loss.backward()
        one.optimizer_step(sgd=dict(lr=0.5))

        results, errors = {}, []

        def rank(r):
            try:
                with remotehead.Client(target) as c:
                    head = remotehead.RemoteHead(c, "ddp-student", teacher="ddp-teacher",
                                                 cluster=Cluster(r, 2), trainer="ddp")
                    h = x[r].clone().requires_grad_()
                    rank_loss = head.distill(h, xt[r], mask=mask[r], reduction="sum",
                                             normalizer=total / 2)
                    rank_loss.backward()
                    head.optimizer_step(sgd=dict(lr=0.5))
                    results[r] = (rank_loss.item(), h.grad, head.info.weight_version)
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        # DDP's average of the ranks' losses is the global token mean.
        assert numerics.close((results[0][0] + results[1][0]) / 2, loss.item(), 1e-5)
        # Each rank's dX is W × its share of the global mean's (DDP then averages the body).
        for r in range(2):
            assert numerics.close(results[r][1], 2 * whole.grad.reshape(2, 10, D)[r], 1e-5)
        assert results[0][2] == results[1][2] == 1
        w_ddp, _ = client.export_weights("ddp-student")
        w_one, _ = client.export_weights("one-student")
        assert numerics.close(w_ddp, w_one, 1e-6)
        assert not torch.equal(w_one, ws)
    finally:
        for head_id in ("ddp-student", "one-student", "ddp-teacher"):
            client.drop_head(head_id)


# ----- the request rules (no server) -----

def test_teacher_rows_and_topk_aux_travel_with_the_rows():
    """The header names the teacher; teacher_hidden [..., D_teacher] and [..., k] aux inputs are
    split with hidden's rows, and the row plan counts their bytes (the C++ client's rule: k
    values per row for an [N, k] aux, D_teacher for the teacher's rows, one more tensor each);
    a Backward by inputs handle sends neither."""
    from remotehead._steps import BACKWARD, FORWARD_BACKWARD, prepare_step
    from remotehead.client import framing_bytes
    rows = 20
    hidden = torch.randn(4, 5, D)
    aux = {"teacher_topk_ids": torch.randint(0, V, (4, 5, 5)),
           "teacher_topk_logprobs": torch.randn(4, 5, 5).double()}
    options = remotehead.StepOptions(function="distill_kl", teacher="t", reduction="sum")
    p = prepare_step(FORWARD_BACKWARD, "s", hidden, None, None, aux, None, options, 2048,
                     torch.randn(4, 5, DT).half())
    assert p.header.teacher_head_id == "t"
    per_row = D * 4 + DT * 2 + 5 * 8 + 5 * 8
    names = len("teacher_topk_ids") + len("teacher_topk_logprobs")
    per_message = (2048 - framing_bytes(4, names)) // per_row
    assert [count for _, count in p.chunks] == [per_message] * (rows // per_message) + (
        [rows % per_message] if rows % per_message else [])
    messages = list(p.messages())[1:]
    first = messages[0].rows
    assert list(first.teacher_hidden.shape) == [per_message, DT]
    assert first.teacher_hidden.dtype == pb.DTYPE_FLOAT16
    assert list(first.aux["teacher_topk_ids"].shape) == [per_message, 5]
    assert first.aux["teacher_topk_ids"].dtype == pb.DTYPE_INT64
    assert all(m.ByteSize() <= 2048 for m in messages)
    by_handle = prepare_step(BACKWARD, "s", hidden, None, None, aux, torch.ones(rows),
                             options.replace(reduction="none", inputs_handle="h"), 2048,
                             torch.randn(4, 5, DT))
    assert by_handle.teacher_hidden is None and not by_handle.aux
    assert by_handle.header.teacher_head_id == "t"
    # One value per row stays [N] whatever its shape; a [N, k] per-token aux is k per row.
    p = prepare_step(FORWARD_BACKWARD, "s", hidden, None, None,
                     {"advantages": torch.randn(20), "x": torch.randn(4, 5, 1)}, None,
                     options, 2048)
    assert [tuple(t.shape) for _, t in p.aux] == [(20,), (20, 1)]


# ----- bad inputs -----

@contextlib.contextmanager
def refused(cls, *names, reason=None, field=None):
    with pytest.raises(cls) as caught:
        yield
    error = caught.value
    for name in names:
        assert name in error.details, (name, error.details)
    if reason is not None:
        assert error.reason == reason, error
    if field is not None:
        assert error.metadata.get("field") == field, error.metadata


def test_bad_inputs_raise_the_reasons_exception_naming_the_field(client):
    g = torch.Generator().manual_seed(3)
    ws = torch.randn(V, D, generator=g)
    wt = torch.randn(V, DT, generator=g)
    client.upload_head("bad-student", ws)
    client.upload_head("bad-teacher", wt, frozen=True)
    client.upload_head("bad-unfrozen", wt)
    client.upload_head("bad-vocab", torch.randn(V + 1, DT, generator=g), frozen=True)
    x, xt = torch.randn(N, D, generator=g), torch.randn(N, DT, generator=g)

    def step(**kw):
        args = dict(function="distill_kl", teacher="bad-teacher", teacher_hidden=xt,
                    reduction="sum", gradient_id=("bad", 0, 0))
        args.update(kw)
        return client.forward_backward("bad-student", x, None, **args)

    try:
        with refused(remotehead.InvalidArgumentError, "teacher_head_id",
                     field="header.teacher_head_id"):
            step(teacher="")  # a two-head function without its teacher
        with refused(remotehead.TeacherIncompatibleError, "frozen", "bad-unfrozen",
                     reason="TEACHER_INCOMPATIBLE", field="frozen"):
            step(teacher="bad-unfrozen")
        with refused(remotehead.TeacherIncompatibleError, "vocab_size",
                     reason="TEACHER_INCOMPATIBLE", field="vocab_size"):
            step(teacher="bad-vocab")
        with refused(remotehead.HeadNotFoundError, "teacher_head_id"):
            step(teacher="no-such-head")
        with refused(remotehead.InvalidArgumentError, "teacher_hidden"):
            step(teacher_hidden=None)
        with refused(remotehead.InvalidArgumentError, "teacher_hidden", field="teacher_hidden"):
            step(teacher_hidden=torch.randn(N, DT + 1))  # the teacher's D is 24
        with refused(remotehead.InvalidArgumentError, "teacher_hidden", "float32"):
            step(teacher_hidden=xt.double())  # the teacher head's dtype is float32
        with refused(remotehead.InvalidArgumentError, "teacher_hidden", "rows",
                     field="teacher_hidden"):
            step(teacher_hidden=xt[:5])  # refused here: the rows travel with hidden's
        with refused(remotehead.InvalidArgumentError, "teacher_head_id"):
            step(function="cross_entropy")  # a one-head function with a teacher
        with refused(remotehead.InvalidArgumentError, "targets", "alpha"):
            step(params={"alpha": 0.5})  # the CE mix needs targets
        with refused(remotehead.HeadFrozenError, "frozen", reason="HEAD_FROZEN"):
            client.forward_backward("bad-teacher", xt, None, function="entropy",
                                    reduction="sum", gradient_id=("bad", 0, 1))
        with refused(remotehead.HeadFrozenError, "frozen", reason="HEAD_FROZEN"):
            client.optimizer_step("bad-teacher", sgd=dict(lr=0.1))
        ids = torch.randint(0, V, (N, 4), generator=g)
        lp = torch.full((N, 4), -3.0)
        with refused(remotehead.InvalidArgumentError, "teacher_topk_ids"):
            client.forward("bad-student", x, None, function="distill_topk_kl",
                           aux={"teacher_topk_ids": ids.float(), "teacher_topk_logprobs": lp})
        with refused(remotehead.InvalidArgumentError, "teacher_topk_logprobs"):
            client.forward("bad-student", x, None, function="distill_topk_kl",
                           aux={"teacher_topk_ids": torch.arange(4).repeat(N, 1),
                                "teacher_topk_logprobs": lp + 4})
        with refused(remotehead.InvalidArgumentError, 'aux["teacher_topk_ids"]', "[37, k]"):
            client.forward("bad-student", x, None, function="distill_topk_kl",
                           aux={"teacher_topk_ids": ids[:N - 1], "teacher_topk_logprobs": lp})
        created = client.create_head("bad-created", V, DT, frozen=True)
        assert created.frozen and client.describe_head("bad-created").frozen
        client.drop_head("bad-created")
        # The frozen teacher still serves Forwards and steps without dW.
        client.forward_backward("bad-teacher", xt, None, function="entropy", reduction="sum",
                                accumulate=False)
        assert client.describe_head("bad-teacher").weight_version == 0
        # RemoteHead sends teacher_hidden in the teacher head's dtype whatever the caller's.
        head = remotehead.RemoteHead(client, "bad-student", teacher="bad-teacher")
        head.distill(x.requires_grad_(), xt.double())
    finally:
        for head_id in ("bad-student", "bad-teacher", "bad-unfrozen", "bad-vocab"):
            client.drop_head(head_id)


# ----- the example -----

def test_the_distillation_example_runs_and_equals_local_heads(server_target):
    sys.path.insert(0, str(ROOT / "client" / "python" / "examples"))
    try:
        import distill_tiny_llama as example
    finally:
        sys.path.pop(0)
    remote = example.run(example.parse_args(["--server", server_target, "--steps", "4"]))
    local = example.run(example.parse_args(["--steps", "4"]))
    assert len(remote["losses"]) == len(local["losses"]) == 4
    for step, (a, b) in enumerate(zip(remote["losses"], local["losses"])):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    assert remote["losses"][-1] < remote["losses"][0]
    assert remote["head_version"] == 4
    assert remote["trainer_head_bytes"] <= 8  # neither model holds a W (one element each)
    assert local["trainer_head_bytes"] == 257 * (32 + 48) * 4
