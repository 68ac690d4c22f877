"""Retries: a step sent before the server is up succeeds once it starts, its gradient is added
once, and a replay of the same gradient id adds nothing; codes other than UNAVAILABLE are never
retried."""

import os
import subprocess
import threading
import time

import grpc
import pytest
import torch

import remotehead
from remotehead.local_server import free_port
from conftest import ROOT

V, D = 64, 16


def test_step_before_the_server_starts_is_retried_and_counted_once():
    port = free_port()
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    server = None

    def start_later():
        nonlocal server
        time.sleep(0.4)
        server = subprocess.Popen([binary, f"--listen=127.0.0.1:{port}", "--device=cpu",
                                   f"--head=lm:{V}:{D}:float32:3"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        client = remotehead.Client(f"127.0.0.1:{port}", max_attempts=40, initial_backoff=0.05,
                                   max_backoff=0.2)
        hidden = torch.randn(10, D)
        labels = torch.randint(0, V, (10,))
        first = client.forward_backward("lm", hidden, labels, gradient_id=("run", 0, 0))
        assert client.retries > 0
        assert not first.summary.replayed
        _, _, info = client.fetch_gradients("lm")
        assert info.accumulated_micro_batches == 1
        dw_once, _, _ = client.fetch_gradients("lm")

        replay = client.forward_backward("lm", hidden, labels, gradient_id=("run", 0, 0))
        assert replay.summary.replayed
        assert replay.loss == first.loss
        dw_after, _, info = client.fetch_gradients("lm")
        assert info.accumulated_micro_batches == 1
        assert torch.equal(dw_after, dw_once)

        retries = client.retries
        with pytest.raises(remotehead.RemoteheadError) as missing:
            client.describe_head("nope")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        assert client.retries == retries  # not retried
        client.close()
    finally:
        starter.join()
        if server is not None:
            server.terminate()
            assert server.wait(timeout=60) == 0
