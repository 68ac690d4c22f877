"""A mesh that fails cleanly, with real server processes: 2 replicas of head groups of 2
(global ranks 0–3 on loopback, the group plane sealed), trainers each a client of its own front.
- Whole answers: after trainers 0 and 1 each add a micro-batch at their own replica, HeadInfo at
  every front counts both (accumulated_micro_batches 2), and FetchGradients — at the leader, or
  at replica 1's front, which names the leader (the clients follow it) — returns the sum of both
  replicas' dW: equal to one server fed both micro-batches (fp32, 1e-6 relative), never one
  replica's part.
- Missing trainers named: a synchronous step whose trainer 0 (the leader's) or trainer 3
  (replica 1's) never comes is ABORTED (RANKS_MISSING) on every replica within one
  --sync_step_timeout_seconds (plus a margin), every message naming the ranks that came and the
  one missing ("got ranks [1, 2, 3], missing ranks [0]", metadata missing_ranks "0"); nothing is
  applied anywhere. The same step asked again with the other replica's trainer missing names
  that one (the trainers of the aborted try are not counted as come: they were answered); and
  so with a world of 2 (one trainer per replica: the leader's replica has nobody waiting when
  trainer 0 is missing).
- A killed process named: with trainers waiting at a synchronous step on both replicas, global
  rank 3 (replica 1's second rank, not a front) is killed (SIGKILL). Every waiting trainer gets
  UNAVAILABLE, reason GROUP_UNAVAILABLE, within a few seconds (far below the group's and the
  step's timeouts), naming the lost process word for word — "global rank 3 (replica 1, shard 1,
  at 127.0.0.1:<its port>) is lost" — with metadata lost_rank 3, lost_replica 1, lost_shard 1,
  lost_address.
- A mesh that is down refuses work: afterwards a ForwardBackward at the leader (whose own replica
  is whole) is UNAVAILABLE with the same verdict, nothing added (the count stays at the 4
  micro-batches); every live rank reports NOT_SERVING and remotehead_group_up /
  remotehead_mesh_up 0 (the leader always; a follower whose front declared its log down leaves,
  exit 1); reads (DescribeHead) are
  still answered, the weights unchanged.
"""
import concurrent.futures
import os
import pathlib
import signal
import time
import urllib.request

import grpc
import pytest
import torch

import remotehead
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc
from remotehead.local_server import LocalHeadGroup, LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
VOCAB, HIDDEN, ROWS, WORLD = 37, 16, 12, 4
ADAMW = dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
SYNC_TIMEOUT = 4.0
GROUP_TIMEOUT = 20.0


def start_mesh() -> LocalHeadGroup:
    return LocalHeadGroup(BINARY, size=4, replicas=2,
                          args=("--device=cpu", "--torch_threads=1",
                                f"--sync_step_timeout_seconds={SYNC_TIMEOUT}",
                                "--metrics_address=127.0.0.1:0"),
                          timeout_seconds=GROUP_TIMEOUT).start()


def batch(trainer: int):
    g = torch.Generator().manual_seed(77 + trainer)
    return torch.randn(ROWS, HIDDEN, generator=g), torch.randint(0, VOCAB, (ROWS,), generator=g)


def add_micro_batch(fronts, head, rank):
    with remotehead.Client(fronts, rank=rank) as client:
        hidden, targets = batch(rank)
        client.forward_backward(head, hidden, targets, reduction="sum", accumulate=True,
                                gradient_id=(f"run/rank-{rank}", 0, 0))


def ask_for_step(fronts, head, rank):
    """Trainer `rank`'s synchronous step 0 of WORLD: the error it gets (it must fail) and when."""
    with remotehead.Client(fronts, rank=rank, max_attempts=1) as client:
        with pytest.raises(remotehead.RemoteheadError) as failed:
            client.optimizer_step(head, adamw=ADAMW, zero_gradients=True,
                                  synchronous=(0, rank, WORLD))
        return failed.value, time.monotonic()


