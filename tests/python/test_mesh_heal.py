"""An evicted replica comes back and is healed from a live one (--mesh_min_replicas=1), with real
server processes on loopback (Gloo, the group plane sealed), each listening on a port of its own
as an operator's flags would say, and 4 trainers (test_mesh_eviction.py's loop: 6 synchronous
AdamW steps of 3 micro-batches), against the same run with no loss:
- In step 2 a process of replica 1 is killed (SIGKILL), or stopped (SIGTERM: on a mesh that
  evicts, a process of a replica other than 0 leaves instead of draining the mesh, exit 0): the
  mesh evicts replica 1 and trainers
  1 and 3 move to the leader, replaying their open step's micro-batch there. In step 4 (the
  trainers paused after its first micro-batch) the killed process is started again with its own
  flags: it finds the mesh running, asks to join, and — with its replica's other process, which
  restarted itself when its replica was evicted — is admitted by the leader between two steps,
  healed (every head's sealed state from replica 0's rank of its shard, verified, the replicas'
  bytes compared) within 30 s, and serves again. The trainers resume: trainers 1 and 3 are told by
  the leader that replica 1 serves them again (WRONG_REPLICA) and move back without resending
  anything (their step-4 micro-batch stays in the leader's dW).
- No exception reaches any training loop; every step is applied; the final W equals the run
  with no loss within fp32 summation order; both replicas then hold byte-identical weights and
  optimizer states: with --state_dir, the leader saved a new state on every member after the
  admission, and a state saved at the end is the same file on every replica's rank of a shard.
- The leader says what happened (the admission, the heal) and counts it
  (remotehead_mesh_heals_total{result="ok"}, remotehead_mesh_heal_bytes_total, the epoch 2).
- A process started with another group secret is refused (it cannot read the mesh's session),
  and a request to join that does not verify is never admitted.
- A heal whose bytes fail verification (--testonly_mesh_corrupt_heal on the joiner) evicts the
  joiner again: it leaves, the mesh goes on, and the run still equals the one with no loss.
"""
import pathlib
import re
import signal
import time
from typing import Callable, List, Optional

import pytest

import remotehead
from remotehead.local_server import LocalHeadGroup, LocalServer, free_port
from test_mesh_eviction import (BINARY, HEAD, STEPS, WORLD, assert_same_run, metric, train,
                                train_cpp)

HEALED = "mesh: replica 1 healed in"


def start_mesh(size: int, *extra: str, external_store: bool = False,
               timeout_seconds: float = 30.0) -> LocalHeadGroup:
    """A 2-replica mesh whose every process listens on a port of its own (a restarted process
    comes back where its trainers dial it); `external_store`: its store in a process of its
    own."""
    mesh = LocalHeadGroup(BINARY, size=size, replicas=2,
                          args=("--device=cpu", "--torch_threads=1", "--mesh_min_replicas=1",
                                "--sync_step_timeout_seconds=30", "--mesh_checksum_every_steps=1",
                                "--metrics_address=127.0.0.1:0", *extra),
                          timeout_seconds=timeout_seconds, external_store=external_store)
    for rank in mesh.ranks:
        rank.args.append(f"--listen=127.0.0.1:{free_port()}")
    return mesh


def wait_for(server: LocalServer, text: str, timeout: float) -> float:
    """Seconds until `server`'s output says `text`."""
    start = time.monotonic()
    while not any(text in line for line in list(server.log)):
        assert time.monotonic() - start < timeout, "".join(server.log)[-4000:]
        time.sleep(0.02)
    return time.monotonic() - start


def restart(mesh: LocalHeadGroup, killed: int) -> LocalServer:
    """The killed process started again with its own flags, in its place in `mesh`."""
    again = LocalServer(BINARY, mesh.ranks[killed].args)
    again.launch()
    mesh.ranks[killed] = again
    return again


