"""The head group's control plane against strangers and hung ranks, with real server processes
(Gloo on loopback) and a real c10d TCPStore client playing the stranger:

- rank 0's store listens on the address --group_store names, never on every interface, and
  each rank's Gloo listener on --group_transport_host's when given;
- a command written into the group's log by someone without the group's secret is refused and
  logged, never executed, and the log stays in step: a ZeroGradients after it zeroes every
  rank's dW (the stale-reply failure), later steps equal one server's, every rank stays SERVING;
- a store beyond loopback needs --group_secret_file (or --group_trusted_network), and ranks
  whose secrets differ do not start;
- a rank stopped (SIGSTOP) mid-step is reported within one --group_timeout_seconds (not two);
- a rank stopped while idle and continued after the front gave up never runs the command it
  missed: it leaves the group (exit 1) saying why;
- a pending command (appended, not yet taken by a stopped rank) overwritten by a stranger takes
  the group down within a second or so, not one --group_timeout_seconds: the caller's error
  (word for word, metadata key and rank, no lost_* although the stopped rank's heartbeat has
  stopped for longer than the liveness watch's 1.2 s) and the front's log name the store key;
  the stopped rank, continued, refuses it and leaves. On a head group's log and on a mesh's.
"""

import datetime
import os
import pathlib
import re
import subprocess
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

import remotehead
from remotehead import RemoteheadError
from remotehead.local_server import LocalHeadGroup, LocalServer, free_port
from remotehead.v1 import head_service_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
ARGS = ("--device=cpu", "--torch_threads=1")
V, D = 61, 16


def listening(pid=None):
    """(address, port) of the TCP sockets listening on this host (from /proc/net/tcp{,6}), or
    only those process `pid` holds (its descriptors' socket:[inode] links)."""
    inodes = None
    if pid is not None:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed meanwhile
                continue
            if match:
                inodes.add(match[1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A" and (inodes is None or fields[9] in inodes):  # LISTEN
                    found.append((address if width == 32 else
                                  ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)),
                                  int(hex_port, 16)))
    return found


def listening_addresses(port: int):
    """The local addresses of the sockets listening on TCP `port`."""
    return [address for address, p in listening() if p == port]


def health_turns(client, status: str, within: float = 2.0) -> bool:
    """Whether the server's health reads `status` within `within` seconds (it is polled)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if client.health() == status:
            return True
        time.sleep(0.05)
    return False


def log_of(rank) -> str:
    return "".join(rank.log)


def drain(rank, timeout=30.0) -> int:
    """The exit code of a rank that ends on its own, its output read."""
    return rank.wait_exit(timeout)


def create_command(head_id: str) -> bytes:
    """A GroupCommand{create = CreateHeadRequest} as a stranger would encode it (field 1)."""
    request = pb.CreateHeadRequest(head_id=head_id)
    request.init.vocab_size = V
    request.init.hidden_size = D
    body = request.SerializeToString()
    return b"\x0a" + bytes([len(body)]) + body


def batch(seed: int, n: int = 40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randint(0, V, (n,), generator=g)


def test_the_store_listens_on_the_named_address_only():
    with LocalHeadGroup(BINARY, size=2, args=ARGS) as group:
        addresses = listening_addresses(group.store_port)
        assert addresses and all(a == "127.0.0.1" for a in addresses), addresses
        assert "store listening on 127.0.0.1:" in log_of(group.ranks[0])


def test_gloo_listens_on_the_transport_host_only():
    """--group_transport_host: every rank's Gloo listener (an ephemeral port, the only listener
    besides gRPC and rank 0's store) is on that address, which is where the peers connect."""
    args = (*ARGS, "--group_transport_host=127.0.0.2")
    with LocalHeadGroup(BINARY, size=2, args=args) as group, \
            remotehead.Client(group.target) as client:
        client.create_head("h", V, D, seed=3)
        x, t = batch(0)
        client.forward_backward("h", x, t, gradient_id=("t", 0, 0))  # the collectives work
        for rank in group.ranks:
            grpc_port = int(rank.target.rsplit(":", 1)[1])
            sockets = listening(rank.process.pid)
            gloo = [(a, p) for a, p in sockets if p not in (grpc_port, group.store_port)]
            assert gloo and all(a == "127.0.0.2" for a, _ in gloo), sockets
            assert grpc_port in {p for _, p in sockets}, sockets


