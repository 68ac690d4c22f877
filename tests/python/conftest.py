"""A real remotehead-server on a loopback port for the Python client tests."""

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def server_target():
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    process = subprocess.Popen([binary, "--listen=127.0.0.1:0", "--device=cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = None
    log = []
    for line in process.stdout:
        log.append(line)
        match = re.match(r"remotehead-server: listening on port (\d+)", line)
        if match:
            port = int(match.group(1))
            break
    assert port, "the server did not start:\n" + "".join(log)
    yield f"127.0.0.1:{port}"
    process.terminate()
    assert process.wait(timeout=60) == 0