def healer(mesh: LocalHeadGroup, killed: int, leader: LocalServer, healed: str = HEALED,
           admitted_in: Optional[List[float]] = None) -> Callable[[], None]:
    """A train() hook: the killed process started again with its flags, waited for until the
    leader says `healed` and it listens (the seconds it took to be admitted into
    `admitted_in`); every process's output printed if that does not come."""
    def heal():
        again = restart(mesh, killed)
        try:
            admitted = wait_for(again, "admitted to the mesh", 60)
            wait_for(leader, healed, 30)
        except AssertionError:
            for r in mesh.ranks:
                print("=====", r.args[-1], "".join(r.log)[-3000:])
            raise
        if admitted_in is not None:
            admitted_in.append(admitted)
        again.wait_listening()

    return heal


def state_file(root: pathlib.Path, global_rank: int, state_id: str) -> bytes:
    return (root / f"rank-{global_rank}" / HEAD / f"{state_id}.safetensors").read_bytes()


@pytest.mark.parametrize("size,killed,stop", [(2, 1, signal.SIGKILL), (4, 3, signal.SIGKILL),
                                              (4, 2, signal.SIGTERM)],
                         ids=["2x1-replica-1", "2x2-rank-3", "2x2-sigterm-to-replica-1"])
def test_a_replaced_replica_is_healed_and_its_trainers_come_back(tmp_path, size, killed, stop):
    """SIGKILL, or SIGTERM — which on a mesh that evicts makes a process of a replica other than
    0 leave (exit 0) instead of draining the mesh: a pod that its StatefulSet restarts rejoins."""
    with start_mesh(size) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors

    states = tmp_path / "state"
    mesh = start_mesh(size, f"--state_dir={states}")
    with mesh:
        fronts = list(mesh.fronts)
        leader = mesh.ranks[0]
        victim = mesh.ranks[killed]
        admitted_in = []
        heal = healer(mesh, killed, leader, admitted_in=admitted_in)
        exit_codes = []

        def kill():
            victim.process.send_signal(stop)
            # Gone before the trainers go on: their open step is lost with it.
            exit_codes.append(victim.wait_exit(30))

        weight, info, clients, errors = train(fronts, kill=kill, heal=heal)
        assert errors == [None] * WORLD, errors
        if stop == signal.SIGTERM:
            assert exit_codes == [0]
            assert "leaves the mesh, which evicts its replica" in "".join(victim.log)
        assert info.weight_version == STEPS
        assert admitted_in and admitted_in[0] < 30
        # Trainers 1 and 3 moved to the leader and replayed their open step's micro-batch, then
        # moved back without resending anything; 0 and 2 saw nothing but pauses.
        assert [c.moves for c in clients] == [0, 2, 0, 2]
        assert [c.replays for c in clients] == [0, 1, 0, 1]
        assert [c.replica for c in clients] == [0, 1, 0, 1]
        log = "".join(leader.log)
        assert "replica 1 admitted; the mesh goes on in epoch 2 (replicas [0, 1] serve" in log, log
        assert "every head's state verified" in log, log
        url = f"http://127.0.0.1:{leader.metrics_port}/metrics"
        assert metric(url, "remotehead_mesh_epoch") == 2
        assert metric(url, "remotehead_mesh_replicas_live") == 2
        assert metric(url, 'remotehead_mesh_heals_total{result="ok"}') == 1
        assert metric(url, "remotehead_mesh_heal_bytes_total") > 0
        # Every replica serves, with the same bytes: W here, W and the optimizer state in the
        # states saved on every member (after the admission, and now).
        half = size // 2
        for rank in mesh.ranks:
            with remotehead.Client(rank.target) as process:
                assert process.health() == "SERVING", "".join(rank.log)[-2000:]
        with remotehead.Client(fronts[1]) as replica_1:
            assert (replica_1.export_weights(HEAD)[0] == weight).all()
        healed_states = sorted(p.stem for p in (states / f"rank-{killed}" / HEAD).iterdir())
        assert healed_states, "no state saved on the admitted replica after its heal"
        with remotehead.Client(fronts, rank=0) as trainer:
            saved = trainer.save_head_state(HEAD).state_id
        for shard in range(half):
            for state_id in (healed_states[0], saved):
                assert state_file(states, shard, state_id) == \
                    state_file(states, half + shard, state_id)
    assert_same_run(weight, reference, 1e-6)


