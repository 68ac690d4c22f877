"""A mesh that survives a lost replica without losing a step (--mesh_min_replicas=1), with real
server processes on loopback (Gloo, the group plane sealed) and 4 trainers, each a RemoteHead
of its own client (trainer t dials fronts[t mod 2]), against the same run with no loss:
- 6 synchronous AdamW steps of 3 micro-batches each; after every trainer added the first
  micro-batch of step 2, a process of replica 1 is killed (SIGKILL): on a 2 x 1 mesh its only
  rank, on a 2 x 2 mesh its front or its second rank. The leader evicts replica 1 and goes on in
  epoch 1; trainers 1 and 3 find the front that serves them now (the leader's), replay the
  micro-batches they had added since their last step (their journal) and go on; trainers 0 and
  2 see nothing but a pause.
- No exception reaches any training loop; every step is applied (the leader ends at version
  6); only trainers 1 and 3 moved and replayed (client.moves 1, client.replays the calls of
  their open step: 1 before the kill — the in-flight call is retried, not replayed); the final
  W equals the run with no loss within fp32 summation order (1e-6 relative to W's norm, and
  per element); against a float64 run with no loss, a float64 run with the loss is within 1e-6
  (dW crosses the replicas in float32) and the fp32 one within 1e-5.
- The leader says what happened: its log names the lost process, the new epoch, the serving
  replicas and where replica 1's trainers go; remotehead_mesh_epoch 1,
  remotehead_mesh_replicas_live 1, remotehead_mesh_evictions_total 1; a trainer of replica 1
  that asks the leader whether it serves it (HeadRef.trainer_rank) is served, and the replica's
  survivors, if any, say they were evicted and restart themselves to join again.
- The C++ client does the same: 4 processes of tests/client/mesh_trainer.cc (the loop of
  train() through the C++ RemoteHead, the same micro-batches from the same generator seeds) on a
  2 x 1 mesh whose replica 1 is killed in step 2 all exit 0; trainers 1 and 3 moved once and
  replayed one call each, 0 and 2 neither; W equals the Python trainers' run with no loss.
- Without --mesh_min_replicas the same loss takes the mesh down, as before (test_mesh.py,
  test_mesh_failures.py).
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import time
import urllib.request
from typing import Optional

import grpc
import pytest
import torch

import remotehead
from remotehead.cluster import Cluster
from remotehead.local_server import LocalHeadGroup, LocalServer
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
# One trainer's loop through the C++ RemoteHead (tests/client/mesh_trainer.cc), built beside the
# conformance driver.
DRIVER = os.environ.get("REMOTEHEAD_CONFORMANCE_DRIVER",
                        str(ROOT / "build" / "tests" / "remotehead-conformance-driver"))
CPP_TRAINER = os.environ.get("REMOTEHEAD_MESH_TRAINER",
                             str(pathlib.Path(DRIVER).with_name("remotehead-mesh-trainer")))
VOCAB, HIDDEN, ROWS, WORLD = 40, 16, 10, 4
STEPS, MICRO_BATCHES, KILL_STEP, HEAL_STEP = 6, 3, 2, 4
ADAMW = dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
HEAD = "h"


def start_mesh(size: int, *extra: str) -> LocalHeadGroup:
    return LocalHeadGroup(BINARY, size=size, replicas=2,
                          args=("--device=cpu", "--torch_threads=1", "--mesh_min_replicas=1",
                                "--sync_step_timeout_seconds=30",
                                "--metrics_address=127.0.0.1:0", *extra),
                          timeout_seconds=30.0)


def micro_batch(trainer: int, step: int, mb: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 * trainer + 10 * step + mb)
    hidden = torch.randn(ROWS, HIDDEN, generator=g).to(dtype)
    return hidden, torch.randint(0, VOCAB, (ROWS,), generator=g)


def train(fronts, kill=None, dtype=torch.float32, kill_in_step=None, heal=None):
    """Every trainer's loop; `kill()` runs once all of them added step KILL_STEP's first
    micro-batch (or, with `kill_in_step`, on a thread of its own that waits for its moment while
    the trainers run), `heal()` likewise at step HEAL_STEP's. The clients (to read their moves
    and replays) and any loop's exception."""
    hooks = {KILL_STEP: kill, HEAL_STEP: heal}
    hooks = {step: hook for step, hook in hooks.items() if hook is not None}
    with remotehead.Client(fronts, rank=0) as leader:
        leader.create_head(HEAD, VOCAB, HIDDEN, dtype=dtype, seed=5)
    clients = [remotehead.Client(fronts, rank=t, initial_backoff=0.05, max_backoff=0.5)
               for t in range(WORLD)]
    errors = [None] * WORLD
    at_kill = threading.Barrier(WORLD + 1)
    resume = threading.Barrier(WORLD + 1)

    def loop(t: int):
        try:
            head = remotehead.RemoteHead(clients[t], HEAD, cluster=Cluster(t, WORLD),
                                         trainer="run", reduction="sum")
            for step in range(STEPS):
                for mb in range(MICRO_BATCHES):
                    hidden, labels = micro_batch(t, step, mb, dtype)
                    hidden.requires_grad_(True)
                    head.loss(hidden, labels).backward()
                    if step in hooks and mb == 0:
                        at_kill.wait(timeout=120)
                        resume.wait(timeout=120)
                head.optimizer_step(adamw=ADAMW)
        except Exception as e:  # every loop's failure is the test's to report
            errors[t] = e
            at_kill.abort()
            resume.abort()

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(WORLD)]
    if kill_in_step is not None:
        threads.append(threading.Thread(target=kill_in_step))
    for thread in threads:
        thread.start()
    for step in sorted(hooks):
        try:
            at_kill.wait(timeout=120)
            hooks[step]()
            resume.wait(timeout=120)
        except threading.BrokenBarrierError:
            break
    for thread in threads:
        thread.join(timeout=300)
    # Read where trainer 0 is served now (its replica's front, or the one it moved to).
    weight, _ = clients[0].export_weights(HEAD)
    info = clients[0].describe_head(HEAD)
    for client in clients:
        client.close()
    return weight, info, clients, errors


