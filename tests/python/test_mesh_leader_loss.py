"""A mesh whose store is served by a process of its own (remotehead-server --serve_group_store,
every rank with --group_store_external) survives the loss of its leader's replica, replica 0, as
it survives any other's (--mesh_min_replicas=1), with real server processes on loopback (Gloo, the
group plane sealed) and 4 trainers (test_mesh_eviction.py's loop: 6 synchronous AdamW steps of 3
micro-batches), against the same run with no loss:
- In step 2 a process of replica 0 is killed (SIGKILL): the mesh evicts replica 0, replica 1's
  front leads (its rank of each shard is the root of the sums and of the heals from now on),
  trainers 0 and 2 move to it and replay their open step's micro-batch there. No exception
  reaches any training loop; every step is applied; W equals the run with no loss within fp32
  summation order.
- In step 4 the killed process is started again with its own flags: it finds the mesh running,
  asks to join, and — with its replica's other process, which restarted itself — is admitted by
  the new leader and healed from replica 1 within 30 s; both replicas then hold the same bytes,
  and replica 1 stays the leader: replica 0's front names it to a caller of an operation that
  changes every replica (NOT_THE_LEADER), and a client that only knows the fronts finds it.
- The store's own process lost: nothing can settle an epoch, so the mesh is down (every front
  NOT_SERVING, naming the store) — as a mesh whose global rank 0 serves the store is when that
  process is lost.
"""
import signal
import time

import grpc
import pytest
import torch

import remotehead
from remotehead import _errors
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc
from test_mesh_eviction import (HEAD, MICRO_BATCHES, STEPS, WORLD, assert_same_run,
                                killer_at_pause, metric, train, train_cpp)
from test_mesh_heal import healer, restart, start_mesh, wait_for

HEALED = "mesh: replica 0 healed in"


@pytest.mark.parametrize("size,killed", [(2, 0), (4, 0), (4, 1)],
                         ids=["2x1-leader", "2x2-leader", "2x2-rank-1-of-replica-0"])
def test_the_leaders_replica_is_lost_and_healed(size, killed):
    with start_mesh(size, external_store=True) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors

    mesh = start_mesh(size, external_store=True)
    with mesh:
        fronts = list(mesh.fronts)
        victim = mesh.ranks[killed]
        new_leader = mesh.ranks[size // 2]
        admitted_in = []

        def kill():
            victim.process.send_signal(signal.SIGKILL)
            victim.wait_exit(30)

        weight, info, clients, errors = train(
            fronts, kill=kill,
            heal=healer(mesh, killed, new_leader, HEALED, admitted_in=admitted_in))
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        assert admitted_in and admitted_in[0] < 30
        # Trainers 0 and 2 moved to replica 1 and replayed their open step's micro-batch, then
        # moved back once replica 0 was healed; 1 and 3 saw nothing but pauses.
        assert [c.moves for c in clients] == [2, 0, 2, 0]
        assert [c.replays for c in clients] == [1, 0, 1, 0]
        assert [c.replica for c in clients] == [0, 1, 0, 1]
        log = "".join(new_leader.log)
        assert "replica 0 evicted; the mesh goes on in epoch 1 (replicas [1] serve" in log, log
        assert "replica 0 admitted; the mesh goes on in epoch 2 (replicas [1, 0] serve" in log, log
        url = f"http://127.0.0.1:{new_leader.metrics_port}/metrics"
        assert metric(url, "remotehead_mesh_epoch") == 2
        assert metric(url, 'remotehead_mesh_heals_total{result="ok"}') == 1
        assert metric(url, "remotehead_mesh_heal_bytes_total") > 0
        assert "head healed from replica 1" in "".join(mesh.ranks[0].log)
        # Both replicas hold the same W; replica 1 leads: replica 0's front names it.
        with remotehead.Client(fronts[0]) as replica_0, remotehead.Client(fronts[1]) as replica_1:
            assert (replica_0.export_weights(HEAD)[0] == weight).all()
            assert (replica_1.export_weights(HEAD)[0] == weight).all()
        with grpc.insecure_channel(fronts[0]) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.HeadServiceStub(channel).DropHead(pb.HeadRef(head_id=HEAD), timeout=10)
        said = _errors.from_rpc_error(refused.value)
        assert isinstance(said, remotehead.NotTheLeaderError), said
        assert said.leader == fronts[1] and said.metadata["leader_replica"] == "1", said
    assert_same_run(weight, reference, 1e-6)


@pytest.mark.parametrize("point", ["after_sum", "after_apply"])
@pytest.mark.parametrize("size,killed", [(2, 0), (4, 0)], ids=["2x1", "2x2-front-of-replica-0"])
def test_the_leader_lost_inside_a_step(monkeypatch, size, killed, point):
    """Killed after every rank summed step 3's dW, before the commit decision: the step is
    aborted on replica 1 (its trainers ask again there, now the leader), replica 0's trainers
    replay the step's 3 micro-batches there, and it is applied once. Killed after the apply,
    before the answers: replica 1 applied it too; replica 0's trainers find it at version 3,
    replay nothing, and get the applied step's answer."""
    with start_mesh(size, external_store=True) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors
    monkeypatch.setenv("REMOTEHEAD_TESTONLY", "1")
    with start_mesh(size, f"--testonly_mesh_pause={point},3,2.5", external_store=True) as mesh:
        victim = mesh.ranks[killed]
        weight, info, clients, errors = train(
            list(mesh.fronts), kill_in_step=killer_at_pause(victim, point, 3, replica=0))
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        assert [c.moves for c in clients] == [1, 0, 1, 0]
        replayed = MICRO_BATCHES if point == "after_sum" else 0
        assert [c.replays for c in clients] == [replayed, 0, replayed, 0]
        resolved = metric(f"http://127.0.0.1:{mesh.ranks[size // 2].metrics_port}/metrics",
                          'remotehead_mesh_steps_resolved_total{decision="abort"}')
        assert resolved == (1 if point == "after_sum" else 0)
    assert_same_run(weight, reference, 1e-6)


def test_the_leaders_replica_lost_against_float64():
    """The 2 x 1 run with replica 0 killed in step 2, as a float64 head and as a float32 one,
    against a float64 run with no loss."""
    with start_mesh(2, external_store=True) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts), dtype=torch.float64)
    assert ref_errors == [None] * WORLD, ref_errors
    # dW crosses the replicas in float32 (--mesh_reduce_dtype), a float64 head's too.
    for dtype, rtol in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
        with start_mesh(2, external_store=True) as mesh:
            victim = mesh.ranks[0]
            weight, info, clients, errors = train(
                list(mesh.fronts), dtype=dtype,
                kill=lambda: victim.process.send_signal(signal.SIGKILL))
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        assert [c.moves for c in clients] == [1, 0, 1, 0]
        assert weight.dtype == dtype
        assert_same_run(weight.double(), reference, rtol)


