"""--state_dir follows no link and never blocks, with a real server process:

- a head's directory or its newest state that is a symbolic link (to a valid state outside the
  directory) is never read: the server refuses to start, naming the entry;
- a save into a head directory that is a link writes nothing outside (PERMISSION_DENIED);
- a FIFO where the newest state should be: the server refuses to start at once (never hangs), and
  a RestoreHeadState of one fails at once while saves go on (no lock held);
- temporary files of crashed saves are removed at start;
- a head id whose states could not be saved (too long once escaped) is refused at creation,
  naming the limit; no message carries the server's absolute path;
- at SIGTERM every head is saved on its own: one that cannot be saved does not keep the others
  from being saved, and the server exits non-zero naming it.
"""

import os
import pathlib
import shutil
import subprocess
import threading
import time

import pytest
import torch

import remotehead
from remotehead import RemoteheadError
from remotehead.local_server import LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
V, D = 37, 8


def server(state_dir, *extra):
    return LocalServer(BINARY, ["--device=cpu", "--torch_threads=1", f"--state_dir={state_dir}",
                                *extra])


def start_refused(state_dir, timeout=30.0):
    """Starts a server on `state_dir` that must refuse to start: its exit code and output."""
    result = subprocess.run([BINARY, "--listen=127.0.0.1:0", "--device=cpu",
                             f"--state_dir={state_dir}"], capture_output=True, text=True,
                            timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def saved_state(tmp_path, head_id="h", seed=1):
    """A state directory holding one saved state of `head_id`: (its directory, the state's file)."""
    state_dir = tmp_path / f"state-{head_id}-{seed}"
    with server(state_dir) as s, remotehead.Client(s.target) as client:
        client.create_head(head_id, V, D, seed=seed)
        state_id = client.save_head_state(head_id).state_id
    return state_dir, state_dir / head_id / f"{state_id}.safetensors"


def test_a_linked_head_directory_is_never_read(tmp_path):
    outside, _ = saved_state(tmp_path, seed=7)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "h").symlink_to(outside / "h", target_is_directory=True)
    code, output = start_refused(state_dir)
    assert code == 2, output
    assert '"h" is a symbolic link' in output and "never followed" in output, output


def test_a_linked_newest_state_is_never_read(tmp_path):
    state_dir, state = saved_state(tmp_path, seed=1)
    outside, outside_state = saved_state(tmp_path, seed=7)
    newer = state.parent / ("9" * 20 + "-" + "0" * 16 + ".safetensors")
    newer.symlink_to(outside_state)
    code, output = start_refused(state_dir)
    assert code == 2, output
    assert "symbolic link" in output and newer.name in output, output


def test_a_save_into_a_linked_head_directory_writes_nothing_outside(tmp_path):
    state_dir = tmp_path / "state"
    outside = tmp_path / "outside"
    outside.mkdir()
    with server(state_dir) as s, remotehead.Client(s.target) as client:
        client.create_head("h", V, D, seed=1)
        (state_dir / "h").symlink_to(outside, target_is_directory=True)
        with pytest.raises(RemoteheadError) as refused:
            client.save_head_state("h")
        assert refused.value.code.name == "PERMISSION_DENIED", refused.value
        assert str(tmp_path) not in refused.value.details  # no server path for the client
        assert list(outside.iterdir()) == []
        (state_dir / "h").unlink()
        assert client.save_head_state("h").state_id  # a real directory again: saved


def test_a_fifo_as_the_newest_state_never_blocks_a_start(tmp_path):
    state_dir, state = saved_state(tmp_path)
    os.mkfifo(state.parent / ("9" * 20 + "-" + "0" * 16 + ".safetensors"))
    start = time.monotonic()
    code, output = start_refused(state_dir, timeout=30)
    assert time.monotonic() - start < 20
    assert code == 2, output
    assert "expected a regular file; got a FIFO" in output, output


def test_restoring_a_fifo_fails_at_once_and_saves_go_on(tmp_path):
    state_dir = tmp_path / "state"
    with server(state_dir) as s, remotehead.Client(s.target, timeout=20) as client:
        client.create_head("h", V, D, seed=1)
        client.save_head_state("h")
        fifo_id = "9" * 20 + "-" + "0" * 16
        os.mkfifo(state_dir / "h" / f"{fifo_id}.safetensors")
        start = time.monotonic()
        with pytest.raises(RemoteheadError) as refused:
            client.restore_head_state("h", fifo_id)
        assert time.monotonic() - start < 5
        assert "expected a regular file; got a FIFO" in refused.value.details
        assert str(tmp_path) not in refused.value.details
        saved = threading.Thread(target=client.save_head_state, args=("h",))
        saved.start()
        saved.join(timeout=10)
        assert not saved.is_alive(), "a save waited behind the FIFO"
        os.unlink(state_dir / "h" / f"{fifo_id}.safetensors")


def test_temporary_files_of_crashed_saves_are_removed_at_start(tmp_path):
    state_dir, state = saved_state(tmp_path)
    leftovers = [state.parent / f".{state.name}.tmp-{pid}-0" for pid in (123, 4567)]
    for path in leftovers:
        shutil.copy(state, path)
    unrelated = state.parent / "notes.txt"
    unrelated.write_text("kept")
    with server(state_dir) as s:
        assert "removed 2 temporary file(s)" in "".join(s.log)
        assert not any(p.exists() for p in leftovers)
        assert unrelated.exists() and state.exists()


def test_an_id_that_cannot_be_saved_is_refused_at_creation(tmp_path):
    state_dir = tmp_path / "state"
    with server(state_dir) as s, remotehead.Client(s.target) as client:
        too_long = "/" * 100  # 100 bytes, 300 once escaped
        with pytest.raises(RemoteheadError) as refused:
            client.create_head(too_long, V, D)
        assert refused.value.code.name == "INVALID_ARGUMENT"
        assert refused.value.details.startswith("head_id: expected an id whose states can be "
                                                "saved in --state_dir: at most 255 bytes")
        assert "escape to 300" in refused.value.details
        with pytest.raises(RemoteheadError) as uploaded:
            client.upload_head(too_long, torch.zeros(V, D))
        assert uploaded.value.code.name == "INVALID_ARGUMENT"
        assert "header.head_id: expected an id whose states" in uploaded.value.details
        fits = "a" * 255
        client.create_head(fits, V, D)
        assert client.save_head_state(fits).state_id


def test_every_head_is_saved_on_its_own_at_shutdown(tmp_path):
    state_dir = tmp_path / "state"
    s = server(state_dir).start()
    with remotehead.Client(s.target) as client:
        for head_id in ("a", "b", "c"):
            client.create_head(head_id, V, D, seed=3)
    # "b"'s directory cannot be made: a regular file has its name.
    (state_dir / "b").write_text("in the way")
    code = s.stop()
    log = "".join(s.log)
    assert code != 0, log
    assert 'head states NOT saved at shutdown: 1 of 3 head states not saved: "b"' in log, log
    assert str(state_dir) not in log.split("NOT saved at shutdown")[1].splitlines()[0]
    for head_id in ("a", "c"):
        assert len(list((state_dir / head_id).glob("*.safetensors"))) == 1, head_id
    (state_dir / "b").unlink()
    with server(state_dir) as again, remotehead.Client(again.target) as client:
        assert sorted(h.head_id for h in client.list_heads()) == ["a", "c"]
