"""A step striped over several gRPC streams (Client(streams=C), StepHeader.stripe) through the
real server: for C = 1, 2, 4 the fused loss, dX and dW, per-token outputs, rows of logits,
sampled tokens and a two-phase backward equal one stream's and a local PyTorch head's; a replay
under the same gradient id adds nothing; one stream's bad rows or its cancellation fail the
whole step with the gRPC status and commit nothing, and the retry is then the only contribution;
the merged streams report the failure, not the cancellations it caused, and leave no reader
running.

Tolerances: fp32 on both sides, relative 1e-5 (the server sums chunk by chunk in another order);
C streams against one: the same bits (the server cuts batches at fixed rows, never by arrival).
"""

import os
import secrets
import threading
import time
import urllib.request

import grpc
import pytest
import torch
import torch.nn.functional as F

import numerics
import remotehead
from conftest import ROOT
from remotehead import _steps
from remotehead.local_server import LocalServer
from remotehead.v1 import head_service_pb2_grpc as pb_grpc

V, D, N = 300, 32, 57
COUNTS = (1, 2, 4)


@pytest.fixture(scope="module")
def clients(server_target):
    # chunk_bytes 2048: 14 row messages of 4 rows, so every stream carries several.
    made = {c: remotehead.Client(server_target, chunk_bytes=2048, streams=c) for c in COUNTS}
    yield made
    for c in made.values():
        c.close()


@pytest.fixture
def head(clients, request):
    torch.manual_seed(0)
    weight = torch.randn(V, D) / D**0.5
    head_id = request.node.name
    clients[1].upload_head(head_id, weight)
    yield head_id, weight
    clients[1].drop_head(head_id)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:5] = -100
    return hidden, targets


def local_step(weight, hidden, targets):
    w = weight.clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss = F.cross_entropy(F.linear(h, w), targets)
    loss.backward()
    return loss.item(), h.grad, w.grad


def test_every_stream_count_gives_the_one_stream_step_and_a_local_head(clients, head):
    head_id, weight = head
    hidden, targets = batch()
    loss, dx, dw = local_step(weight, hidden, targets)
    one = None
    for c in COUNTS:
        clients[1].zero_gradients(head_id)
        r = clients[c].forward_backward(head_id, hidden, targets, gradient_id=("fb", 0, c))
        assert abs(r.loss - loss) <= 1e-5 * abs(loss), c
        assert numerics.close(r.grad_hidden, dx, 1e-5), c
        got_dw, _, info = clients[1].fetch_gradients(head_id)
        assert info.accumulated_micro_batches == 1 and numerics.close(got_dw, dw, 1e-5), c
        if one is None:
            one = r
        assert r.loss == one.loss and torch.equal(r.grad_hidden, one.grad_hidden), c


def test_per_row_outputs_and_a_two_phase_backward_match_over_any_stream_count(clients, head):
    head_id, weight = head
    hidden, targets = batch(2)
    z = hidden @ weight.T
    per_token = F.cross_entropy(z, targets, reduction="none")
    upstream = torch.linspace(-1, 1, N)
    h = hidden.clone().requires_grad_()
    (F.cross_entropy(F.linear(h, weight), targets, reduction="none") * upstream).sum().backward()
    for c in COUNTS:
        out = clients[c].forward(head_id, hidden, targets).outputs
        assert numerics.close(out, per_token, 1e-5), c
        logits = clients[c].logits(head_id, hidden)
        assert logits.shape == (N, V) and numerics.close(logits, z, 1e-5), c
        ids, logp = clients[c].sample(head_id, hidden, greedy=True)
        assert torch.equal(ids, z.argmax(-1)), c
        assert numerics.close(logp, z.log_softmax(-1).gather(1, ids[:, None])[:, 0], 1e-5), c
        r = clients[c].backward(head_id, hidden, targets, upstream, accumulate=False)
        assert numerics.close(r.grad_hidden, h.grad, 1e-5), c


def test_a_replay_under_the_same_gradient_id_adds_nothing(clients, head):
    head_id, _ = head
    hidden, targets = batch(3)
    first = clients[4].forward_backward(head_id, hidden, targets, gradient_id=("replay", 0, 0))
    dw_first, _, _ = clients[1].fetch_gradients(head_id)
    replay = clients[2].forward_backward(head_id, hidden, targets, gradient_id=("replay", 0, 0))
    assert replay.summary.replayed and not first.summary.replayed
    assert numerics.close(replay.grad_hidden, first.grad_hidden, 1e-6)
    dw_replay, _, info = clients[1].fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 1 and torch.equal(dw_replay, dw_first)


def test_bad_rows_on_one_stream_fail_the_step_and_commit_nothing(clients, head):
    head_id, _ = head
    hidden, targets = batch(4)
    bad = targets.clone()
    bad[-1] = V  # in the last row message, which stream 13 mod 4 = 1 carries
    with pytest.raises(remotehead.RemoteheadError) as e:
        clients[4].forward_backward(head_id, hidden, bad, gradient_id=("bad", 0, 0))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "targets" in e.value.details, e.value.details
    dw, _, info = clients[1].fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 0 and not dw.abs().any()


