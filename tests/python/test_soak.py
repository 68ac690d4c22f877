"""Soak: one dedicated server under concurrent valid and invalid clients for a bounded time.

Valid clients (one thread each) call ForwardBackward (mean cross-entropy with ignored labels;
weighted token log-probs), and Forward (per-token log-probs, inputs retained) then Backward by
the inputs handle, with random row counts, on a small fp32 head with bias; every answer is
checked against a naive local PyTorch head (F.linear on the same W and b, autograd): loss and
outputs to 1e-5 (a weighted loss: of the sum of its terms' magnitudes), dX to 1e-5 of its
largest value (both sides fp32; the server sums chunk by
chunk in another order). Each of their gradient contributions is also computed locally.

Invalid clients send what a broken or hostile trainer would: an unknown head, hidden of the
wrong width or dtype, a tensor whose bytes disagree with its shape, rows before the header, a
negative row count, an unknown function, a label out of range, a wrong valid_tokens, a stream
cancelled by the client mid-way, one abandoned by closing its channel, and one that stalls
past its deadline. Each must end with its exact status code (and never succeed).

At the end: the server's accumulated dW and db equal the sum of the valid contributions (so no
invalid, cancelled or abandoned call added anything; 1e-5 relative), its resident memory after
the warm-up and at the end differ by less than RSS_GROWTH (after the warm-up every allocator
pool and LibTorch cache has its size), and it still answers a fresh step and drains on SIGTERM.

REMOTEHEAD_SOAK_SECONDS sets the duration (default 30, the warm-up being its first quarter).
Timeouts are generous (60 s per call) so a loaded 2-core machine slows the soak, never fails it.
"""

import os
import random
import threading
import time
import zlib

import grpc
import pytest
import torch
import torch.nn.functional as F

import numerics
import remotehead
from remotehead.local_server import LocalServer
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc

V, D = 96, 16
SECONDS = float(os.environ.get("REMOTEHEAD_SOAK_SECONDS", "30"))
WARMUP = SECONDS / 4
RSS_GROWTH = 0.20  # end vs after the warm-up
REL = 1e-5
CALL_TIMEOUT = 60.0


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def close(actual, expected):
    return numerics.relative_error(actual, expected) <= REL


class Reference:
    """The head's exact W and b, and the naive computations on them (float64 autograd)."""

    def __init__(self, weight, bias):
        self.weight = weight
        self.bias = bias
        self.lock = threading.Lock()
        self.dw = torch.zeros(V, D, dtype=torch.float64)
        self.db = torch.zeros(V, dtype=torch.float64)
        self.contributions = 0

    def _leaves(self, hidden):
        w = self.weight.double().requires_grad_()
        b = self.bias.double().requires_grad_()
        x = hidden.double().requires_grad_()
        return w, b, x

    def cross_entropy_mean(self, hidden, labels):
        w, b, x = self._leaves(hidden)
        # The mean over zero valid tokens is 0 with zero gradients (the engine's convention;
        # torch gives NaN).
        valid = max(int((labels != -100).sum()), 1)
        loss = F.cross_entropy(F.linear(x, w, b), labels, ignore_index=-100,
                               reduction="sum") / valid
        loss.backward()
        return loss.item(), x.grad, w.grad, b.grad

    def weighted_logprobs(self, hidden, labels, weights, normalizer):
        w, b, x = self._leaves(hidden)
        logp = F.log_softmax(F.linear(x, w, b), dim=-1).gather(1, labels[:, None])[:, 0]
        loss = (weights.double() * logp).sum() / normalizer
        loss.backward()
        # Terms of both signs cancel: the loss's error is judged against their magnitude.
        scale = (weights.double() * logp).abs().sum().item() / normalizer
        return loss.item(), scale, x.grad, w.grad, b.grad

    def logprobs_and_backward(self, hidden, labels, grad_output):
        w, b, x = self._leaves(hidden)
        logp = F.log_softmax(F.linear(x, w, b), dim=-1).gather(1, labels[:, None])[:, 0]
        logp.backward(grad_output.double())
        return logp.detach(), x.grad, w.grad, b.grad

    def add(self, dw, db):
        with self.lock:
            self.dw += dw
            self.db += db
            self.contributions += 1


