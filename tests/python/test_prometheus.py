"""A real Prometheus (Debian's `prometheus`, started here on loopback, scraping every second)
scrapes a real remotehead-server (--metrics_address) while a known workload runs through the
Python client; then PromQL queries through Prometheus' HTTP API return exactly what was sent:
requests by RPC and status code, tokens by head and function, latency histogram and per-phase
observation counts, bytes received, and the per-head state (weight version, accumulated
micro-batches, last loss), device memory at least the head's own bytes, nothing in flight.
"""

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.parse
import urllib.error
import urllib.request

import pytest
import torch

import pki
import remotehead
from remotehead.local_server import LocalServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
V, D, ROWS = 128, 32, 24
FUSED_CALLS = 5


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


@pytest.fixture
def server():
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    with LocalServer(binary, ["--device=cpu", "--metrics_address=127.0.0.1:0"]) as s:
        assert s.metrics_port, "no 'metrics on port' line:\n" + "".join(s.log)
        yield s


@contextlib.contextmanager
def start_prometheus(tmp_path, scrape_configs: str):
    """Debian's prometheus on a free loopback port with `scrape_configs` (YAML list items);
    gives its URL."""
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is installed by scripts/bootstrap"
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      "scrape_configs:\n" + scrape_configs)
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if http_get(url + "/-/ready"):
                break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail("prometheus did not become ready:\n" + process.stdout.read())
        time.sleep(0.2)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def prometheus(server, tmp_path):
    with start_prometheus(
            tmp_path, "  - job_name: remotehead\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{server.metrics_port}']\n") as url:
        yield url


