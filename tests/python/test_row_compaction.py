"""Rows that contribute nothing do not travel (StepOptions.compact_rows, on by default): for every
function the server lists with ignored_rows_contribute_nothing, a step that leaves out the rows
whose target is ignore_index and one that sends every row (compact_rows=False) give the same
bits — torch.equal on dX, per-token outputs, token extras and dW, == on the loss, the valid
tokens and the extras — for every reduction (none, sum, mean, weighted_sum), with a global
normalizer, in a fused step, a two-phase Forward + Backward and one by the Forward's retained
inputs, on a replay of the same gradient id, and on a head group of two ranks. The rows left out
are zeros in every result. The bytes the server receives shrink with the rows left out
(remotehead_received_bytes_total), and a striped step compacts too. An error names a bad row
where the caller put it — its index in the caller's rows and, for a [B, T] input, [b, t] —
compacted or not, on one server and on a group (word for word, message and metadata "field").

Each request fits one row message, so the server batches the same rows the same way in both
sends (across messages the grouping follows arrival: the striped step is compared to 1e-6).
"""

import os
import re
import urllib.request

import pytest
import torch

import numerics
import remotehead
from conftest import ROOT
from remotehead.local_server import LocalHeadGroup, LocalServer

V, D, DT, N, K = 211, 32, 24, 64, 5
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
# (reduction, normalizer): each reduction, with a caller's global normalizer where it applies.
REDUCTIONS = (("sum", 50.0), ("mean", None), ("mean", 80.0), ("weighted_sum", 50.0))


