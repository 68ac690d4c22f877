"""The coordinated drain of a head group or mesh at SIGTERM (server/src/replication/
cluster_drain.h), with real server processes (Gloo on loopback).

- A 2 x 2 mesh with --state_dir and no periodic saves (--checkpoint_every_steps=0) takes two
  synchronous AdamW steps from two trainers; SIGTERM to global rank 3 (no front): every process
  exits 0 within a bound, logging the one state id saved, every rank's state directory holds a
  file of that id, and the mesh restarted on the same directories restores it on every rank:
  weights (ExportWeights at both replica fronts) and weight_version as before the drain.
- A mesh of 2 replicas with a step timeout (40 s) longer than the drain's patience (5 + 10 + 5 s):
  trainer 0 waits at the leader's front in synchronous step 1 for trainer 1, who never comes —
  the leader has already started the mesh's step, replica 1's front waits for its trainer.
  SIGTERM to the leader, to replica 1's front, or (2 x 2) to replica 1's second rank: trainer 0 is answered at once (a few seconds,
  far below the step timeout) with UNAVAILABLE, reason SERVER_DRAINING; every process exits 0
  logging the one state saved on every rank; restarted on the same directories, every rank
  restores it at version 1 (the step refused applied nothing anywhere), weights as before.
- A group of 2, SIGTERM to its front while an UploadHead is streaming: a call started after the
  signal is refused at once (UNAVAILABLE, reason SERVER_DRAINING), the upload finishes OK, and
  its weights are in the state saved (the restarted group restores them).
"""

import os
import pathlib
import signal
import threading
import time

import grpc
import pytest
import torch

import remotehead

from remotehead.local_server import LocalHeadGroup
from test_mesh_state import (ADAMW, batch, group_secret, replica_weights, start, state_files,
                             train_step)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
VOCAB, HIDDEN = 37, 16
DRAINED = "remotehead-server: drained (SIGTERM on global rank {rank}); head states saved on " \
          "every rank: "


def wait_exited(mesh, timeout):
    """Every rank's exit code, each having exited by itself within `timeout` seconds of the
    call (its remaining output read into its log)."""
    deadline = time.monotonic() + timeout
    codes = []
    for rank in mesh.ranks:
        codes.append(rank.wait_exit(timeout=max(0.1, deadline - time.monotonic())))
    return codes


def logs(mesh):
    return "".join(line for rank in mesh.ranks for line in rank.log)


def saved_state_id(rank_log, rank, head_id):
    """The state id a rank logged for `head_id` in its one "drained" line."""
    lines = [line for line in rank_log if line.startswith(DRAINED.format(rank=rank))]
    assert len(lines) == 1, "".join(rank_log)
    mark = f'"{head_id}" as '
    return lines[0].split(mark, 1)[1].split(",")[0].strip()


def test_sigterm_to_a_rank_of_a_mesh_saves_every_rank_and_the_restart_restores_it(tmp_path):
    state_dir = tmp_path / "state"
    flags = ("--checkpoint_every_steps=0", "--shutdown_grace_seconds=5")
    mesh = start(state_dir, 2, 2, *flags)
    try:
        with remotehead.Client(mesh.fronts, rank=0) as client:
            client.create_head("h", VOCAB, HIDDEN, seed=3)
        for step in range(2):
            assert train_step(mesh.fronts, "h", step) == [step + 1] * 2
        before = replica_weights(mesh, "h")
        assert state_files(state_dir, 4, "h") == [[]] * 4  # nothing saved by the steps
        began = time.monotonic()
        mesh.ranks[3].process.send_signal(signal.SIGTERM)
        codes = wait_exited(mesh, timeout=30)
        took = time.monotonic() - began
    finally:
        mesh.stop()
    assert codes == [0] * 4, logs(mesh)
    assert took < 15, (took, logs(mesh))
    ids = {saved_state_id(rank.log, 3, "h") for rank in mesh.ranks}
    assert len(ids) == 1, logs(mesh)
    (state_id,) = ids
    assert state_files(state_dir, 4, "h") == [[f"{state_id}.safetensors"]] * 4
    assert "asked global rank 0 to drain" in "".join(mesh.ranks[3].log)

    restarted = start(state_dir, 2, 2, *flags)
    try:
        for rank in restarted.ranks:
            assert 'head restored: "h" version 2' in "".join(rank.log), logs(restarted)
        for (w, version), (w_before, version_before) in zip(replica_weights(restarted, "h"),
                                                             before):
            assert version == version_before == 2 and torch.equal(w, w_before)
        # Training goes on from there, on every replica alike.
        assert train_step(restarted.fronts, "h", 2) == [3] * 2
    finally:
        codes = restarted.stop()
    assert codes == [0] * 4, logs(restarted)


