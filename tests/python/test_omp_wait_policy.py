"""The server's OpenMP threads wait passively unless the operator set OMP_WAIT_POLICY.

libgomp's spinning wait takes the cores a CPU head's gRPC threads need to stage rows and write
dX (docs/operators.md): a server started without the variable sets it to PASSIVE and executes
itself again, so libgomp reads it while the process loads. What the running process's libgomp
read is its environment block, which /proc/<pid>/environ shows (the block the last exec got).
"""

import os

import pytest

from conftest import ROOT
from remotehead.local_server import LocalServer

BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))


def _environment(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = [e.decode() for e in f.read().split(b"\0") if e]
    return dict(e.split("=", 1) for e in entries if "=" in e)


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE"),
                                             ("PASSIVE", "PASSIVE")])
def test_the_server_waits_passively_unless_told_otherwise(monkeypatch, given, expected):
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    with LocalServer(BINARY, ["--device=cpu", "--torch_threads=1"]) as server:
        assert _environment(server.process.pid).get("OMP_WAIT_POLICY") == expected
        # The restarted process is the same child (exec keeps the pid) and serves.
        assert any("listening on port" in line for line in server.log), server.log
        assert server.stop() == 0, "".join(server.log[-20:])
