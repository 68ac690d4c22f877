"""Head states sealed under a state secret (--state_secret_file; on a head group, else its
--group_secret_file), with real server processes.

Whoever can write a server's --state_dir can recompute a state's checksum; with a state secret
a state must also verify under it (HMAC-SHA256, metadata "mac"):

- one server: a state saved by another server under another secret, one saved by a server with
  no secret, and one of its own forged (a weight changed, the checksum recomputed), each planted
  as the newest state: the start refuses (exit 2), naming the file; removed, the start restores
  its own state;
- RestoreHeadState of a forged, an other-secret or an unsealed state is PERMISSION_DENIED naming
  the file relative to the state directory, and the head is unchanged; one sealed under the
  server's secret by whoever holds it (the secret is what is trusted) is restored;
- a head group of 2 (sealed under the group's secret): a forged state in rank 1's directory is
  refused by RestoreHeadState, changing no rank, and at start every rank refuses, naming rank 1
  and the file;
- a group given --state_secret_file seals under it, not under the group's secret: restarted
  with another group secret it restores its states; without the state secret it refuses them;
- the startup line: states NOT sealed (naming the flag that seals them) without a secret, which
  key seals them with one; --state_secret_file without --state_dir or of fewer than 16 bytes:
  exit 2 naming the flag.
"""

import os
import pathlib
import secrets
import shutil
import subprocess

import pytest
import torch

import remotehead
from remotehead.local_server import LocalHeadGroup, LocalServer

from state_files import forge_weight, read_state, write_state

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
V, D = 37, 8
NOT_VERIFIED = "one whose seal does not verify under it: forged, or sealed with another secret"
NO_SEAL = "one with no seal (saved by a server without a state secret, or forged)"


def secret_file(tmp_path, name) -> pathlib.Path:
    path = tmp_path / name
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def secret_of(path: pathlib.Path) -> bytes:
    return path.read_bytes().strip()  # as the server reads it: surrounding whitespace trimmed


def server_args(state_dir, secret=None):
    return ["--device=cpu", "--torch_threads=1", f"--state_dir={state_dir}",
            *([f"--state_secret_file={secret}"] if secret else [])]