STEP_TIMEOUT = 40.0  # longer than the drain's patience: the drain must not wait for it
DRAIN_FLAGS = ("--checkpoint_every_steps=0", "--shutdown_grace_seconds=5",
               "--drain_save_seconds=10", f"--sync_step_timeout_seconds={STEP_TIMEOUT}")


def start_long_steps(state_dir, per_replica):
    """A mesh of 2 replicas of `per_replica` ranks each whose fronts wait STEP_TIMEOUT for
    trainers (the group's timeout above twice that: a front waits for its trainers at most half
    of it)."""
    return LocalHeadGroup(BINARY, size=2 * per_replica, replicas=2,
                          args=("--device=cpu", "--torch_threads=1", f"--state_dir={state_dir}",
                                *DRAIN_FLAGS),
                          timeout_seconds=2 * STEP_TIMEOUT + 10,
                          secret_file=str(group_secret(state_dir))).start()


# (ranks per replica, the global rank signalled): the leader, replica 1's front, and on a 2 x 2
# mesh replica 1's second rank (no front).
SIGNALLED = {"2x1-leader": (1, 0), "2x1-replica-1s-front": (1, 1), "2x2-rank-3": (2, 3)}


@pytest.mark.parametrize("per_replica,signalled", SIGNALLED.values(), ids=SIGNALLED.keys())
def test_sigterm_answers_a_step_the_leader_started_at_once_and_saves_every_rank(
        tmp_path, per_replica, signalled):
    state_dir = tmp_path / "state"
    size = 2 * per_replica
    mesh = start_long_steps(state_dir, per_replica)
    try:
        with remotehead.Client(mesh.fronts, rank=0) as client:
            client.create_head("h", VOCAB, HIDDEN, seed=3)
        assert train_step(mesh.fronts, "h", 0) == [1, 1]
        before = replica_weights(mesh, "h")
        result = {}

        def trainer_0():
            with remotehead.Client(mesh.fronts, rank=0, max_attempts=1) as client:
                hidden, targets = batch(0, 1)
                client.forward_backward("h", hidden, targets, reduction="sum", accumulate=True,
                                        gradient_id=remotehead.GradientId("t0", 1, 0))
                result["asked"] = time.monotonic()
                try:
                    client.optimizer_step("h", adamw=ADAMW, zero_gradients=True,
                                          synchronous=(1, 0, 2))
                    result["error"] = None
                except remotehead.RemoteheadError as e:
                    result["error"] = e
                result["at"] = time.monotonic()
        thread = threading.Thread(target=trainer_0)
        thread.start()
        # Trainer 0 is the leader's only trainer: the leader starts the mesh's step at once, and
        # replica 1's front waits in it for trainer 1.
        deadline = time.monotonic() + 10
        while "asked" not in result and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        assert "at" not in result, result
        began = time.monotonic()
        mesh.ranks[signalled].process.send_signal(signal.SIGTERM)
        thread.join(timeout=2 * STEP_TIMEOUT)
        assert not thread.is_alive(), "trainer 0 was never answered"
        codes = wait_exited(mesh, timeout=30)
        took = time.monotonic() - began
    finally:
        mesh.stop()
    error = result["error"]
    assert error is not None, "the step was applied without trainer 1"
    assert error.code.name == "UNAVAILABLE", (error, logs(mesh))
    assert error.reason == "SERVER_DRAINING", (error.reason, error.details)
    assert error.details == (
        'synchronous optimizer step 1 of head "h": the mesh is draining, and replica 1 stopped '
        "waiting for its trainers: nothing applied on any replica"), error.details
    assert result["at"] - began < 5.0, (result["at"] - began, logs(mesh))
    assert codes == [0] * size, logs(mesh)
    assert took < 15, (took, logs(mesh))
    ids = {saved_state_id(rank.log, signalled, "h") for rank in mesh.ranks}
    assert len(ids) == 1, logs(mesh)
    (state_id,) = ids
    assert state_files(state_dir, size, "h") == [[f"{state_id}.safetensors"]] * size

    restarted = start_long_steps(state_dir, per_replica)
    try:
        for rank in restarted.ranks:
            assert 'head restored: "h" version 1' in "".join(rank.log), logs(restarted)
        for (w, version), (w_before, version_before) in zip(replica_weights(restarted, "h"),
                                                             before):
            assert version == version_before == 1 and torch.equal(w, w_before)
    finally:
        codes = restarted.stop()
    assert codes == [0] * size, logs(restarted)


