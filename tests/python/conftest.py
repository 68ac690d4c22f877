"""A real remotehead-server on a loopback port for the Python client tests."""

import os
import pathlib

import pytest

from remotehead.client import Client
from remotehead.local_server import LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def server_target():
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    server = LocalServer(binary).start()
    yield server.target
    assert server.stop() == 0, "the server did not drain cleanly:\n" + "".join(server.log)


@pytest.fixture(scope="session")
def registry(server_target):
    """The server's functions by name, as it lists them (ListFunctions): what the tests that
    run every function iterate over (tests/python/references.py holds their references)."""
    with Client(server_target) as client:
        return client.functions()
