"""The coordinated drain of a head group or mesh at SIGTERM (server/src/replication/
cluster_drain.h), with real server processes (Gloo on loopback).

- A 2 x 2 mesh with --state_dir and no periodic saves (--checkpoint_every_steps=0) takes two
  synchronous AdamW steps from two trainers; SIGTERM to global rank 3 (no front): every process
  exits 0 within a bound, logging the one state id saved, every rank's state directory holds a
  file of that id, and the mesh restarted on the same directories restores it on every rank:
  weights (ExportWeights at both replica fronts) and weight_version as before the drain.
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

from test_mesh_state import ADAMW, replica_weights, start, state_files, train_step

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
