"""LocalServer, the harness that starts a real remotehead-server for the examples and every test
here: the server's output is read for the process's whole life, so a long-lived server (the
session's shared one) never blocks on a full pipe.

Before the harness read it, the shared server's output pipe filled after some hundreds of heads
(one lifecycle line each), and the next RPC that logged (an UploadHead that had already created
its head) never answered: the whole suite hung in one test that passed alone.
"""

import os
import pathlib
import socket

import remotehead
from conftest import ROOT
from remotehead.local_server import LocalServer, free_port

BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
PIPE_BYTES = 64 << 10  # Linux's default pipe capacity


def test_a_server_that_logs_more_than_a_pipe_holds_keeps_answering():
    with LocalServer(BINARY, ["--device=cpu", "--torch_threads=1"]) as server:
        # A deadline turns the old hang into a DEADLINE_EXCEEDED error naming the call.
        with remotehead.Client(server.target, timeout=30) as client:
            created = 0
            while sum(map(len, server.log)) < 3 * PIPE_BYTES:
                assert created < 5000, "the server stopped logging its heads:\n" + \
                    "".join(server.log[-5:])
                head_id = f"a-head-with-a-long-name-that-fills-the-log-{created:05d}"
                client.create_head(head_id, 8, 4, seed=created)
                client.drop_head(head_id)
                created += 1
            assert client.list_heads() == []
        assert server.stop() == 0, "".join(server.log[-20:])
    assert sum("head created from seed" in line for line in server.log) == created


def test_the_output_after_exit_is_in_the_log():
    server = LocalServer(BINARY, ["--device=cpu", "--torch_threads=1"]).start()
    assert server.target and any("listening on port" in line for line in server.log)
    assert server.stop() == 0
    # The lines the server prints while it drains, after the harness's SIGTERM.
    assert server.log[-1] == "remotehead-server: stopped\n", server.log
    assert any(line.startswith("remotehead-server: draining") for line in server.log), server.log


def test_free_ports_are_free_and_below_the_kernels_ephemeral_range():
    """A port of the kernel's ephemeral range may be taken, before a server binds it, by any
    connection's or Gloo listener's own port (a mesh's --listen port was, once in CI): every
    test's port comes from free_port, below that range, and bindable."""
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports), (low, ports)
    assert len(set(ports)) > 40  # drawn at random, not one port for every test
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