def metrics(rank: LocalServer) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{rank.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def mesh():
    mesh = start_mesh()
    yield mesh
    codes = mesh.stop()
    assert codes == [0] * len(codes), "".join(line for r in mesh.ranks for line in r.log)


def test_head_info_and_gradients_answer_for_every_replica(mesh):
    head = "mesh-whole"
    with remotehead.Client(mesh.fronts) as leader:
        leader.create_head(head, VOCAB, HIDDEN, seed=3)
        w0, _ = leader.export_weights(head)
    try:
        for rank in (0, 1):  # trainer 0 at replica 0, trainer 1 at replica 1
            add_micro_batch(mesh.fronts, head, rank)
        for front in mesh.fronts:
            with remotehead.Client(front) as client:
                assert client.describe_head(head).accumulated_micro_batches == 2, front
        # The reference: one process fed both micro-batches, in fp32.
        w = w0.clone().requires_grad_(True)
        for rank in (0, 1):
            hidden, targets = batch(rank)
            torch.nn.functional.cross_entropy(hidden @ w.T, targets, reduction="sum").backward()
        for front in mesh.fronts:  # replica 1's front names the leader; the client follows
            with remotehead.Client(front) as client:
                dw, _, info = client.fetch_gradients(head)
                assert info.accumulated_micro_batches == 2
                torch.testing.assert_close(dw, w.grad, rtol=1e-6, atol=1e-6)
        # A front that is not the leader refuses to answer for the mesh alone, and says where.
        channel = grpc.insecure_channel(mesh.fronts[1])
        stub = pb_grpc.HeadServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.FetchGradients(pb.FetchGradientsRequest(head_id=head)))
        channel.close()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "FetchGradients (it reads the mesh's dW" in refused.value.details()
        assert mesh.fronts[0].split(":")[1] in refused.value.details()
    finally:
        with remotehead.Client(mesh.fronts) as leader:
            leader.drop_head(head)


def ask_step(fronts, head, step, rank, world):
    """Trainer `rank`'s synchronous step `step` of `world`: the error it gets (it must fail)
    and when."""
    with remotehead.Client(fronts, rank=rank, max_attempts=1) as client:
        with pytest.raises(remotehead.RemoteheadError) as failed:
            client.optimizer_step(head, adamw=ADAMW, zero_gradients=True,
                                  synchronous=(step, rank, world))
        return failed.value, time.monotonic()


# (world size, the trainer that never comes, the trainer missing from the next try of the same
# step): the leader's trainer and replica 1's, with 2 trainers per replica and with 1 — where the
# leader's replica has no trainer at the step at all — each case after its mirror.
MISSING_CASES = {"leaders-trainer": (4, 0, 3), "replica-1s-trainer": (4, 3, 0),
                 "world2-leaders-trainer": (2, 0, 1), "world2-replica-1s-trainer": (2, 1, 0)}


@pytest.mark.parametrize("world,missing,then_missing", MISSING_CASES.values(),
                         ids=MISSING_CASES.keys())
def test_missing_trainers_are_named_on_every_replica_within_one_timeout(
        mesh, world, missing, then_missing):
    head = f"mesh-missing-{world}-{missing}"
    with remotehead.Client(mesh.fronts) as leader:
        leader.create_head(head, VOCAB, HIDDEN, seed=5)
    try:
        # The same step twice: nothing was applied by the first try, so the trainers ask for it
        # again, and the trainers that came to the first try (answered) never count as come to
        # the second.
        for absent in (missing, then_missing):
            came = [r for r in range(world) if r != absent]
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(len(came)) as pool:
                results = list(pool.map(lambda r: ask_step(mesh.fronts, head, 4, r, world), came))
            for rank, (e, answered) in zip(came, results):
                assert isinstance(e, remotehead.RanksMissingError), (absent, rank, e)
                assert e.code.name == "ABORTED"
                assert (f"got ranks [{', '.join(map(str, came))}], missing ranks [{absent}]"
                        in e.details), (absent, rank, e.details)
                assert e.metadata.get("missing_ranks") == str(absent), (absent, e.metadata)
                assert answered - started < SYNC_TIMEOUT * 1.5 + 1.0, (
                    f"rank {rank} answered after {answered - started:.1f} s")
        for front in mesh.fronts:
            with remotehead.Client(front) as client:
                assert client.describe_head(head).weight_version == 0
    finally:
        with remotehead.Client(mesh.fronts) as leader:
            leader.drop_head(head)