def start_refused(*args, timeout=60.0):
    """A server that must refuse to start: its exit code and output."""
    result = subprocess.run([BINARY, "--listen=127.0.0.1:0", *args], capture_output=True,
                            text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def saved_by(tmp_path, name, secret):
    """The file of a state of head "h" (V x D) that a server of its own saved, under `secret`
    (None: no state secret), and that server's output."""
    state_dir = tmp_path / name
    with LocalServer(BINARY, server_args(state_dir, secret)) as s:
        with remotehead.Client(s.target) as client:
            client.create_head("h", V, D, seed=11)
            state_id = client.save_head_state("h").state_id
    return state_dir / "h" / f"{state_id}.safetensors", "".join(s.log)


def test_startup_says_whether_states_are_sealed(tmp_path):
    _, unsealed_log = saved_by(tmp_path, "unsealed", None)
    assert "are NOT sealed against forgery" in unsealed_log, unsealed_log
    assert "--state_secret_file seals them" in unsealed_log, unsealed_log
    _, sealed_log = saved_by(tmp_path, "sealed", secret_file(tmp_path, "s"))
    assert "are sealed under --state_secret_file (HMAC-SHA256)" in sealed_log, sealed_log
    assert "NOT sealed" not in sealed_log

    code, output = start_refused("--device=cpu", f"--state_secret_file={tmp_path / 's'}")
    assert code == 2 and "--state_secret_file: expected with --state_dir" in output, output
    short = tmp_path / "short"
    short.write_text("too short\n")
    code, output = start_refused(*server_args(tmp_path / "state", short))
    assert code == 2, output
    assert "--state_secret_file: expected 16 to 4096 bytes of secret" in output, output


def test_a_planted_state_stops_the_start_naming_the_file(tmp_path):
    secret = secret_file(tmp_path, "secret")
    state_dir = tmp_path / "state"
    with LocalServer(BINARY, server_args(state_dir, secret)) as s:
        with remotehead.Client(s.target) as client:
            client.create_head("h", V, D, seed=3)
            client.optimizer_step("h", sgd=dict(lr=0.1, weight_decay=0.1))
            client.save_head_state("h")
    own = sorted((state_dir / "h").glob("*.safetensors"))[-1]  # the SIGTERM drain's save
    original = own.read_bytes()

    # Saved after the server's own: each is the newest state when planted.
    other_secret, _ = saved_by(tmp_path, "other", secret_file(tmp_path, "other-secret"))
    unsealed, _ = saved_by(tmp_path, "unsealed", None)
    for planted, got in ((other_secret, NOT_VERIFIED), (unsealed, NO_SEAL)):
        target = state_dir / "h" / planted.name  # the name its metadata says: only the seal is off
        shutil.copyfile(planted, target)
        code, output = start_refused(*server_args(state_dir, secret))
        assert code == 2, output
        assert f"{target}: expected a head state sealed under the state secret " \
               f"(--state_secret_file); got {got}" in output, output
        target.unlink()

    forge_weight(own, 0.5)  # the checksum recomputed, the seal kept
    code, output = start_refused(*server_args(state_dir, secret))
    assert code == 2 and f"{own}: expected a head state sealed" in output, output
    assert NOT_VERIFIED in output, output

    own.write_bytes(original)
    with LocalServer(BINARY, server_args(state_dir, secret)) as s:
        assert 'head restored: "h" version 1' in "".join(s.log), s.log


def test_restoring_a_planted_state_is_refused_and_changes_nothing(tmp_path):
    secret = secret_file(tmp_path, "secret")
    state_dir = tmp_path / "state"
    with LocalServer(BINARY, server_args(state_dir, secret)) as s, \
            remotehead.Client(s.target) as client:
        client.create_head("h", V, D, seed=3)
        client.optimizer_step("h", sgd=dict(lr=0.1, weight_decay=0.1))
        saved = client.save_head_state("h").state_id
        client.optimizer_step("h", sgd=dict(lr=0.1, weight_decay=0.1))
        before = client.export_weights("h")[0]
        own = state_dir / "h" / f"{saved}.safetensors"
        header, data = read_state(own)

        def plant(state_id, secret_bytes, drop_seal=False):
            h = dict(header, __metadata__=dict(header["__metadata__"], state_id=state_id))
            if drop_seal:
                del h["__metadata__"]["mac"]
            write_state(state_dir / "h" / f"{state_id}.safetensors", h, data, secret_bytes)

        forge_weight(own, 0.5)
        other = saved[:20] + "-" + "1" * 16
        plant(other, secret_of(secret_file(tmp_path, "other-secret")))
        unsealed = saved[:20] + "-" + "2" * 16
        plant(unsealed, None, drop_seal=True)
        for state_id, got in ((saved, NOT_VERIFIED), (other, NOT_VERIFIED), (unsealed, NO_SEAL)):
            with pytest.raises(remotehead.RemoteheadError) as refused:
                client.restore_head_state("h", state_id)
            assert refused.value.code.name == "PERMISSION_DENIED", refused.value
            assert refused.value.details == (
                f'--state_dir file "h/{state_id}.safetensors": expected a head state sealed under '
                f"the state secret (--state_secret_file); got {got} — it was not loaded")
            info = client.describe_head("h")
            assert info.weight_version == 2
            assert torch.equal(client.export_weights("h")[0], before)

        # Sealed under the server's secret by whoever holds it: restored.
        held = saved[:20] + "-" + "3" * 16
        plant(held, secret_of(secret))
        assert client.restore_head_state("h", held).weight_version == 1


def group(state_dir, group_secret, *flags):
    return LocalHeadGroup(BINARY, size=2, args=("--device=cpu", "--torch_threads=1",
                                                f"--state_dir={state_dir}", *flags),
                          timeout_seconds=10, secret_file=str(group_secret))


def group_refused(state_dir, group_secret, *flags):
    """A group that must refuse to start: every rank's exit code and output."""
    refused = group(state_dir, group_secret, *flags)
    for rank in refused.ranks:
        rank.launch()
    codes = [rank.process.wait(timeout=60) for rank in refused.ranks]
    refused.stop()
    return codes, ["".join(rank.log) for rank in refused.ranks]


def test_a_head_group_refuses_a_planted_state_naming_rank_and_file(tmp_path):
    group_secret = secret_file(tmp_path, "group-secret")
    state_dir = tmp_path / "state"
    with group(state_dir, group_secret) as g, remotehead.Client(g.target) as client:
        for rank in g.ranks:
            assert "are sealed under the group's --group_secret_file" in "".join(rank.log)
        client.create_head("h", V, D, seed=3)
        saved = client.save_head_state("h").state_id
        before = client.export_weights("h")[0]
        forged = state_dir / "rank-1" / "h" / f"{saved}.safetensors"
        forge_weight(forged, 0.5)
        with pytest.raises(remotehead.RemoteheadError) as refused:
            client.restore_head_state("h", saved)
        assert refused.value.code.name == "PERMISSION_DENIED", refused.value
        assert "rank 1" in refused.value.details, refused.value
        assert f'"h/{saved}.safetensors"' in refused.value.details, refused.value
        assert NOT_VERIFIED in refused.value.details, refused.value
        assert torch.equal(client.export_weights("h")[0], before)

    # The drain at stop saved a newer state on both ranks: rank 1's is forged, so that the
    # restart chooses it.
    newest = sorted((state_dir / "rank-1" / "h").glob("*.safetensors"))[-1]
    assert newest.name != forged.name
    forge_weight(newest, 0.5)
    codes, logs = group_refused(state_dir, group_secret)
    assert codes == [2, 2], logs
    for log in logs:
        assert f"rank 1: {newest}: expected a head state sealed" in log, log
        assert NOT_VERIFIED in log, log


def test_a_groups_state_secret_wins_over_its_group_secret(tmp_path):
    state_secret = secret_file(tmp_path, "state-secret")
    state_dir = tmp_path / "state"
    flag = f"--state_secret_file={state_secret}"
    with group(state_dir, secret_file(tmp_path, "group-1"), flag) as g, \
            remotehead.Client(g.target) as client:
        assert "are sealed under --state_secret_file" in "".join(g.ranks[0].log)
        client.create_head("h", V, D, seed=3)
        client.save_head_state("h")

    # The group's secret rotated: the states still verify under the state secret.
    with group(state_dir, secret_file(tmp_path, "group-2"), flag) as g:
        for rank in g.ranks:
            assert 'head restored: "h" version 0' in "".join(rank.log), rank.log

    # Without it the group's secret seals: states sealed under the state secret are refused.
    codes, logs = group_refused(state_dir, tmp_path / "group-2")
    assert codes == [2, 2], logs
    assert NOT_VERIFIED in logs[0] and "(the group's --group_secret_file)" in logs[0], logs[0]