def test_a_strangers_commands_and_replies_are_refused_and_the_log_stays_in_step(server_target):
    with LocalHeadGroup(BINARY, size=2, args=ARGS) as group, \
            remotehead.Client(group.target) as client, \
            remotehead.Client(server_target) as single:
        for c in (client, single):
            c.create_head("h", V, D, seed=3)
        x, t = batch(0)
        options = dict(gradient_id=("t", 0, 0))
        client.forward_backward("h", x, t, **options)

        # The stranger reaches the store (no credential needed to connect) and writes a create
        # command at every place of the log the front will use next, and an OK reply beside each.
        stranger = TCPStore("127.0.0.1", group.store_port, is_master=False,
                            wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
        for seq in range(64):
            stranger.set(f"remotehead/commands/cmd/{seq}", create_command("evil"))
            stranger.set(f"remotehead/commands/reply/{seq}/1", b"0:0:")
        time.sleep(1.0)  # rank 1 polls the log every 200 ms: it has seen the forged command

        info = client.zero_gradients("h")
        assert info.accumulated_micro_batches == 0
        dw, _, _ = client.fetch_gradients("h")
        assert torch.count_nonzero(dw).item() == 0, "a rank kept its dW: ZeroGradients not run"
        with pytest.raises(RemoteheadError) as missing:
            client.describe_head("evil")
        assert missing.value.code.name == "NOT_FOUND"

        # Both ranks go on in step: a step equals one server's, every rank SERVING.
        x, t = batch(1)
        got = client.forward_backward("h", x, t, gradient_id=("t", 1, 0))
        want = single.forward_backward("h", x, t, gradient_id=("t", 1, 0))
        assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss)
        dw_group, _, _ = client.fetch_gradients("h")
        dw_single, _, _ = single.fetch_gradients("h")
        assert torch.allclose(dw_group, dw_single, rtol=1e-5, atol=1e-7)
        for rank in group.ranks:
            with remotehead.Client(rank.target) as c:
                assert c.health() == "SERVING"
        single.drop_head("h")
        codes = group.stop()
        assert codes == [0, 0], log_of(group.ranks[0]) + log_of(group.ranks[1])
        follower = log_of(group.ranks[1])
        front = log_of(group.ranks[0])
        assert '"evil"' not in follower, follower
        assert re.search(r'refused the entry at "cmd/\d+", not executed', follower), follower
        assert re.search(r'refused the entry at "reply/\d+/1", not executed', front), front