def test_cpp_trainers_follow_a_new_leader(tmp_path):
    """The C++ client's move and replay when the leader's replica is lost (2 x 1, external
    store, replica 0 killed in step 2 and restarted in step 4), against the Python trainers' run
    with no loss."""
    with start_mesh(2, external_store=True) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors
    mesh = start_mesh(2, external_store=True)
    with mesh:
        victim = mesh.ranks[0]

        def kill():
            victim.process.send_signal(signal.SIGKILL)
            victim.wait_exit(30)

        weight, info, codes, stats, errors = train_cpp(
            list(mesh.fronts), tmp_path, kill, healer(mesh, 0, mesh.ranks[1], HEALED))
    assert codes == [0] * WORLD, errors
    assert info.weight_version == STEPS
    assert [s["moves"] for s in stats] == [2, 0, 2, 0]
    assert [s["replays"] for s in stats] == [1, 0, 1, 0]
    assert [s["replica"] for s in stats] == [0, 1, 0, 1]
    assert_same_run(weight, reference, 1e-6)


def test_a_client_finds_the_new_leader_while_the_old_one_is_gone():
    """Replica 0 lost and not (yet) back: a client that knows only the fronts, dialling replica
    0's first, reaches the leader for what changes every replica (a create, an export) and
    another front for the listings (heads, functions)."""
    with start_mesh(2, external_store=True) as mesh:
        fronts = list(mesh.fronts)
        with remotehead.Client(fronts, rank=0) as client:
            client.create_head(HEAD, 64, 8, seed=1)
        mesh.ranks[0].process.send_signal(signal.SIGKILL)
        mesh.ranks[0].wait_exit(30)
        wait_for(mesh.ranks[1], "the mesh goes on in epoch 1", 30)
        with remotehead.Client(fronts, rank=0, initial_backoff=0.05, max_backoff=0.2) as client:
            # The listings every replica answers alike, then what only the leader does.
            assert [h.head_id for h in client.list_heads()] == [HEAD]
            assert "cross_entropy" in client.functions()
            client.create_head("second", 64, 8, seed=2)
            weight, _ = client.export_weights("second")
            assert sorted(h.head_id for h in client.list_heads()) == sorted([HEAD, "second"])
        assert weight.shape == (64, 8)


def test_losing_the_store_process_takes_the_mesh_down():
    with start_mesh(2, external_store=True) as mesh:
        with remotehead.Client(list(mesh.fronts), rank=0) as client:
            client.create_head(HEAD, 64, 8, seed=1)
        mesh.store.process.send_signal(signal.SIGKILL)
        mesh.store.wait_exit(30)
        for rank in mesh.ranks:
            # Down, naming the store (a follower then stops: its log's front is unreachable).
            wait_for(rank, "the group's store at 127.0.0.1:", 30)
            said = "".join(rank.log)
            assert "its own process: --group_store_external" in said, said[-3000:]
            assert "evicted" not in said, said[-3000:]
            deadline = time.monotonic() + 10
            with remotehead.Client(rank.target, max_attempts=1) as process:
                while rank.process.poll() is None:  # NOT_SERVING at its next poll, or it stopped
                    try:
                        if process.health() == "NOT_SERVING":
                            break
                    except remotehead.RemoteheadError as e:
                        assert e.code == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "".join(rank.log)[-3000:]
                    time.sleep(0.05)


def test_a_store_that_outlived_its_mesh_is_refused():
    """Every process of the mesh stopped (a drain), the store kept: a process started again finds
    the old mesh's session in the store but no beat — not a mesh to join — and says so (exit 1)
    instead of waiting to be admitted by nobody."""
    mesh = start_mesh(2, external_store=True)
    with mesh:
        for rank in mesh.ranks:
            rank.process.terminate()
        assert [rank.wait_exit(60) for rank in mesh.ranks] == [0, 0]
        again = restart(mesh, 1)
        assert again.wait_exit(60) == 1
        said = "".join(again.log)
        assert "holds a mesh's session but no process of it beats" in said, said[-3000:]