def test_the_groups_of_an_epoch_left_are_closed():
    """An epoch's cross-replica groups, left at an epoch change, are closed (Gloo's connections,
    to a lost process too) at a later change once a group timeout has passed — epoch 0's aside:
    they hold the first rendezvous's store connection — and the mesh trains on the groups that
    serve. Replica 1 is lost and healed twice: epochs 1 to 4."""
    mesh = start_mesh(2, timeout_seconds=3.0)
    with mesh:
        leader = mesh.ranks[0]
        for evicted, admitted in ((1, 2), (3, 4)):
            mesh.ranks[1].process.send_signal(signal.SIGKILL)
            mesh.ranks[1].wait_exit(30)
            wait_for(leader, f"the mesh goes on in epoch {evicted}", 30)
            restart(mesh, 1)
            wait_for(leader, f"it serves again in epoch {admitted}", 60)
            mesh.ranks[1].wait_listening()
            time.sleep(3.5)  # past the group's timeout
        log = "".join(leader.log)
        # Epoch 1's closed at epoch 3's change (retired at epoch 2's, a timeout before); epoch
        # 2's and 3's, retired within the timeout before epoch 4's change, not yet; epoch 0's
        # never.
        assert "the cross-replica groups of epoch 1 closed" in log, log[-3000:]
        for kept in (0, 2, 3):
            assert f"groups of epoch {kept} closed" not in log, log[-3000:]
        weight, info, clients, errors = train(list(mesh.fronts))
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        assert [c.moves for c in clients] == [0] * WORLD


@pytest.mark.parametrize("size,killed", [(2, 1), (4, 3)], ids=["2x1", "2x2-rank-3"])
def test_a_replica_restarted_while_the_trainers_run(size, killed):
    """The killed process started again at once, while the trainers go on stepping: whenever the
    leader admits it (between two mesh steps, maybe while trainers wait at a step — answered
    MESH_RECONFIGURING, asked again at the front that serves each), no trainer loop sees an
    exception, every step is applied, and W equals the run with no loss."""
    with start_mesh(size) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors
    mesh = start_mesh(size)
    with mesh:
        leader, victim = mesh.ranks[0], mesh.ranks[killed]

        def kill():
            victim.process.send_signal(signal.SIGKILL)
            victim.wait_exit(30)
            restart(mesh, killed)  # not waited for: the trainers go on at once

        weight, info, clients, errors = train(list(mesh.fronts), kill=kill)
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        wait_for(leader, HEALED, 60)
        mesh.ranks[killed].wait_listening()
        with remotehead.Client(mesh.fronts[1]) as replica_1:
            assert (replica_1.export_weights(HEAD)[0] == weight).all()
    # A trainer that moved back in the middle of a step left part of its micro-batches in the
    # other replica's dW: the step's sum is grouped otherwise than in a run that never moved, so
    # an element whose AdamW v is tiny may differ by more than 1e-6 (seen: 7e-6); the norm
    # stays within 1e-6.
    assert_same_run(weight, reference, 1e-6, element_rtol=1e-5)


def test_cpp_trainers_come_back_to_a_healed_replica(tmp_path):
    """The C++ client's side of it with real processes: the 2 x 1 run above by 4 C++ trainer
    processes (tests/client/mesh_trainer.cc) — trainers 1 and 3 move to the leader, replay one
    call, and move back to the healed replica without resending; W equals the Python trainers'
    run with no loss."""
    with start_mesh(2) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors
    mesh = start_mesh(2)
    with mesh:
        leader, victim = mesh.ranks

        weight, info, codes, stats, errors = train_cpp(
            list(mesh.fronts), tmp_path, lambda: victim.process.send_signal(signal.SIGKILL),
            healer(mesh, 1, leader))
    assert codes == [0] * WORLD, errors
    assert info.weight_version == STEPS
    assert [s["moves"] for s in stats] == [0, 2, 0, 2]
    assert [s["replays"] for s in stats] == [0, 1, 0, 1]
    assert [s["replica"] for s in stats] == [0, 1, 0, 1]
    assert_same_run(weight, reference, 1e-6)