class Soak:
    def __init__(self, target, ref):
        self.target = target
        self.ref = ref
        self.stop = threading.Event()
        self.errors = []
        self.counts = {}
        self.lock = threading.Lock()

    def count(self, what):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def fail(self, message):
        with self.lock:
            self.errors.append(message)

    def run_thread(self, name, body):
        def loop():
            rng = random.Random(name)
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            try:
                with remotehead.Client(self.target, chunk_bytes=1024,
                                       timeout=CALL_TIMEOUT) as client:
                    i = 0
                    while not self.stop.is_set():
                        body(client, rng, gen, f"{name}-{i}")
                        i += 1
            except Exception as e:  # noqa: BLE001 — reported as the test's failure
                self.fail(f"{name}: {type(e).__name__}: {e}")
                self.stop.set()
        return threading.Thread(target=loop, name=name, daemon=True)


def inputs(rng, gen):
    n = rng.randint(1, 40)
    hidden = torch.randn(n, D, generator=gen)
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.2] = -100
    return hidden, labels


# ----- valid clients -----

def fused_cross_entropy(soak, client, rng, gen, tag):
    hidden, labels = inputs(rng, gen)
    result = client.forward_backward("soak", hidden, labels, reduction="mean", accumulate=True,
                                     gradient_id=(tag, 0, 0), chunk_rows=rng.choice([0, 3, 16]))
    loss, dx, dw, db = soak.ref.cross_entropy_mean(hidden, labels)
    if not (abs(result.loss - loss) <= REL * abs(loss) and close(result.grad_hidden, dx)):
        soak.fail(f"{tag}: fused cross-entropy differs: loss {result.loss} vs {loss}, "
                  f"dX rel {numerics.relative_error(result.grad_hidden, dx)}")
    soak.ref.add(dw, db)
    soak.count("valid fused cross_entropy")


def fused_weighted_logprobs(soak, client, rng, gen, tag):
    hidden, labels = inputs(rng, gen)
    labels[labels < 0] = 0  # token_logprobs: every row counts
    weights = torch.rand(hidden.shape[0], generator=gen) - 0.5
    result = client.forward_backward("soak", hidden, labels, function="token_logprobs",
                                     reduction="weighted_sum", normalizer=7.0, weights=weights,
                                     accumulate=True, gradient_id=(tag, 0, 0))
    loss, scale, dx, dw, db = soak.ref.weighted_logprobs(hidden, labels, weights, 7.0)
    if not (abs(result.loss - loss) <= REL * scale and close(result.grad_hidden, dx)):
        soak.fail(f"{tag}: weighted log-probs differ: loss {result.loss} vs {loss}")
    soak.ref.add(dw, db)
    soak.count("valid fused token_logprobs")


def two_phase(soak, client, rng, gen, tag):
    hidden, labels = inputs(rng, gen)
    labels[labels < 0] = 0
    by_handle = rng.random() < 0.5  # else X is sent again
    fwd = client.forward("soak", hidden, labels, function="token_logprobs", reduction="none",
                         retain_inputs_seconds=30 if by_handle else 0)
    grad_output = torch.randn(hidden.shape[0], generator=gen)
    logp, dx, dw, db = soak.ref.logprobs_and_backward(hidden, labels, grad_output)
    if not close(fwd.outputs, logp):
        soak.fail(f"{tag}: per-token log-probs differ")
    bwd = client.backward("soak", hidden, labels, grad_output, function="token_logprobs",
                          reduction="none", accumulate=True, gradient_id=(tag, 0, 0),
                          inputs_handle=fwd.summary.inputs_handle if by_handle else "")
    if not close(bwd.grad_hidden, dx):
        soak.fail(f"{tag}: two-phase dX differs (by handle: {by_handle})")
    soak.ref.add(dw, db)
    soak.count("valid forward + backward")


# ----- invalid clients -----

def tensor(t, dtype=None):
    t = t.contiguous()
    return pb.Tensor(dtype=dtype or {torch.float32: pb.DTYPE_FLOAT32, torch.float64: pb.DTYPE_FLOAT64,
                                      torch.int64: pb.DTYPE_INT64}[t.dtype],
                     shape=list(t.shape), data=t.numpy().tobytes())


def header(tag, rows, head="soak", fn="cross_entropy", valid_tokens=None):
    h = pb.StepHeader(head_id=head, rows=rows, accumulate_weight_grad=True)
    h.function.name = fn
    h.function.reduction = pb.REDUCTION_SUM
    h.gradient_id.trainer = tag
    if valid_tokens is not None:
        h.function.reduction = pb.REDUCTION_MEAN
        h.valid_tokens = valid_tokens
    return pb.StepRequest(header=h)


