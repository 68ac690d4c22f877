"""A remotehead-server process on a loopback port, for examples, notebooks and tests:

    with LocalServer("build/server/remotehead-server") as server:
        client = remotehead.Client(server.target)
        ...
    # stopped with SIGTERM (the server drains and exits 0)
"""

from __future__ import annotations

import re
import subprocess
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
        self.log: List[str] = []  # the server's output up to "listening"

    def start(self) -> "LocalServer":
        self.process = subprocess.Popen([self.binary, "--listen=127.0.0.1:0", *self.args],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        for line in self.process.stdout:
            self.log.append(line)
            metrics = re.match(r"remotehead-server: metrics on port (\d+)", line)
            if metrics:
                self.metrics_port = int(metrics.group(1))
            match = re.match(r"remotehead-server: listening on port (\d+)", line)
            if match:
                self.target = f"127.0.0.1:{match.group(1)}"
                return self
        code = self.process.wait(timeout=self.start_timeout)
        raise RuntimeError(f"{self.binary}: expected a 'listening on port' line; the server "
                           f"exited with {code}:\n" + "".join(self.log))

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (0 when it drained cleanly)."""
        if self.process is None:
            return 0
        self.process.terminate()
        # The rest of its output (lifecycle lines) is read so the pipe never blocks it.
        self.log.extend(self.process.stdout)
        code = self.process.wait(timeout=timeout)
        self.process = None
        return code

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