def query(url: str, promql: str):
    """The instant vector of `promql` as {frozenset(labels): value}."""
    body = json.loads(http_get(url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    assert body["status"] == "success", body
    ignored = ("__name__", "job", "instance")
    return {frozenset((k, v) for k, v in r["metric"].items() if k not in ignored):
            float(r["value"][1]) for r in body["data"]["result"]}


def scalar(url: str, promql: str) -> float:
    result = query(url, promql)
    assert len(result) == 1, f"{promql}: expected one series; got {result}"
    return next(iter(result.values()))


def test_prometheus_scrapes_what_the_workload_did(server, prometheus):
    torch.manual_seed(0)
    client = remotehead.Client(server.target)
    client.upload_head("prom", torch.randn(V, D) / D**0.5)
    head = remotehead.RemoteHead(client, "prom")
    fused_tokens, last_loss = 0, None
    for _ in range(FUSED_CALLS):
        hidden = torch.randn(ROWS, D, requires_grad=True)
        labels = torch.randint(0, V, (ROWS,))
        labels[torch.rand(ROWS) < 0.25] = -100  # ignored: not counted as tokens
        fused_tokens += int((labels != -100).sum())
        loss = head.loss(hidden, labels)
        loss.backward()
        last_loss = loss.item()
    logprob_tokens = 2 * ROWS
    for _ in range(2):
        client.forward("prom", torch.randn(ROWS, D), torch.randint(0, V, (ROWS,)),
                       function="token_logprobs")
    with pytest.raises(remotehead.RemoteheadError):  # a label out of range
        client.forward_backward("prom", torch.randn(ROWS, D), torch.full((ROWS,), V),
                                gradient_id=("bad", 0, 0))
    info_before_step = client.describe_head("prom")
    assert info_before_step.accumulated_micro_batches == FUSED_CALLS
    client.optimizer_step("prom", sgd=dict(lr=0.1), zero_gradients=True)

    # The optimizer step was the last call: once a scrape has seen it, it has seen everything.
    deadline = time.monotonic() + 30
    while query(prometheus, 'remotehead_requests_total{rpc="OptimizerStep",code="OK"}') != {
            frozenset({("rpc", "OptimizerStep"), ("code", "OK")}): 1.0}:
        assert time.monotonic() < deadline, (
            "no scrape after the workload within 30 s: "
            + str(query(prometheus, '{__name__=~"remotehead_requests_total|up"}')))
        time.sleep(0.5)

    assert scalar(prometheus, 'up{job="remotehead"}') == 1
    assert scalar(prometheus,
                  'remotehead_requests_total{rpc="ForwardBackward",code="OK"}') == FUSED_CALLS
    assert scalar(prometheus,
                  'remotehead_requests_total{rpc="ForwardBackward",code="INVALID_ARGUMENT"}') == 1
    assert scalar(prometheus, 'remotehead_requests_total{rpc="Forward",code="OK"}') == 2
    assert scalar(prometheus, 'remotehead_requests_total{rpc="UploadHead",code="OK"}') == 1
    assert scalar(prometheus, 'sum(remotehead_requests_total{code!="OK"})') == 1
    assert scalar(prometheus, 'remotehead_tokens_total{head="prom",function="cross_entropy"}') \
        == fused_tokens
    assert scalar(prometheus, 'remotehead_tokens_total{head="prom",function="token_logprobs"}') \
        == logprob_tokens
    # Latency: every ForwardBackward observed (the refused one too); phases for successful steps.
    assert scalar(prometheus, 'remotehead_request_duration_seconds_count{rpc="ForwardBackward"}') \
        == FUSED_CALLS + 1
    assert scalar(prometheus, 'remotehead_request_duration_seconds_sum{rpc="ForwardBackward"}') > 0
    for phase in ("queue", "receive", "compute", "send"):
        assert scalar(prometheus, 'remotehead_step_phase_seconds_count{rpc="ForwardBackward",'
                                  f'phase="{phase}"}}') == FUSED_CALLS
    assert scalar(prometheus, 'remotehead_step_phase_seconds_sum{rpc="ForwardBackward",'
                              'phase="compute"}') > 0
    assert scalar(prometheus, 'remotehead_request_duration_seconds_bucket{rpc="ForwardBackward",'
                              'le="+Inf"}') == FUSED_CALLS + 1
    # Bytes: at least the hidden states sent (fp32) and the dX returned — of the rows that
    # travel: the ignored ones stay with the client (compact_rows), the refused call's all went.
    received = scalar(prometheus, 'remotehead_received_bytes_total{rpc="ForwardBackward"}')
    assert (fused_tokens + ROWS) * D * 4 <= received < (FUSED_CALLS + 1) * ROWS * D * 4
    assert scalar(prometheus, 'remotehead_sent_bytes_total{rpc="ForwardBackward"}') \
        >= fused_tokens * D * 4
    # State.
    assert scalar(prometheus, 'remotehead_heads') == 1
    assert scalar(prometheus, 'remotehead_head_weight_version{head="prom"}') == 1
    assert scalar(prometheus, 'remotehead_head_accumulated_micro_batches{head="prom"}') == 0
    assert abs(scalar(prometheus, 'remotehead_head_last_loss{head="prom"}') - last_loss) \
        <= 1e-9 * abs(last_loss)
    assert scalar(prometheus, 'remotehead_device_memory_allocated_bytes{device="cpu"}') \
        >= 2 * V * D * 4  # W and dW
    assert scalar(prometheus, 'remotehead_logits_chunk_max_bytes') >= ROWS * V * 4 * 0.5
    assert scalar(prometheus, 'sum(remotehead_inflight_requests)') == 0
    assert scalar(prometheus, 'remotehead_admission_active_requests') == 0
    client.close()


def test_metrics_endpoint_serves_only_metrics_and_bad_addresses_are_refused(server):
    body = http_get(f"http://127.0.0.1:{server.metrics_port}/metrics").decode()
    # Before any RPC: the scrape-time state (request series appear with their first call).
    assert 'remotehead_device_memory_allocated_bytes{device="cpu"}' in body
    assert "\nremotehead_heads 0\n" in body
    with pytest.raises(urllib.error.HTTPError) as error:
        http_get(f"http://127.0.0.1:{server.metrics_port}/other")
    assert error.value.code == 404
    result = subprocess.run([server.binary, "--listen=127.0.0.1:0", "--device=cpu",
                             "--metrics_address=localhost"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        '--metrics_address: expected IPv4 host:port (e.g. 0.0.0.0:9464); got "localhost"')


def test_prometheus_scrapes_with_the_bearer_token(tmp_path):
    """TLS and --auth_token_file on: /metrics needs the token; Prometheus sends it from
    `authorization: {credentials_file: ...}` and scrapes, a job without it gets 401 (up 0)."""
    cert, key = pki.self_signed_certificate(tmp_path)
    token = tmp_path / "token"
    token.write_text("rh-prometheus-token-5e2d\n")
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    args = ["--device=cpu", "--head=lm:64:8", f"--tls_cert={cert}", f"--tls_key={key}",
            f"--auth_token_file={token}", "--metrics_address=127.0.0.1:0"]
    with LocalServer(binary, args) as server:
        assert server.metrics_port, "".join(server.log)
        with pytest.raises(urllib.error.HTTPError) as error:
            http_get(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert error.value.code == 401
        target = f"      - targets: ['127.0.0.1:{server.metrics_port}']\n"
        configs = ("  - job_name: with_token\n    authorization:\n"
                   f"      credentials_file: {token}\n    static_configs:\n" + target +
                   "  - job_name: without_token\n    static_configs:\n" + target)
        with start_prometheus(tmp_path, configs) as url:
            deadline = time.monotonic() + 30
            while (query(url, 'up{job="with_token"}') != {frozenset(): 1.0}
                   or query(url, 'up{job="without_token"}') != {frozenset(): 0.0}):
                assert time.monotonic() < deadline, str(query(url, "up"))
                time.sleep(0.5)
            assert query(url, 'remotehead_heads{job="with_token"}') == {frozenset(): 1.0}
            assert query(url, 'remotehead_heads{job="without_token"}') == {}