def rows(offset, hidden, labels):
    return pb.StepRequest(rows=pb.StepRows(row_offset=offset, hidden=tensor(hidden),
                                           targets=tensor(labels)))


def expect_code(soak, tag, what, code, call):
    try:
        call()
    except grpc.RpcError as e:
        if e.code() != code:
            soak.fail(f"{tag}: {what}: expected {code}; got {e.code()} {e.details()}")
    except remotehead.RemoteheadError as e:
        if e.code != code:
            soak.fail(f"{tag}: {what}: expected {code}; got {e.code} {e}")
    else:
        soak.fail(f"{tag}: {what}: expected {code}; the call succeeded")
    soak.count(f"invalid: {what}")


def invalid_call(soak, client, rng, gen, tag):
    stub = pb_grpc.HeadServiceStub(client._channel)
    hidden, labels = inputs(rng, gen)
    labels[labels < 0] = 1
    n = hidden.shape[0]
    INVALID = grpc.StatusCode.INVALID_ARGUMENT

    def stream(messages, timeout=CALL_TIMEOUT):
        return lambda: list(stub.ForwardBackward(iter(messages), timeout=timeout))

    case = rng.randrange(11)
    if case == 0:
        expect_code(soak, tag, "unknown head", grpc.StatusCode.NOT_FOUND,
                    lambda: client.forward_backward("no-such-head", hidden, labels,
                                                    reduction="sum"))
    elif case == 1:
        expect_code(soak, tag, "wrong hidden size", INVALID,
                    stream([header(tag, n), rows(0, torch.randn(n, D + 1), labels)]))
    elif case == 2:
        expect_code(soak, tag, "wrong hidden dtype", INVALID,
                    stream([header(tag, n), rows(0, hidden.double(), labels)]))
    elif case == 3:
        bad = rows(0, hidden, labels)
        bad.rows.hidden.data = bad.rows.hidden.data[:-3]
        expect_code(soak, tag, "bytes disagree with the shape", INVALID,
                    stream([header(tag, n), bad]))
    elif case == 4:
        expect_code(soak, tag, "rows before the header", INVALID,
                    stream([rows(0, hidden, labels), header(tag, n)]))
    elif case == 5:
        expect_code(soak, tag, "negative rows", INVALID, stream([header(tag, -n)]))
    elif case == 6:
        expect_code(soak, tag, "unknown function", INVALID,
                    stream([header(tag, n, fn="no_such_function"), rows(0, hidden, labels)]))
    elif case == 7:
        too_big = labels.clone()
        too_big[rng.randrange(n)] = V + 5
        expect_code(soak, tag, "label out of range", INVALID,
                    stream([header(tag, n), rows(0, hidden, too_big)]))
    elif case == 8:
        expect_code(soak, tag, "wrong valid_tokens", INVALID,
                    stream([header(tag, n, valid_tokens=n + 1), rows(0, hidden, labels)]))
    elif case == 9:
        cancelled_stream(soak, stub, tag, hidden, labels)
    else:
        abandoned_stream(soak, tag, hidden, labels, stalled=rng.random() < 0.5)


