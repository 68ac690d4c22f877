"""A real remotehead-server on a loopback port for the Python client tests."""

import os
import pathlib

import pytest

from remotehead.local_server import LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def server_target():
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    server = LocalServer(binary).start()
    yield server.target
    assert server.stop() == 0, "the server did not drain cleanly:\n" + "".join(server.log)