@pytest.fixture(scope="module")
def server():
    with LocalServer(BINARY, ["--device=cpu", "--metrics_address=127.0.0.1:0"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with remotehead.Client(server.target) as c:
        yield c


def upload_heads(client, student="rc", teacher="rc-teacher"):
    g = torch.Generator().manual_seed(3)
    client.upload_head(student, torch.randn(V, D, generator=g) / D**0.5,
                       torch.randn(V, generator=g) * 0.1)
    client.upload_head(teacher, torch.randn(V, DT, generator=g) / DT**0.5,
                       torch.randn(V, generator=g) * 0.1, frozen=True)
    return student, teacher


@pytest.fixture(scope="module")
def heads(client):
    yield upload_heads(client)
    for h in ("rc", "rc-teacher"):
        client.drop_head(h)


def flagged(client):
    listed = client.functions()
    assert not listed["logits"].ignored_rows_contribute_nothing
    assert not listed["sample"].ignored_rows_contribute_nothing
    names = [n for n, f in listed.items() if f.ignored_rows_contribute_nothing]
    assert {"cross_entropy", "token_logprobs", "grpo", "entropy", "distill_kl",
            "distill_topk_kl"} <= set(names), names
    return [listed[n] for n in sorted(names)]


def call_inputs(fn, teacher, seed=0, n=N):
    """Everything a step of `fn` needs, half of the targets ignored (runs of them, and single
    ones), and the token extras it reports with these inputs."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[: n // 4] = -100
    targets[n // 2::2] = -100
    aux = {}
    for name in (*fn.required_aux, *fn.optional_aux):
        if name == "teacher_topk_ids":
            aux[name] = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])
        elif name == "teacher_topk_logprobs":
            aux[name] = (torch.randn(n, K, generator=g).softmax(-1) * 0.9).log()
        elif name in fn.integral_aux:  # e.g. the sequence of each row (the policy losses)
            aux[name] = torch.randint(0, 3, (n,), generator=g)
        else:
            aux[name] = torch.randn(n, generator=g) * 0.3 - (0.5 if "logprobs" in name else 0)
    kw = {"aux": aux}
    options = {}
    if fn.needs_teacher:
        kw["teacher_hidden"] = torch.randn(n, DT, generator=g)
        options["teacher"] = teacher
    extras = tuple(e.name for e in fn.extras if not e.when_param
                   and (not e.when_aux or e.when_aux in aux))
    options["token_extras"] = extras
    return torch.randn(n, D, generator=g), targets, torch.rand(n, generator=g), kw, options


def assert_same(a, b, what):
    """Bit for bit: results (and zeros in the rows left out)."""
    for name in ("grad_hidden", "outputs", "token_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), (what, name)
        if x is not None:
            assert torch.equal(x, y), (what, name, (x - y).abs().max())
    assert a.token_extras.keys() == b.token_extras.keys(), what
    for name in a.token_extras:
        assert torch.equal(a.token_extras[name], b.token_extras[name]), (what, name)
    assert a.loss == b.loss, (what, a.loss, b.loss)
    assert a.summary.valid_tokens == b.summary.valid_tokens, what
    assert a.summary.extras == b.summary.extras, what


def dw(client, head):
    w, b, _ = client.fetch_gradients(head)
    client.zero_gradients(head)
    return w, b


def test_every_flagged_function_and_reduction_gives_the_same_bits(client, heads):
    student, teacher = heads
    for fn in flagged(client):
        hidden, targets, weights, kw, options = call_inputs(fn, teacher)
        ignored = targets == -100
        for reduction, normalizer in REDUCTIONS:
            what = (fn.name, reduction, normalizer)
            o = remotehead.StepOptions(function=fn.name, reduction=reduction,
                                       normalizer=normalizer, **options)
            w = weights if reduction == "weighted_sum" else None
            client.zero_gradients(student)
            full = client.forward_backward(student, hidden, targets, o, weights=w, **kw,
                                           compact_rows=False, gradient_id=("full", 0, 0))
            dw_full = dw(client, student)
            some = client.forward_backward(student, hidden, targets, o, weights=w, **kw,
                                           gradient_id=("some", 0, 0))
            dw_some = dw(client, student)
            assert_same(full, some, what)
            assert torch.equal(dw_full[0], dw_some[0]) and torch.equal(dw_full[1], dw_some[1])
            assert full.grad_hidden[ignored].eq(0).all(), what
            for values in full.token_extras.values():
                assert values[ignored].eq(0).all(), what

        # Per-token: a Forward, then a Backward of dL/dy (re-sending the rows).
        o = remotehead.StepOptions(function=fn.name, reduction="none", **options)
        full = client.forward(student, hidden, targets, o, compact_rows=False, **kw)
        some = client.forward(student, hidden, targets, o, **kw)
        assert_same(full, some, (fn.name, "forward"))
        assert full.outputs[ignored].eq(0).all()
        dy = torch.linspace(-1, 1, N)
        full = client.backward(student, hidden, targets, dy, o, compact_rows=False, **kw,
                               gradient_id=("full-b", 0, 0))
        dw_full = dw(client, student)
        some = client.backward(student, hidden, targets, dy, o, **kw,
                               gradient_id=("some-b", 0, 0))
        assert_same(full, some, (fn.name, "backward"))
        assert torch.equal(dw(client, student)[0], dw_full[0]), fn.name


def test_a_backward_by_handle_and_a_replay_give_the_same_bits(client, heads):
    student, _ = heads
    hidden, targets, _, _, _ = call_inputs(client.functions()["token_logprobs"], "", seed=1)
    dy = torch.linspace(-2, 1, N)
    results = {}
    # The backward by handle is given the targets or not: the client remembers what the
    # forward left out under its handle.
    for compact, backward_targets in ((False, targets), (True, targets), (True, None)):
        o = remotehead.StepOptions(function="token_logprobs", reduction="none",
                                   compact_rows=compact)
        fwd = client.forward(student, hidden, targets, o, retain_inputs_seconds=60)
        assert fwd.summary.inputs_handle
        client.zero_gradients(student)
        b = client.backward(student, hidden, backward_targets, dy, o,
                            gradient_id=("h", len(results), 0),
                            inputs_handle=fwd.summary.inputs_handle)
        results[len(results)] = (fwd, b, dw(client, student))
    f0, b0, w0 = results[0]
    for i in (1, 2):
        fi, bi, wi = results[i]
        assert_same(f0, fi, ("forward", i))
        assert_same(b0, bi, ("backward by handle", i))
        assert torch.equal(w0[0], wi[0]), i

    # A replay of one gradient id: the same answer, nothing added again.
    o = remotehead.StepOptions(function="cross_entropy", normalizer=40.0)
    first = client.forward_backward(student, hidden, targets, o, gradient_id=("replay", 0, 0))
    once, _, _ = client.fetch_gradients(student)
    again = client.forward_backward(student, hidden, targets, o, gradient_id=("replay", 0, 0))
    assert again.summary.replayed and not first.summary.replayed
    assert torch.equal(again.grad_hidden, first.grad_hidden) and again.loss == first.loss
    assert torch.equal(client.fetch_gradients(student)[0], once)
    client.zero_gradients(student)


def received_bytes(server, rpc):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                timeout=5) as r:
        text = r.read().decode()
    m = re.search(r'remotehead_received_bytes_total\{[^}]*rpc="%s"[^}]*\} (\S+)' % rpc, text)
    return float(m.group(1)) if m else 0.0


def test_the_bytes_received_shrink_with_the_rows_left_out(client, server, heads):
    student, _ = heads
    hidden, targets, _, _, _ = call_inputs(client.functions()["cross_entropy"], "", seed=2)
    kept = int((targets != -100).sum())
    sent = {}
    for compact in (False, True):
        before = received_bytes(server, "ForwardBackward")
        client.forward_backward(student, hidden, targets, accumulate=False, compact_rows=compact)
        sent[compact] = received_bytes(server, "ForwardBackward") - before
    row = D * 4 + 8
    assert sent[False] - sent[True] >= 0.9 * (N - kept) * row, (sent, kept)


def test_a_striped_step_compacts_too(client, server, heads):
    student, _ = heads
    hidden, targets, _, _, _ = call_inputs(client.functions()["cross_entropy"], "", seed=4)
    with remotehead.Client(server.target, streams=3, chunk_bytes=1024) as striped, \
            remotehead.Client(server.target) as one:
        a = striped.forward_backward(student, hidden, targets, accumulate=False)
        b = one.forward_backward(student, hidden, targets, accumulate=False, compact_rows=False)
    assert numerics.close(a.grad_hidden, b.grad_hidden, 1e-6)
    assert abs(a.loss - b.loss) <= 1e-6 * abs(b.loss)
    assert a.grad_hidden[targets == -100].eq(0).all()


def bad_rows_call(seed=6):
    """A [B, T] call of grpo, a quarter of its rows ignored: the rows travel flattened, and
    compacted the bad ones are not at their caller's index."""
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 8
    hidden = torch.randn(b, t, D, generator=g)
    targets = torch.randint(0, V, (b, t), generator=g)
    targets[0, :5] = targets[1, 2] = targets[3, 6:] = -100
    aux = {"advantages": torch.randn(b, t, generator=g),
           "sequence_ids": torch.arange(b)[:, None].expand(b, t)}
    return hidden, targets, aux


# Each bad input at [1, 6] of the caller's [4, 8] (row 14 of 32; row 8 of the rows sent when
# the ignored ones stay here): its message and metadata "field" word for word, compacted or not.
BAD_ROWS = {
    "targets": ("targets", 500,
                "targets[1, 6]: expected a token id in [0, 211) or ignore_index (-100); got 500"),
    "advantages": ('aux["advantages"]', float("nan"),
                   'aux["advantages"][1, 6]: expected a finite value; got nan'),
}


@pytest.mark.parametrize("bad", BAD_ROWS)
def test_an_error_names_the_callers_row_and_batch_position(client, heads, bad):
    student, _ = heads
    hidden, targets, aux = bad_rows_call()
    field, value, message = BAD_ROWS[bad]
    if bad == "targets":
        targets[1, 6] = value
    else:
        aux[bad][1, 6] = value
    for compact in (False, True):
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.forward_backward(student, hidden, targets, function="grpo", aux=aux,
                                    compact_rows=compact, gradient_id=("bad", int(compact), 0))
        assert refused.value.details == message, compact
        assert refused.value.metadata["field"] == f"{field}[1, 6]", compact
        assert str(refused.value) == f"INVALID_ARGUMENT: {message}"
    # Flat [N] inputs: the caller's row, 14, compacted or not.
    flat = {k: v.reshape(-1) for k, v in aux.items()}
    for compact in (False, True):
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.forward(student, hidden.reshape(-1, D), targets.reshape(-1), function="grpo",
                           aux=flat, compact_rows=compact)
        assert refused.value.details == message.replace("[1, 6]", "[14]"), compact
        assert refused.value.metadata["field"] == f"{field}[14]"
    assert client.describe_head(student).accumulated_micro_batches == 0


def test_a_functions_own_check_names_the_callers_row(client, heads):
    # distill_topk_kl's own check (its validate) of a sparse teacher's log-probabilities, on
    # the batch the server computes: the server's compaction and a call in many messages
    # number that batch's rows otherwise than the request does.
    student, _ = heads
    hidden, targets, _ = bad_rows_call()
    g = torch.Generator().manual_seed(8)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(32)]).reshape(4, 8, K)
    logprobs = (torch.randn(4, 8, K, generator=g).softmax(-1) * 0.9).log()
    logprobs[1, 6, 0] = 0.5
    aux = {"teacher_topk_ids": ids, "teacher_topk_logprobs": logprobs}
    message = ('aux["teacher_topk_logprobs"][1, 6]: expected log-probabilities <= 0; got max '
               '0.5')
    for compact in (False, True):
        for chunk_bytes in (None, 1024):
            kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
            with remotehead.Client(client.target, **kw) as c, \
                    pytest.raises(remotehead.InvalidArgumentError) as refused:
                c.forward_backward(student, hidden, targets, function="distill_topk_kl",
                                   aux=aux, compact_rows=compact, accumulate=False)
            assert refused.value.details == message, (compact, chunk_bytes)
            assert refused.value.metadata["field"] == 'aux["teacher_topk_logprobs"][1, 6]'