class HeldUploads:
    """A client stub whose UploadHead sends its header and first rows, then holds the rest of
    the stream until `release` is set: a call in flight for as long as the test wants."""

    def __init__(self, stub):
        self._stub = stub
        self.sent_first = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def UploadHead(self, requests, **kwargs):
        def held():
            for i, request in enumerate(requests):
                if i == 2:
                    self.sent_first.set()
                    assert self.release.wait(timeout=60)
                yield request
        return self._stub.UploadHead(held(), **kwargs)


def test_sigterm_to_a_groups_front_finishes_the_call_in_flight_refuses_new_ones_and_saves(
        tmp_path):
    state_dir = tmp_path / "state"
    flags = ("--checkpoint_every_steps=0", "--shutdown_grace_seconds=20")
    group = start(state_dir, 1, 2, *flags)
    uploaded = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))
    try:
        with remotehead.Client(group.target, chunk_bytes=1024) as uploader, \
                remotehead.Client(group.target, max_attempts=1) as late:
            late.create_head("h", VOCAB, HIDDEN, seed=3)
            uploader._stub = HeldUploads(uploader._stub)
            result = {}
            thread = threading.Thread(
                target=lambda: result.update(info=uploader.upload_head("u", uploaded)))
            thread.start()
            assert uploader._stub.sent_first.wait(timeout=30)
            group.ranks[0].process.send_signal(signal.SIGTERM)
            # A call started after the signal: refused at once, once the front drains.
            deadline = time.monotonic() + 10
            while True:
                try:
                    late.describe_head("h")
                except remotehead.RemoteheadError as e:
                    refused = e
                    break
                assert time.monotonic() < deadline, "the front never refused a new call"
                time.sleep(0.05)
            assert refused.code == grpc.StatusCode.UNAVAILABLE, refused
            assert refused.reason == "SERVER_DRAINING", refused
            uploader._stub.release.set()
            thread.join(timeout=30)
            assert result["info"].vocab_size == VOCAB, result
        codes = wait_exited(group, timeout=30)
    finally:
        group.stop()
    assert codes == [0, 0], logs(group)
    state_ids = {head: {saved_state_id(rank.log, 0, head) for rank in group.ranks}
                 for head in ("h", "u")}
    assert all(len(ids) == 1 for ids in state_ids.values()), logs(group)

    restarted = start(state_dir, 1, 2, *flags)
    try:
        with remotehead.Client(restarted.target) as client:
            assert torch.equal(client.export_weights("u")[0], uploaded)
            assert client.describe_head("h").weight_version == 0
    finally:
        codes = restarted.stop()
    assert codes == [0, 0], logs(restarted)
