"""Durable state on head groups and meshes (--state_dir with --group_size / --group_replicas),
with real server processes (Gloo on loopback).

Every rank keeps its shard's states in <state_dir>/rank-<g>, under state ids the front (the
mesh's leader) chose for all ranks; at start the ranks agree on each head's newest state that
every rank holds.

- A group of 2 and a 2 x 2 mesh: SaveHeadState writes one file of the same id on every rank;
  RestoreHeadState puts every replica back to it (weights bit-identical to those exported at the
  save, version and optimizer state: the next step equals the step taken after the save).
- A restore that one rank cannot do (its file is gone) is refused and changes no rank.
- A 2 x 2 mesh saving every step loses rank 3 (SIGKILL) after step 3, whose save rank 2 never
  finished (its file removed): restarted on the same directories it comes back at version 2,
  the newest state every rank saved, on every replica, with a new incarnation; a trainer still
  holding the old incarnation gets ServerRestartedError.
- The same directories started as another layout (4 x 1) are refused by every rank, naming the
  rank and the file.
- transformers' Trainer with 2 processes (torchrun) on a 2 x 2 mesh, rank 3 killed at the end of
  step 4: the mesh restarted on its state and the Trainer resumed from checkpoint-3 equal an
  uninterrupted run on the same layout (losses of steps 4-6 and the head, relative 1e-6).
- Replica 1 restored from a valid state of the same id whose weights differ (a file re-sealed
  under the group's secret): the next step's weight checksum fails it with REPLICAS_DIVERGED
  (DATA_LOSS) and counts a mismatch.

The states are sealed under the group's secret (--group_secret_file): every run on a state
directory is given the same one (group_secret).
"""

import contextlib
import os
import pathlib
import secrets
import signal
import subprocess
import sys

import pytest
import torch

import remotehead
from remotehead.local_server import LocalHeadGroup

from state_files import forge_weight
from test_data_parallel import TORCHRUN, env, free_port, trainer_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
VOCAB, HIDDEN, ROWS, WORLD = 37, 16, 12, 2
ADAMW = dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)


def group_secret(state_dir) -> pathlib.Path:
    """The group's secret of every run on `state_dir` (beside it): it seals their states, so a
    restart must be given the same one."""
    path = pathlib.Path(state_dir).parent / f"{pathlib.Path(state_dir).name}.secret"
    if not path.exists():
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
    return path


def start(state_dir, replicas, per_replica, *flags):
    return LocalHeadGroup(BINARY, size=replicas * per_replica, replicas=replicas,
                          args=("--device=cpu", "--torch_threads=1",
                                "--sync_step_timeout_seconds=4", f"--state_dir={state_dir}",
                                *flags),
                          timeout_seconds=10, secret_file=str(group_secret(state_dir))).start()


@contextlib.contextmanager
def running(state_dir, replicas=2, per_replica=2, *flags):
    """A mesh (a group for replicas=1) with a head "h", stopped cleanly at the end."""
    mesh = start(state_dir, replicas, per_replica, *flags)
    try:
        with remotehead.Client(mesh.fronts, rank=0) as client:
            client.create_head("h", VOCAB, HIDDEN, seed=3)
            yield mesh, client
    finally:
        stop(mesh)


def logs(mesh):
    return "".join(line for rank in mesh.ranks for line in rank.log)


def stop(mesh):
    codes = mesh.stop()
    assert codes == [0] * len(codes), logs(mesh)


def batch(trainer, step):
    g = torch.Generator().manual_seed(1000 * step + trainer)
    return torch.randn(ROWS, HIDDEN, generator=g), torch.randint(0, VOCAB, (ROWS,), generator=g)


def train_step(fronts, head_id, step):
    """One synchronous AdamW step of WORLD trainers, trainer t at fronts[t mod R]."""
    import concurrent.futures

    def trainer(rank):
        with remotehead.Client(fronts, rank=rank) as client:
            hidden, targets = batch(rank, step)
            client.forward_backward(head_id, hidden, targets, reduction="sum", accumulate=True,
                                    gradient_id=remotehead.GradientId(f"t{rank}", step, 0))
            return client.optimizer_step(head_id, adamw=ADAMW, zero_gradients=True,
                                         synchronous=(step, rank, WORLD)).weight_version
    with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(trainer, range(WORLD)))


def replica_weights(mesh, head_id):
    """(weights, version) as every replica's front holds them."""
    out = []
    for front in mesh.fronts:
        with remotehead.Client(front) as client:
            out.append((client.export_weights(head_id)[0],
                        client.describe_head(head_id).weight_version))
    return out