def test_a_backward_by_handle_names_the_callers_row_of_grad_output(client, heads):
    student, _ = heads
    hidden, targets, _ = bad_rows_call()
    fwd = client.forward(student, hidden, targets, function="token_logprobs",
                         retain_inputs_seconds=60)
    dy = torch.ones(4, 8)
    dy[2, 5] = float("inf")
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        client.backward(student, hidden, None, dy, function="token_logprobs",
                        inputs_handle=fwd.summary.inputs_handle, gradient_id=("bad-dy", 0, 0))
    assert refused.value.details == "grad_output[2, 5]: expected a finite value; got inf"
    assert refused.value.metadata["field"] == "grad_output[2, 5]"


@pytest.fixture(scope="module")
def group():
    g = LocalHeadGroup(BINARY, size=2, args=("--device=cpu", "--torch_threads=1")).start()
    yield g
    assert g.stop() == [0, 0], "".join(g.ranks[0].log + g.ranks[1].log)


def test_on_a_head_group_the_same_bits(group):
    with remotehead.Client(group.target) as client:
        student, teacher = upload_heads(client, "rc-g", "rc-g-teacher")
        listed = client.functions()
        for name in ("cross_entropy", "grpo", "distill_kl"):
            fn = listed[name]
            hidden, targets, weights, kw, options = call_inputs(fn, teacher, seed=5)
            o = remotehead.StepOptions(function=name, reduction="weighted_sum", normalizer=30.0,
                                       **options)
            full = client.forward_backward(student, hidden, targets, o, weights=weights, **kw,
                                           compact_rows=False, gradient_id=("g-full", 0, 0))
            dw_full = dw(client, student)
            some = client.forward_backward(student, hidden, targets, o, weights=weights, **kw,
                                           gradient_id=("g-some", 0, 0))
            assert_same(full, some, name)
            assert torch.equal(dw(client, student)[0], dw_full[0]), name
        # A bad label: named at the caller's [b, t] through the group's front too.
        hidden, targets, aux = bad_rows_call()
        targets[1, 6] = 500
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.forward_backward(student, hidden, targets, function="grpo", aux=aux,
                                    gradient_id=("g-bad", 0, 0))
        assert refused.value.details == BAD_ROWS["targets"][2]
        assert refused.value.metadata["field"] == "targets[1, 6]"