@pytest.mark.parametrize("size,killed", [(2, 1), (4, 3)], ids=["2x1", "2x2-rank-3"])
def test_a_drain_during_an_admission_saves_one_state_on_every_member(tmp_path, monkeypatch,
                                                                      size, killed):
    """SIGTERM to the leader after it admitted the restarted replica, before the heal
    (--testonly_mesh_pause=before_heal): the drain waits for the heal, then saves one state on
    every member — the joiner's included — and every process exits 0."""
    monkeypatch.setenv("REMOTEHEAD_TESTONLY", "1")
    states = tmp_path / "state"
    mesh = start_mesh(size, f"--state_dir={states}", "--testonly_mesh_pause=before_heal,2,2")
    with mesh:
        leader = mesh.ranks[0]
        with remotehead.Client(list(mesh.fronts), rank=0) as trainer:
            trainer.create_head(HEAD, 40, 16, seed=5)
        mesh.ranks[killed].process.send_signal(signal.SIGKILL)
        wait_for(leader, "replica 1 evicted", 60)
        restart(mesh, killed)
        wait_for(leader, "testonly: replica 0 pauses before_heal of epoch 2", 60)
        leader.process.send_signal(signal.SIGTERM)
        codes = [rank.wait_exit(120) for rank in mesh.ranks]
        log = "".join(leader.log)
        assert codes == [0] * size, [("".join(r.log))[-2000:] for r in mesh.ranks]
        assert HEALED in log, log
        saved = re.search(r'head states saved on every rank: "h" as (\S+)', log)
        assert saved, log
        half = size // 2
        for shard in range(half):
            assert state_file(states, shard, saved.group(1)) == \
                state_file(states, half + shard, saved.group(1))


def test_a_stranger_cannot_join(tmp_path):
    mesh = start_mesh(2)
    with mesh:
        victim = mesh.ranks[1]
        victim.process.send_signal(signal.SIGKILL)
        wait_for(mesh.ranks[0], "replica 1 evicted", 60)
        # The same flags but another group secret: the mesh's session does not verify.
        other = tmp_path / "other-secret"
        other.write_bytes(b"x" * 32)
        args = [a for a in victim.args if not a.startswith("--group_secret_file=")]
        stranger = LocalServer(BINARY, [*args, f"--group_secret_file={other}"])
        stranger.launch()
        assert stranger.wait_exit(60) != 0
        time.sleep(1.5)  # a few of the leader's admission rounds
        log = "".join(mesh.ranks[0].log)
        assert "admitted" not in log, log
        with remotehead.Client(mesh.ranks[0].target) as front:
            assert front.health() == "SERVING"


def test_a_heal_that_fails_verification_evicts_the_joiner(monkeypatch):
    with start_mesh(2) as mesh:
        reference, _, _, ref_errors = train(list(mesh.fronts))
    assert ref_errors == [None] * WORLD, ref_errors
    monkeypatch.setenv("REMOTEHEAD_TESTONLY", "1")
    mesh = start_mesh(2)
    with mesh:
        leader, victim = mesh.ranks
        joiners = []

        def heal():
            victim.args.append("--testonly_mesh_corrupt_heal")
            joiners.append(restart(mesh, 1))
            wait_for(leader, "the heal of replica 1 failed", 60)
            assert joiners[0].wait_exit(60) == 1
            mesh.ranks[1] = victim  # gone: the stop has nothing more to stop there

        weight, info, clients, errors = train(
            list(mesh.fronts), kill=lambda: victim.process.send_signal(signal.SIGKILL),
            heal=heal)
        assert errors == [None] * WORLD, errors
        assert info.weight_version == STEPS
        assert [c.replica for c in clients] == [0, 0, 0, 0]
        assert "heal refused" in "".join(joiners[0].log), "".join(joiners[0].log)[-3000:]
        url = f"http://127.0.0.1:{leader.metrics_port}/metrics"
        assert metric(url, 'remotehead_mesh_heals_total{result="failed"}') == 1
        assert metric(url, "remotehead_mesh_replicas_live") == 1
    assert_same_run(weight, reference, 1e-6)