def test_a_group_beyond_loopback_needs_a_secret(tmp_path):
    port = free_port()
    base = [BINARY, "--listen=127.0.0.1:0", *ARGS, "--group_size=2", "--group_rank=0",
            f"--group_store=127.0.0.1:{port}"]
    refused = subprocess.run(base + ["--group_store_bind=0.0.0.0"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--group_secret_file: expected the group's secret" in refused.stderr, refused.stderr
    short = tmp_path / "short"
    short.write_text("tiny\n")
    refused = subprocess.run(base + [f"--group_secret_file={short}"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--group_secret_file: expected 16 to" in refused.stderr


def test_ranks_with_different_secrets_do_not_start(tmp_path):
    secrets = []
    for r in range(2):
        path = tmp_path / f"secret{r}"
        path.write_text(f"secret-of-rank-{r}-0123456789abcdef")
        secrets.append(str(path))
    port = free_port()
    ranks = [LocalServer(BINARY, [*ARGS, "--group_size=2", f"--group_rank={r}",
                                  f"--group_store=127.0.0.1:{port}", "--group_timeout_seconds=10",
                                  f"--group_secret_file={secrets[r]}"]).launch()
             for r in range(2)]
    for rank in ranks:
        assert drain(rank, timeout=60) == 1
        assert "nonce does not verify" in log_of(rank) and "--group_secret_file" in log_of(rank)


TIMEOUT = 4.0


def slow_step(client, result):
    """A long step (one-row chunks) whose failure (or success) lands in `result`."""
    g = torch.Generator().manual_seed(5)
    rows = 30000
    try:
        client.forward_backward("h", torch.randn(rows, D, generator=g),
                                torch.randint(0, V, (rows,), generator=g),
                                gradient_id=("t", 9, 0), chunk_rows=1)
        result["error"] = None
    except RemoteheadError as e:
        result["error"] = e
    result["at"] = time.monotonic()


def test_a_rank_stopped_mid_step_is_reported_within_one_timeout():
    group = LocalHeadGroup(BINARY, size=2, args=ARGS, timeout_seconds=TIMEOUT).start()
    try:
        with remotehead.Client(group.target, max_attempts=1) as client:
            client.create_head("h", V, D, seed=3)
            result = {}
            step = threading.Thread(target=slow_step, args=(client, result))
            step.start()
            time.sleep(1.0)
            stopped_at = time.monotonic()
            group.ranks[1].pause()
            step.join(timeout=6 * TIMEOUT)
            assert result.get("error") is not None, "the step did not fail"
            assert result["error"].code.name == "UNAVAILABLE", result["error"]
            assert "rank 1" in result["error"].details, result["error"].details
            took = result["at"] - stopped_at
            assert took < 1.5 * TIMEOUT, f"reported after {took:.1f} s (timeout {TIMEOUT} s)"
            assert health_turns(client, "NOT_SERVING")
            # Continued, the rank learns that the front gave up, and leaves saying why.
            group.ranks[1].resume()
            assert drain(group.ranks[1], timeout=4 * TIMEOUT) == 1
            assert "declared the group down" in log_of(group.ranks[1]), log_of(group.ranks[1])
    finally:
        group.ranks[1].resume()
        group.stop()


def test_a_rank_stopped_while_idle_never_runs_the_command_it_missed():
    group = LocalHeadGroup(BINARY, size=2, args=ARGS, timeout_seconds=TIMEOUT).start()
    try:
        with remotehead.Client(group.target, max_attempts=1) as client:
            client.create_head("h", V, D, seed=3)
            group.ranks[1].pause()
            time.sleep(0.5)
            start = time.monotonic()
            with pytest.raises(RemoteheadError) as failed:
                client.create_head("late", V, D, seed=4)
            assert failed.value.code.name == "UNAVAILABLE"
            assert time.monotonic() - start < 1.5 * TIMEOUT
            assert health_turns(client, "NOT_SERVING")
            group.ranks[1].resume()
            started = time.monotonic()
            assert drain(group.ranks[1], timeout=4 * TIMEOUT) == 1
            assert time.monotonic() - started < 2 * TIMEOUT
            follower = log_of(group.ranks[1])
            assert '"late"' not in follower, follower  # never created there
            assert "declared the group down" in follower, follower
    finally:
        group.ranks[1].resume()
        group.stop()


def pending_command(stranger, prefix: str, within: float = 10.0) -> int:
    """The seq of the command the front appended under `prefix` and nobody took (the front
    deletes a command's key once every rank answered it, so it is the only one there)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for seq in range(64):
            if stranger.check([f"{prefix}/cmd/{seq}"]):
                return seq
        time.sleep(0.05)
    raise AssertionError("no pending command in the store")


# A head group of 2 (its log under remotehead/commands) and a mesh of 2 replicas of one server
# each (the mesh's log, the fronts', under remotehead/shard/0/commands): rank 1 is the one
# stopped, so the command stays pending.
TAMPERED_LOGS = {"group": (1, "remotehead/commands"), "mesh": (2, "remotehead/shard/0/commands")}


@pytest.mark.parametrize("replicas,prefix", TAMPERED_LOGS.values(), ids=TAMPERED_LOGS.keys())
def test_a_pending_command_overwritten_by_a_stranger_takes_the_group_down_at_once(
        replicas, prefix):
    timeout = 30.0
    group = LocalHeadGroup(BINARY, size=2, replicas=replicas, args=ARGS,
                           timeout_seconds=timeout).start()
    try:
        with remotehead.Client(group.target, max_attempts=1) as client:
            client.create_head("h", V, D, seed=3)
            group.ranks[1].pause()
            result = {}

            def create_late():
                try:
                    client.create_head("late", V, D, seed=4)
                    result["error"] = None
                except RemoteheadError as e:
                    result["error"] = e
                result["at"] = time.monotonic()
            call = threading.Thread(target=create_late)
            call.start()
            stranger = TCPStore("127.0.0.1", group.store_port, is_master=False,
                                wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
            try:
                seq = pending_command(stranger, prefix)
            except AssertionError:
                call.join(timeout=5)
                raise AssertionError(f"no pending command: the call gave {result}; rank 0: "
                                     f"{log_of(group.ranks[0])}; rank 1: "
                                     f"{log_of(group.ranks[1])}") from None
            key = f"{prefix}/cmd/{seq}"
            # Rank 1's heartbeat has stopped long enough by now for the liveness watch to call
            # it lost (> 1.2 s): both are seen, and the tampering is what the answer says.
            time.sleep(2.0)
            overwritten_at = time.monotonic()
            stranger.set(key, create_command("evil"))
            call.join(timeout=2 * timeout)
            assert not call.is_alive(), "the call hung"
            error = result["error"]
            assert error is not None, "the call succeeded over a forged command"
            took = result["at"] - overwritten_at
            assert took < 3.0, f"failed {took:.1f} s after the overwrite (timeout {timeout} s)"
            assert error.code.name == "UNAVAILABLE", error
            assert error.reason == "GROUP_UNAVAILABLE", error.reason
            assert error.details.startswith(
                f'head group: the store key "{key}" (command {seq}, not yet answered by every '
                "rank) was overwritten by someone without the group's secret: a stranger "
                "reaches the group's store — the group goes down; fence the store "
                "(docs/security.md) and restart every rank of the group"), error.details
            assert "is lost" not in error.details, error.details
            assert error.metadata.get("key") == key, error.metadata
            assert error.metadata.get("rank") == "0", error.metadata
            assert "lost_rank" not in error.metadata, error.metadata
            assert health_turns(client, "NOT_SERVING")
            # A later call is refused with the same verdict: the store key, not a lost process.
            with pytest.raises(RemoteheadError) as refused:
                client.create_head("later", V, D, seed=5)
            assert refused.value.metadata.get("key") == key, refused.value.metadata
            # Continued, rank 1 refuses the forged entry, never runs it, and leaves.
            group.ranks[1].resume()
            assert drain(group.ranks[1], timeout=2 * timeout) == 1
            follower = log_of(group.ranks[1])
            assert f'refused the entry at "cmd/{seq}", not executed' in follower, follower
            assert "declared the group down" in follower, follower
            assert '"evil"' not in follower and '"late"' not in follower, follower
    finally:
        group.ranks[1].resume()
        group.stop()
    front = log_of(group.ranks[0])
    assert re.search(rf'head group rank 0: head group: the store key "{key}" \(command {seq},'
                     r"[^)]*\) was overwritten by someone without the group's secret", front), front


@pytest.mark.parametrize("rank", ["-5", "-2", "x"])
def test_a_negative_or_bad_group_rank_is_refused_naming_the_flag(rank):
    result = subprocess.run([BINARY, "--listen=127.0.0.1:0", *ARGS, "--group_size=2",
                             f"--group_rank={rank}", f"--group_store=127.0.0.1:{free_port()}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode in (1, 2), result.stderr  # Abseil refuses "x" itself (exit 1)
    assert "--group_rank" in result.stderr or "group_rank" in result.stderr, result.stderr
    if rank != "x":
        assert result.returncode == 2
        assert f"--group_rank: expected a rank in [0, 2) or -1" in result.stderr, result.stderr
