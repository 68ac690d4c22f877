"""The server keeps the heap memory a call frees for the next call, unless the operator tuned
glibc's malloc through the environment (server/src/service/heap_policy.cc).

With glibc's defaults the memory a step passes its bytes through (gRPC's receive buffers, a
batch's dX and temporaries) is given back to the kernel and faulted in again on the next call:
about one fault per 4 KiB page moved. The server's minor page faults (/proc/<pid>/stat) over
the same steps are counted with its own settings and with glibc's defaults set explicitly
(MALLOC_TRIM_THRESHOLD_, which makes the server leave malloc as the operator set it). The
servers run with transparent huge pages off (PR_SET_THP_DISABLE, which a child inherits): on a
host whose THP is "always" a fault may bring 2 MiB, and the count would no longer say how much
memory was taken afresh.
"""

import contextlib
import ctypes
import os

import torch

import remotehead
from conftest import ROOT
from remotehead.local_server import LocalServer

BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
ROWS, D, V = 2048, 4096, 2  # X and dX: 32 MiB each per step, next to no compute
STEPS = 4
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_",
                    "GLIBC_TUNABLES")


PR_SET_THP_DISABLE = 41


@contextlib.contextmanager
def _small_pages_for_children():
    """Processes started inside: 4 KiB pages only (this process's flag, inherited at fork)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        libc.prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt


def _faults_per_step(monkeypatch, environment: dict) -> float:
    for name in MALLOC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    hidden = torch.randn(ROWS, D)
    targets = torch.randint(0, V, (ROWS,))
    with _small_pages_for_children(), LocalServer(BINARY, ["--device=cpu",
                                                            "--torch_threads=1"]) as server:
        with remotehead.Client(server.target) as client:
            client.create_head("h", V, D)
            options = remotehead.StepOptions(accumulate=False)
            for _ in range(2):  # the process's first calls fill its caches
                client.forward_backward("h", hidden, targets, options)
            before = _minor_faults(server.process.pid)
            for _ in range(STEPS):
                r = client.forward_backward("h", hidden, targets, options)
                assert r.grad_hidden.shape == hidden.shape
            faults = (_minor_faults(server.process.pid) - before) / STEPS
        assert server.stop() == 0, "".join(server.log[-20:])
    return faults


def test_the_server_reuses_what_a_call_freed_unless_malloc_is_tuned(monkeypatch):
    pages_moved = 2 * ROWS * D * 4 / 4096  # X in, dX out
    kept = _faults_per_step(monkeypatch, {})
    given_back = _faults_per_step(monkeypatch, {"MALLOC_TRIM_THRESHOLD_": "131072"})
    # glibc's defaults: most pages moved are fresh; kept: a small share of them.
    assert given_back > 0.5 * pages_moved, (given_back, pages_moved)
    assert kept < 0.25 * pages_moved, (kept, pages_moved)
    assert kept < given_back / 3, (kept, given_back)