def assert_same_run(weight: torch.Tensor, reference: torch.Tensor, rtol: float,
                    element_rtol: Optional[float] = None) -> None:
    """W of two runs whose dW were summed in other orders: within `rtol` of W's norm, and each
    element within `element_rtol` (default `rtol`; AdamW divides by sqrt(v): an element whose v
    is tiny turns an order-sized difference of its dW into a larger one of its own; the norm
    bounds them all)."""
    assert (weight - reference).norm() <= rtol * reference.norm(), (weight - reference).abs().max()
    each = element_rtol or rtol
    torch.testing.assert_close(weight, reference, rtol=each, atol=each * reference.abs().max())


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, f"{name} not exported at {url}"
    return float(found.group(1))


@pytest.mark.parametrize("size,killed", [(2, 1), (4, 2), (4, 3)],
                         ids=["2x1-replica-1", "2x2-front-of-replica-1", "2x2-rank-3"])
def test_a_lost_replica_loses_no_step(size, killed):
    with start_mesh(size) as mesh:
        fronts = list(mesh.fronts)
        reference, ref_info, _, ref_errors = train(fronts)
    assert ref_errors == [None] * WORLD, ref_errors
    assert ref_info.weight_version == STEPS

    with start_mesh(size) as mesh:
        fronts = list(mesh.fronts)
        victim = mesh.ranks[killed]
        weight, info, clients, errors = train(
            fronts, kill=lambda: victim.process.send_signal(signal.SIGKILL))
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        # Only replica 1's trainers moved, and replayed what they had added since their step.
        assert [c.moves for c in clients] == [0, 1, 0, 1]
        assert [c.replays for c in clients] == [0, 1, 0, 1]
        assert [c.replica for c in clients] == [0, 0, 0, 0]
        # The leader's word for it: the loss, the epoch, the serving replicas, the moves.
        leader = mesh.ranks[0]
        log = "".join(leader.log)
        assert f"global rank {killed} (replica 1, shard {killed % (size // 2)}" in log, log
        assert "replica 1 evicted; the mesh goes on in epoch 1 (replicas [0] serve" in log, log
        assert "trainers t with t mod 2 = 1 now go to replica 0" in log, log
        metrics = f"http://127.0.0.1:{leader.metrics_port}/metrics"
        assert metric(metrics, "remotehead_mesh_epoch") == 1
        assert metric(metrics, "remotehead_mesh_replicas_live") == 1
        assert metric(metrics, "remotehead_mesh_evictions_total") == 1
        # A trainer of replica 1 is served by the leader now; the leader's own, as always.
        with grpc.insecure_channel(fronts[0]) as channel:
            stub = pb_grpc.HeadServiceStub(channel)
            for t in range(WORLD):
                stub.DescribeHead(pb.HeadRef(head_id=HEAD, trainer_rank=t), timeout=10)
        # The evicted replica's survivors serve nothing more: each restarted itself and waits
        # to be admitted again with its replica (test_mesh_heal.py).
        for rank in mesh.ranks[size // 2:]:
            if rank is victim:
                continue
            deadline = time.monotonic() + 60
            while not any("asks to join it again" in line for line in list(rank.log)):
                assert time.monotonic() < deadline, "".join(rank.log)[-3000:]
                time.sleep(0.02)
            said = "".join(rank.log)
            assert "was evicted from the mesh" in said and "restarting to join the mesh" in said
    assert_same_run(weight, reference, 1e-6)


def train_cpp(fronts, barrier: pathlib.Path, kill, heal=None):
    """train()'s loops as 4 C++ trainer processes (remotehead-mesh-trainer), `kill()` run once
    all of them added step KILL_STEP's first micro-batch (each says so with a file in `barrier`,
    then waits for `barrier`/resume), `heal()` likewise at step HEAL_STEP's (at-heal-t,
    resume-heal). The leader's W and HeadInfo, and each trainer's exit code, its last output line
    (JSON: its client's moves, replays, replica) and its stderr."""
    with remotehead.Client(fronts, rank=0) as leader:
        leader.create_head(HEAD, VOCAB, HIDDEN, seed=5)
    flags = [f"--fronts={','.join(fronts)}", f"--world={WORLD}", f"--head={HEAD}",
             f"--steps={STEPS}", f"--micro_batches={MICRO_BATCHES}", f"--kill_step={KILL_STEP}",
             f"--heal_step={HEAL_STEP if heal is not None else -1}",
             f"--rows={ROWS}", f"--hidden={HIDDEN}", f"--vocab={VOCAB}", f"--barrier_dir={barrier}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    trainers = [subprocess.Popen([CPP_TRAINER, *flags, f"--rank={t}"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
                for t in range(WORLD)]
    try:
        for point, hook, resume in (("kill", kill, "resume"), ("heal", heal, "resume-heal")):
            if hook is None:
                continue
            deadline = time.monotonic() + 120
            while not all((barrier / f"at-{point}-{t}").exists() for t in range(WORLD)):
                if any(p.poll() is not None for p in trainers) or time.monotonic() > deadline:
                    break  # a trainer failed: its exit code and stderr say why
                time.sleep(0.01)
            else:
                hook()
            (barrier / resume).touch()
        outputs = [p.communicate(timeout=300) for p in trainers]
    finally:
        for p in trainers:
            if p.poll() is None:
                p.kill()
                p.wait()
    with remotehead.Client(fronts, rank=0) as leader:
        weight, _ = leader.export_weights(HEAD)
        info = leader.describe_head(HEAD)
    stats = [json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 else None
             for p, (out, _) in zip(trainers, outputs)]
    return weight, info, [p.returncode for p in trainers], stats, [err for _, err in outputs]


def test_cpp_trainers_move_and_replay_after_a_lost_replica(tmp_path):
    """The C++ client's move and replay with real processes: the run of
    test_a_lost_replica_loses_no_step (2 x 1, replica 1 killed in step 2) by C++ trainers, against
    the Python trainers' run with no loss (the same micro-batches: LibTorch's CPU generator gives
    the numbers Python's torch.Generator gives)."""
    with start_mesh(2) as mesh:
        reference, ref_info, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors
    assert ref_info.weight_version == STEPS

    with start_mesh(2) as mesh:
        victim = mesh.ranks[1]
        weight, info, codes, stats, errors = train_cpp(
            list(mesh.fronts), tmp_path, lambda: victim.process.send_signal(signal.SIGKILL))
    assert codes == [0] * WORLD, errors
    assert info.weight_version == STEPS
    assert [s["moves"] for s in stats] == [0, 1, 0, 1]
    assert [s["replays"] for s in stats] == [0, 1, 0, 1]
    assert [s["replica"] for s in stats] == [0, 0, 0, 0]
    assert [s["weight_version"] for s in stats] == [STEPS] * WORLD
    assert_same_run(weight, reference, 1e-6)


def killer_at_pause(victim, point: str, version: int, replica: int = 1):
    """Kills `victim` (SIGKILL, a process of `replica`) once it says it pauses at `point` of the
    step to `version` (--testonly_mesh_pause)."""
    said = f"testonly: replica {replica} pauses {point} of the mesh step to version {version}"

    def kill():
        deadline = time.monotonic() + 120
        while not any(said in line for line in list(victim.log)):
            assert time.monotonic() < deadline, "".join(victim.log)
            time.sleep(0.01)
        victim.process.send_signal(signal.SIGKILL)

    return kill


@pytest.mark.parametrize("point", ["after_sum", "after_apply"])
@pytest.mark.parametrize("size,killed", [(2, 1), (4, 3)], ids=["2x1", "2x2-rank-3"])
def test_a_replica_lost_inside_a_step(monkeypatch, size, killed, point):
    """Killed after every rank summed step 3's dW, before the commit decision: the step is
    aborted on replica 0 (its trainers ask again), replica 1's trainers replay the step's 3
    micro-batches at the leader, and the step is applied there once. Killed after the apply,
    before the answers: replica 0 applied it; replica 1's trainers find the leader at version 3,
    replay nothing, and get the applied step's answer."""
    with start_mesh(size) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors
    monkeypatch.setenv("REMOTEHEAD_TESTONLY", "1")
    with start_mesh(size, f"--testonly_mesh_pause={point},3,2.5") as mesh:
        victim = mesh.ranks[killed]
        weight, info, clients, errors = train(
            list(mesh.fronts), kill_in_step=killer_at_pause(victim, point, 3))
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        assert [c.moves for c in clients] == [0, 1, 0, 1]
        replayed = MICRO_BATCHES if point == "after_sum" else 0
        assert [c.replays for c in clients] == [0, replayed, 0, replayed]
        resolved = metric(f"http://127.0.0.1:{mesh.ranks[0].metrics_port}/metrics",
                          'remotehead_mesh_steps_resolved_total{decision="abort"}')
        assert resolved == (1 if point == "after_sum" else 0)
    assert_same_run(weight, reference, 1e-6)


@pytest.mark.parametrize("flag,said", [
    ("--testonly_mesh_pause=after_sum,1,1", "--testonly_mesh_pause: a fault point for tests only"),
    ("--testonly_mesh_corrupt_heal", "--testonly_mesh_corrupt_heal: a fault for tests only")])
def test_the_test_only_faults_are_refused_outside_tests(monkeypatch, flag, said):
    """Every fault for tests (this file's pause, test_mesh_heal.py's corrupt heal)."""
    monkeypatch.delenv("REMOTEHEAD_TESTONLY", raising=False)
    server = LocalServer(BINARY, ["--device=cpu", flag])
    server.launch()
    assert server.wait_exit(60) == 2
    assert said in "".join(server.log)


def test_a_lost_replica_loses_no_step_against_float64():
    with start_mesh(2) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts), dtype=torch.float64)
    assert ref_errors == [None] * WORLD, ref_errors
    # dW crosses the replicas in float32 (--mesh_reduce_dtype), a float64 head's too.
    for dtype, rtol in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
        with start_mesh(2) as mesh:
            victim = mesh.ranks[1]
            weight, info, clients, errors = train(
                list(mesh.fronts), dtype=dtype,
                kill=lambda: victim.process.send_signal(signal.SIGKILL))
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        assert [c.moves for c in clients] == [0, 1, 0, 1]
        assert weight.dtype == dtype
        assert_same_run(weight.double(), reference, rtol)