def cancelled_stream(soak, stub, tag, hidden, labels):
    """Half the rows (their batch waits for the rest, which never comes), then a cancel:
    CANCELLED, nothing accumulated."""
    n = hidden.shape[0]
    half = max(1, n // 2)
    release = threading.Event()

    def messages():
        yield header(tag, n + 1)  # one more row than ever comes
        yield rows(0, hidden[:half], labels[:half])
        release.wait(CALL_TIMEOUT)

    call = stub.ForwardBackward(messages(), timeout=CALL_TIMEOUT)

    def consume():
        time.sleep(0.05)  # the server takes the header and rows meanwhile, or not yet: either way
        call.cancel()
        list(call)
    try:
        expect_code(soak, tag, "cancelled mid-stream", grpc.StatusCode.CANCELLED, consume)
    finally:
        release.set()


def abandoned_stream(soak, tag, hidden, labels, stalled):
    """A trainer that goes away: its channel closed mid-stream (the server sees the client
    disconnect), or its rows stalled until the deadline passes (DEADLINE_EXCEEDED)."""
    n = hidden.shape[0]
    release = threading.Event()

    def messages():
        yield header(tag, n + 1)
        yield rows(0, hidden, labels)
        release.wait(CALL_TIMEOUT)

    channel = grpc.insecure_channel(soak.target)
    stub = pb_grpc.HeadServiceStub(channel)
    try:
        if stalled:
            expect_code(soak, tag, "stalled past its deadline", grpc.StatusCode.DEADLINE_EXCEEDED,
                        lambda: list(stub.ForwardBackward(messages(), timeout=0.5)))
        else:
            call = stub.ForwardBackward(messages(), timeout=CALL_TIMEOUT)
            time.sleep(0.05)  # the server has the rows, or not yet: either way nothing is added
            channel.close()  # no cancel, no half-close: the connection just goes
            del call
            soak.count("invalid: abandoned (channel closed)")
    finally:
        release.set()
        channel.close()


@pytest.fixture(scope="module")
def soak_server():
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY", "build/server/remotehead-server")
    server = LocalServer(binary, ["--device=cpu", "--compute_threads=2", "--torch_threads=1"])
    server.start()
    yield server
    if server.process is not None:
        server.stop()


def test_soak_concurrent_valid_and_invalid_clients(soak_server):
    torch.manual_seed(0)
    weight = torch.randn(V, D) / D**0.5
    bias = torch.randn(V) * 0.1
    with remotehead.Client(soak_server.target, timeout=CALL_TIMEOUT) as admin:
        admin.upload_head("soak", weight, bias)
    ref = Reference(weight, bias)
    soak = Soak(soak_server.target, ref)
    bodies = {"fused-ce": fused_cross_entropy, "fused-weighted": fused_weighted_logprobs,
              "two-phase": two_phase, "invalid-a": invalid_call, "invalid-b": invalid_call,
              "invalid-c": invalid_call}
    threads = [soak.run_thread(name, lambda c, r, g, t, b=body: b(soak, c, r, g, t))
               for name, body in bodies.items()]
    pid = soak_server.process.pid
    start = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    warm_rss = None
    while time.monotonic() - start < SECONDS and not soak.stop.is_set():
        time.sleep(0.5)
        samples.append(rss_bytes(pid))
        if warm_rss is None and time.monotonic() - start >= WARMUP:
            warm_rss = samples[-1]
    soak.stop.set()
    for t in threads:
        t.join(timeout=2 * CALL_TIMEOUT)
        assert not t.is_alive(), f"client thread {t.name} did not finish"
    time.sleep(1.0)  # cancelled and abandoned calls end on the server
    end_rss = rss_bytes(pid)
    print(f"\nsoak: {SECONDS:.0f} s, calls: {dict(sorted(soak.counts.items()))}")
    print(f"soak: server RSS after warm-up {warm_rss / 2**20:.1f} MiB, peak "
          f"{max(samples) / 2**20:.1f} MiB, end {end_rss / 2**20:.1f} MiB")
    assert not soak.errors, "\n".join(soak.errors[:20])
    assert warm_rss is not None

    # Every kind of call ran (invalid ones are drawn at random among 11 cases).
    for kind in ("valid fused cross_entropy", "valid fused token_logprobs",
                 "valid forward + backward"):
        assert soak.counts.get(kind, 0) >= 3, soak.counts
    assert sum(v for k, v in soak.counts.items() if k.startswith("invalid")) >= 20, soak.counts

    with remotehead.Client(soak_server.target, timeout=CALL_TIMEOUT) as client:
        # Exactly the valid contributions were accumulated.
        dw, db, info = client.fetch_gradients("soak")
        assert info.accumulated_micro_batches == ref.contributions
        assert numerics.relative_error(dw, ref.dw) <= REL, numerics.relative_error(dw, ref.dw)
        assert numerics.relative_error(db, ref.db) <= REL
        # Memory stayed flat.
        assert end_rss <= warm_rss * (1 + RSS_GROWTH), (warm_rss, end_rss)
        # And it still serves.
        gen = torch.Generator().manual_seed(99)
        hidden, labels = inputs(random.Random(99), gen)
        result = client.forward_backward("soak", hidden, labels, reduction="mean",
                                         accumulate=False)
        loss, dx, _, _ = ref.cross_entropy_mean(hidden, labels)
        assert abs(result.loss - loss) <= REL * abs(loss)
        assert close(result.grad_hidden, dx)
        assert client.describe_head("soak").weight_version == 0
    assert soak_server.stop() == 0, "the server did not drain cleanly"