def admitted_steps(metrics_port: int) -> float:
    """remotehead_admission_active_requests on the server's /metrics: step calls running."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith("remotehead_admission_active_requests "):
            return float(line.split()[-1])
    raise AssertionError("remotehead_admission_active_requests is not on /metrics")


def test_cancelling_one_stream_cancels_the_step_and_commits_nothing():
    # A server of its own, whose /metrics says when the step runs.
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    server = LocalServer(binary, args=("--device=cpu", "--metrics_address=127.0.0.1:0")).start()
    try:
        with remotehead.Client(server.target, chunk_bytes=2048) as client:
            cancel_one_stream(client, server.target, server.metrics_port)
    finally:
        assert server.stop() == 0, "".join(server.log)


def cancel_one_stream(client, server_target, metrics_port):
    torch.manual_seed(0)
    weight = torch.randn(V, D) / D**0.5
    head_id = "cancel"
    client.upload_head(head_id, weight)
    hidden, targets = batch(5)
    o = remotehead.StepOptions(gradient_id=("cancel", 0, 0))
    p = _steps.prepare_step(_steps.FORWARD_BACKWARD, head_id, hidden, targets, None, None, None,
                            o, 2048)
    key, release = secrets.token_hex(16), threading.Event()

    def held_open(messages):
        messages = list(messages)
        yield from messages[:-1]
        release.wait(30)  # stream 1 sends all but its last rows, then neither ends nor closes

    with grpc.insecure_channel(server_target) as channel:
        stub = pb_grpc.HeadServiceStub(channel)
        calls = [stub.ForwardBackward(p.messages((key, 2, 0)), timeout=30),
                 stub.ForwardBackward(held_open(p.messages((key, 2, 1))), timeout=30)]
        # The step runs (both streams joined, admitted), its batch waiting for stream 1's rows.
        deadline = time.monotonic() + 20
        while admitted_steps(metrics_port) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert admitted_steps(metrics_port) == 1
        calls[1].cancel()
        release.set()
        with pytest.raises(grpc.RpcError) as e:
            list(calls[0])
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert "stream 1 of 2" in e.value.details(), e.value.details()
    dw, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 0 and not dw.abs().any()
    # The retry (new streams, the same gradient id) is the step's one contribution.
    with remotehead.Client(server_target, chunk_bytes=2048, streams=2) as striped:
        r = striped.forward_backward(head_id, hidden, targets, o)
    assert not r.summary.replayed
    loss, dx, dw_local = local_step(weight, hidden, targets)
    dw, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 1 and numerics.close(dw, dw_local, 1e-5)
    assert numerics.close(r.grad_hidden, dx, 1e-5)


def test_streams_out_of_range_are_refused():
    for streams in (0, 65):
        with pytest.raises(remotehead.RemoteheadError) as e:
            remotehead.Client("127.0.0.1:1", streams=streams)
        assert e.value.details == f"streams: expected 1 to 64; got {streams}"


class _Failed(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class _FakeCall:
    """A response stream that yields `responses`, then fails with `error` (None: ends), or —
    `hold` — waits until cancelled and then fails CANCELLED, as a stream the server keeps open."""

    def __init__(self, responses=(), error=None, hold=False):
        self.responses, self.error, self.hold = list(responses), error, hold
        self.cancelled = threading.Event()

    def __iter__(self):
        yield from self.responses
        if self.hold:
            self.cancelled.wait(30)
            raise _Failed(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled.set()


def test_merged_streams_report_the_failure_not_the_cancellations_it_caused():
    from remotehead._striping import merged_responses
    from remotehead.v1 import head_service_pb2 as pb

    row = pb.StepResponse()
    row.grad_hidden.row_offset = 3
    # Stream 1 fails; stream 0 is held open until the failure cancels it; stream 2 ends.
    calls = [_FakeCall([row], hold=True),
             _FakeCall(error=_Failed(grpc.StatusCode.INVALID_ARGUMENT, "targets[7]: bad")),
             _FakeCall([row])]
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for response in merged_responses(calls):
            got.append(response.grad_hidden.row_offset)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == \
        "targets[7]: bad"
    assert got == [3, 3] and all(c.cancelled.is_set() for c in calls)
    # A reader that stops early cancels every stream and leaves no thread behind.
    calls = [_FakeCall([row], hold=True), _FakeCall([row], hold=True)]
    stream = merged_responses(calls)
    next(stream)
    stream.close()
    assert all(c.cancelled.is_set() for c in calls)
    assert not [t for t in threading.enumerate()
                if t.name.startswith("remotehead-stripe-")], "a stream's reader was left running"