def state_files(state_dir, size, head_id):
    return [sorted(p.name for p in (state_dir / f"rank-{g}" / head_id).glob("*.safetensors"))
            for g in range(size)]


@pytest.mark.parametrize("replicas,per_replica", [(1, 2), (2, 2)], ids=["group2", "mesh2x2"])
def test_save_and_restore_run_on_every_rank_under_one_state_id(tmp_path, replicas, per_replica):
    state_dir = tmp_path / "state"
    with running(state_dir, replicas, per_replica) as (mesh, client):
        train_step(mesh.fronts, "h", 0)
        saved = client.save_head_state("h")
        assert saved.weight_version == 1
        files = state_files(state_dir, replicas * per_replica, "h")
        assert files == [[saved.state_id + ".safetensors"]] * len(files), files
        at_save = replica_weights(mesh, "h")
        train_step(mesh.fronts, "h", 1)
        after_first = replica_weights(mesh, "h")
        train_step(mesh.fronts, "h", 2)

        restored = client.restore_head_state("h", saved.state_id)
        assert restored.weight_version == 1
        for (w, version), (w_saved, _) in zip(replica_weights(mesh, "h"), at_save):
            assert version == 1 and torch.equal(w, w_saved)
        # The optimizer state came back too: the same step again gives the same weights.
        train_step(mesh.fronts, "h", 1)
        for (w, version), (w_then, _) in zip(replica_weights(mesh, "h"), after_first):
            assert version == 2 and torch.equal(w, w_then)


def test_a_restore_that_one_rank_cannot_do_changes_no_rank(tmp_path):
    state_dir = tmp_path / "state"
    with running(state_dir) as (mesh, client):
        saved = client.save_head_state("h")
        train_step(mesh.fronts, "h", 0)
        before = replica_weights(mesh, "h")
        (state_dir / "rank-3" / "h" / f"{saved.state_id}.safetensors").unlink()
        with pytest.raises(remotehead.RemoteheadError) as refused:
            client.restore_head_state("h", saved.state_id)
        assert refused.value.code.name == "NOT_FOUND", refused.value
        assert saved.state_id in refused.value.details
        for (w, version), (w_before, _) in zip(replica_weights(mesh, "h"), before):
            assert version == 1 and torch.equal(w, w_before)


def test_a_mesh_that_lost_a_rank_restarts_at_the_newest_state_every_rank_saved(tmp_path):
    state_dir = tmp_path / "state"
    flags = ("--checkpoint_every_steps=1",)
    mesh = start(state_dir, 2, 2, *flags)
    try:
        with remotehead.Client(mesh.fronts, rank=0) as client:
            client.create_head("h", VOCAB, HIDDEN, seed=3)
            old = client.describe_head("h").incarnation
            for step in range(2):
                train_step(mesh.fronts, "h", step)
            at_two = replica_weights(mesh, "h")
            train_step(mesh.fronts, "h", 2)
        files = state_files(state_dir, 4, "h")
        assert all(len(f) == 3 for f in files) and len({tuple(f) for f in files}) == 1, files
        # Rank 2 never finished saving version 3; rank 3 is lost.
        (state_dir / "rank-2" / "h" / files[2][-1]).unlink()
        mesh.ranks[3].process.send_signal(signal.SIGKILL)
        mesh.ranks[3].process.wait(timeout=30)
    finally:
        mesh.stop()

    restarted = start(state_dir, 2, 2, *flags)
    try:
        for rank in restarted.ranks:
            assert f'head restored: "h" version 2' in "".join(rank.log), logs(restarted)
        weights = replica_weights(restarted, "h")
        for (w, version), (w_two, _) in zip(weights, at_two):
            assert version == 2 and torch.equal(w, w_two)
        with remotehead.Client(restarted.fronts, rank=0) as client:
            assert client.describe_head("h").incarnation != old
            # A trainer that still holds the old incarnation cannot go on silently.
            with pytest.raises(remotehead.ServerRestartedError):
                client.optimizer_step("h", adamw=ADAMW, expected_incarnation=old)
            # Training goes on from version 2.
            assert train_step(restarted.fronts, "h", 2) == [3] * WORLD
    finally:
        stop(restarted)


def test_states_saved_by_another_layout_are_refused_by_every_rank(tmp_path):
    state_dir = tmp_path / "state"
    with running(state_dir) as (_, client):
        client.save_head_state("h")
    other = LocalHeadGroup(BINARY, size=4, replicas=4,
                           args=("--device=cpu", f"--state_dir={state_dir}"), timeout_seconds=10,
                           secret_file=str(group_secret(state_dir)))
    for rank in other.ranks:
        rank.launch()
    codes = [rank.process.wait(timeout=60) for rank in other.ranks]
    other.stop()
    assert codes == [2] * 4, logs(other)
    for rank in other.ranks:
        log = "".join(rank.log)
        assert "rank 1: --state_dir:" in log and "rank-1/h/" in log, log
        assert "saved by another layout" in log, log