def test_a_killed_process_is_named_at_once_and_the_mesh_refuses_work():
    head = "mesh-killed"
    mesh = start_mesh()
    try:
        with remotehead.Client(mesh.fronts) as leader:
            leader.create_head(head, VOCAB, HIDDEN, seed=13)
            w0, _ = leader.export_weights(head)
        for rank in range(WORLD):
            add_micro_batch(mesh.fronts, head, rank)
        lost = mesh.ranks[3]
        lost_address = lost.target
        # Trainers 0, 1 and 2 wait at the step (3 never asks): the leader's is started, replica
        # 1's waits for its trainer 3. Then global rank 3 is killed.
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(ask_for_step, mesh.fronts, head, r) for r in (0, 1, 2)]
            time.sleep(1.0)
            lost.process.send_signal(signal.SIGKILL)
            lost.process.wait()
            killed = time.monotonic()
            results = [w.result(timeout=60) for w in waiting]
        expected = (f"global rank 3 (replica 1, shard 1, at {lost_address}) is lost")
        for rank, (e, answered) in zip((0, 1, 2), results):
            assert e.code.name == "UNAVAILABLE", (rank, e)
            assert e.reason == "GROUP_UNAVAILABLE", (rank, e.reason, e.details)
            assert expected in e.details, (rank, e.details)
            assert e.metadata.get("lost_rank") == "3", e.metadata
            assert e.metadata.get("lost_replica") == "1", e.metadata
            assert e.metadata.get("lost_shard") == "1", e.metadata
            assert e.metadata.get("lost_address") == lost_address, e.metadata
            assert answered - killed < 8.0, f"rank {rank} answered {answered - killed:.1f} s late"
        # The mesh is down: the leader's replica is whole, but takes no more work.
        with remotehead.Client(mesh.fronts[0], max_attempts=1) as client:
            hidden, targets = batch(0)
            with pytest.raises(remotehead.RemoteheadError) as refused:
                client.forward_backward(head, hidden, targets, reduction="sum",
                                        accumulate=True, gradient_id=("run/late", 0, 0))
            assert refused.value.code.name == "UNAVAILABLE"
            assert refused.value.reason == "GROUP_UNAVAILABLE"
            assert expected in refused.value.details, refused.value.details
            info = client.describe_head(head)  # a read is still answered
            assert info.weight_version == 0
            assert info.accumulated_micro_batches == WORLD  # every replica's, nothing added
            w, _ = client.export_weights(head)
            assert torch.equal(w, w0)
        # Every live rank reports NOT_SERVING; a follower whose front declared its log down
        # leaves (exit 1), as a group's rank does. The leader stays, to be read.
        deadline = time.monotonic() + 5
        for rank in mesh.ranks[:3]:
            try:
                with remotehead.Client(rank.target, max_attempts=1) as client:
                    while client.health() != "NOT_SERVING" and time.monotonic() < deadline:
                        time.sleep(0.1)
                    assert client.health() == "NOT_SERVING", rank.target
                m = metrics(rank)
                assert m["remotehead_group_up"] == 0, rank.target
                assert m["remotehead_mesh_up"] == 0, rank.target
            except (remotehead.RemoteheadError, OSError):
                assert rank is not mesh.ranks[0], "the leader left"
                assert rank.process.wait(timeout=10) == 1, "".join(rank.log)
    finally:
        for r in mesh.ranks:
            if r.process is not None and r.process.poll() is None:
                r.process.kill()
        mesh.stop()
