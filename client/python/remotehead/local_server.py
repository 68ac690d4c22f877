"""A remotehead-server process on a loopback port, for examples, notebooks and tests:

    with LocalServer("build/server/remotehead-server") as server:
        client = remotehead.Client(server.target)
        ...
    # stopped with SIGTERM (the server drains and exits 0)

and a head group of them (one head split by vocabulary over `size` processes; clients talk to
the front, rank 0):

    with LocalHeadGroup("build/server/remotehead-server", size=2) as group:
        client = remotehead.Client(group.target)
"""

from __future__ import annotations

import os
import random
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import List, Optional, Sequence


class LocalServer:
    def __init__(self, binary: str, args: Sequence[str] = ("--device=cpu",),
                 start_timeout: float = 60.0):
        self.binary = binary
        self.args = list(args)
        self.start_timeout = start_timeout
        self.process: Optional[subprocess.Popen] = None
        self.target = ""
        self.metrics_port: Optional[int] = None  # with --metrics_address (port 0 works)
        # Every line the server printed so far. A thread reads the pipe for the process's whole
        # life: a pipe nobody reads fills (64 KiB) and then blocks the server in its next log
        # line (one per head created or dropped), in the middle of whatever RPC wrote it.
        self.log: List[str] = []
        self._reader: Optional[threading.Thread] = None
        self._output = threading.Condition()
        self._output_ended = False

    def start(self) -> "LocalServer":
        return self.launch().wait_listening()

    def launch(self) -> "LocalServer":
        """Starts the process without waiting for it (a head group's ranks wait for each other:
        all are launched before any is waited for)."""
        self.process = subprocess.Popen([self.binary, "--listen=127.0.0.1:0", *self.args],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self._output_ended = False
        self._reader = threading.Thread(target=self._read_output, args=(self.process.stdout,),
                                        name=f"{os.path.basename(self.binary)} output",
                                        daemon=True)
        self._reader.start()
        return self

    def _read_output(self, stream) -> None:
        for line in stream:
            with self._output:
                self.log.append(line)
                self._output.notify_all()
        with self._output:
            self._output_ended = True
            self._output.notify_all()

    def wait_listening(self) -> "LocalServer":
        seen = 0
        with self._output:
            while True:
                for line in self.log[seen:]:
                    metrics = re.match(r"remotehead-server: metrics on port (\d+)", line)
                    if metrics:
                        self.metrics_port = int(metrics.group(1))
                    match = re.match(r"remotehead-server: listening on port (\d+)", line)
                    if match:
                        self.target = f"127.0.0.1:{match.group(1)}"
                        return self
                seen = len(self.log)
                if self._output_ended:
                    break
                self._output.wait()
        code = self.process.wait(timeout=self.start_timeout)
        raise RuntimeError(f"{self.binary}: expected a 'listening on port' line; the server "
                           f"exited with {code}:\n" + "".join(self.log))

    def wait_exit(self, timeout: float = 60.0) -> int:
        """The exit code of a process that ends by itself within `timeout` seconds, with all
        of its output in `log`."""
        if self.process is None:
            return 0
        code = self.process.wait(timeout=timeout)
        self._reader.join()  # the pipe ends with the process: the rest of its output is in
        self.process = None
        return code

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (0 when it drained cleanly)."""
        if self.process is None:
            return 0
        self.process.terminate()
        return self.wait_exit(timeout)

    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOP, then waits until every thread of the process is stopped. The kernel stops a
        process's threads one by one as each is next scheduled, so right after kill() another
        thread can still run (e.g. take and answer a group command) on a loaded machine: a test
        that needs the process hung must wait for it."""
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all(state in ("T", "t") for state in thread_states(self.process.pid)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pid {self.process.pid}: not stopped {timeout} s after "
                                   f"SIGSTOP (thread states {thread_states(self.process.pid)})")
            time.sleep(0.005)

    def resume(self) -> None:
        """SIGCONT (after pause(); harmless when not paused or already ended)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def thread_states(pid: int) -> List[str]:
    """Each thread's scheduler state letter (/proc/PID/task/*/stat: R, S, D, T, ...)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return states


def free_port() -> int:
    """A loopback port for a process to be told to listen on: free now, and below the kernel's
    ephemeral range (/proc/sys/net/ipv4/ip_local_port_range). A port of that range, the kernel's
    own choice, may be taken by any connection's or listener's own port (a client's, a head
    group's Gloo pairs) in the seconds before the process binds it; seen in CI: a mesh rank's
    --listen port taken during the mesh's rendezvous."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the kernel's choice
        low = 0
    for _ in range(1000) if low > 2048 else ():
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalHeadGroup:
    """`size` remotehead-server processes forming one head group on loopback (Gloo); `target`
    is the front's address, the only one clients use. With `replicas` R > 1 they form a mesh of
    R replicas of size / R ranks each (--group_replicas); `fronts` lists the replicas' fronts
    (a Client takes that list) and `target` is the leader's. The group's command log is sealed with a
    fresh secret (a file readable by this user only, removed with the group) unless
    `secret_file` names one, or is "" for none. With `external_store`, the store is served by a
    process of its own (`store`: remotehead-server --serve_group_store), started first and
    stopped last, and every rank runs with --group_store_external."""

    def __init__(self, binary: str, size: int, args: Sequence[str] = ("--device=cpu",),
                 timeout_seconds: float = 30.0, secret_file: Optional[str] = None,
                 replicas: int = 1, external_store: bool = False):
        self.replicas = replicas
        self.store_port = free_port()
        store = f"127.0.0.1:{self.store_port}"
        self._secret_dir = None
        if secret_file is None:
            self._secret_dir = tempfile.TemporaryDirectory(prefix="remotehead-group-")
            secret_file = os.path.join(self._secret_dir.name, "secret")
            with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(secrets.token_hex(32))
        secret = [f"--group_secret_file={secret_file}"] if secret_file else []
        self.store: Optional[LocalServer] = None
        external = []
        if external_store:
            self.store = LocalServer(binary, ["--serve_group_store", f"--group_store={store}",
                                              "--listen=127.0.0.1:0"])
            external = ["--group_store_external"]
        self.ranks = [LocalServer(binary, [*args, f"--group_size={size}", f"--group_rank={r}",
                                           f"--group_store={store}",
                                           f"--group_timeout_seconds={timeout_seconds}",
                                           f"--group_replicas={replicas}", *secret, *external])
                      for r in range(size)]
        self.target = ""
        self.fronts: List[str] = []

    def start(self) -> "LocalHeadGroup":
        if self.store is not None:
            self.store.start()
        for rank in self.ranks:
            rank.launch()
        for rank in self.ranks:
            rank.wait_listening()
        self.target = self.ranks[0].target
        per_replica = len(self.ranks) // self.replicas
        self.fronts = [self.ranks[r * per_replica].target for r in range(self.replicas)]
        return self

    def stop(self, timeout: float = 60.0) -> List[int]:
        """SIGTERM to every rank at once (a rank whose front is gone before its own signal
        came ends with exit code 1); their exit codes by rank."""
        for rank in self.ranks:
            if rank.process is not None:
                rank.process.terminate()
        codes = [rank.stop(timeout) for rank in self.ranks]
        if self.store is not None:
            self.store.stop(timeout)
        if self._secret_dir is not None:
            self._secret_dir.cleanup()
        return codes

    def __enter__(self) -> "LocalHeadGroup":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