def test_trainer_resumes_on_a_mesh_restarted_after_a_rank_was_killed(tmp_path):
    flags = ["--steps=6", "--accumulation=2", "--batch=1", "--head-id=resumed", "--save-steps=3"]
    mesh = start(tmp_path / "state-a", 2, 2)
    try:
        full = trainer_run(2, tmp_path / "full.pt", *flags, f"--server={','.join(mesh.fronts)}",
                           output_dir=tmp_path / "a")
    finally:
        stop(mesh)

    state_dir = tmp_path / "state-b"
    mesh = start(state_dir, 2, 2)
    try:
        killed = subprocess.run(
            [TORCHRUN, "--nproc_per_node=2", f"--master_port={free_port()}",
             str(HERE / "ddp_trainer_job.py"), *flags, f"--server={','.join(mesh.fronts)}",
             f"--kill-at=4:{mesh.ranks[3].process.pid}", f"--out={tmp_path / 'killed.pt'}",
             f"--output-dir={tmp_path / 'b'}"],
            env=env(), capture_output=True, text=True, timeout=600)
        assert killed.returncode != 0 and "killed server process" in killed.stderr, (
            killed.stdout[-2000:] + killed.stderr[-4000:])
        assert mesh.ranks[3].process.wait(timeout=30) == -signal.SIGKILL
    finally:
        mesh.stop()
    assert (tmp_path / "b" / "checkpoint-3" / "remotehead_state.json").is_file()

    mesh = start(state_dir, 2, 2)
    try:
        for rank in mesh.ranks:  # the state of checkpoint-3, the newest every rank saved
            assert 'head restored: "resumed" version 3' in "".join(rank.log), logs(mesh)
        resumed = trainer_run(2, tmp_path / "resumed.pt", *flags,
                              f"--server={','.join(mesh.fronts)}",
                              f"--resume={tmp_path / 'b' / 'checkpoint-3'}",
                              output_dir=tmp_path / "b")
        (w_a, v_a), (w_b, v_b) = replica_weights(mesh, "resumed")
    finally:
        stop(mesh)
    assert v_a == v_b == 6 and torch.equal(w_a, w_b)
    assert len(resumed["losses"]) == len(full["losses"]) == 6
    for step in range(3, 6):  # steps 4-6, trained again after the resume
        a, e = resumed["losses"][step], full["losses"][step]
        assert abs(a - e) <= 1e-6 * abs(e), (step + 1, a, e)
    scale = full["head"].abs().max().item()
    assert (resumed["head"] - full["head"]).abs().max().item() <= 1e-6 * scale


def test_replicas_restored_from_states_that_differ_are_caught_by_the_checksum(tmp_path):
    """Replica 1's disk holds a state of the same id whose weights differ (a valid file: another
    run's, a mixed-up volume): the mesh restores it, and the next step's weight checksum
    (--mesh_checksum_every_steps=1) fails it with REPLICAS_DIVERGED on every trainer and counts a
    mismatch."""
    state_dir = tmp_path / "state"
    flags = ("--mesh_checksum_every_steps=1", "--metrics_address=127.0.0.1:0")
    with running(state_dir, 2, 1, *flags) as (mesh, client):
        client.save_head_state("h")
    # The newest state, which the restart restores: the one the drain at the stop saved. Sealed
    # under the group's secret like the original: the seal does not catch it, the checksum
    # across replicas does.
    newest = state_files(state_dir, 2, "h")[1][-1]
    forge_weight(state_dir / "rank-1" / "h" / newest, 0.25,
                 group_secret(state_dir).read_bytes().strip())

    restarted = start(state_dir, 2, 1, *flags)
    try:
        (w0, _), (w1, _) = replica_weights(restarted, "h")
        assert not torch.equal(w0, w1) and (w1 - w0).abs().max().item() == 0.25
        with pytest.raises(remotehead.ReplicasDivergedError) as diverged:
            train_step(restarted.fronts, "h", 0)
        assert diverged.value.code.name == "DATA_LOSS", diverged.value
        import urllib.request
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{restarted.ranks[0].metrics_port}/metrics", timeout=5).read()
        assert b'remotehead_mesh_checksums_total{result="mismatch"} 1' in body, body
    finally:
        restarted.stop()
