"""deploy/docker-compose.yml brought up for real with Debian's docker-compose (v1): the `cpu`
profile's server and Prometheus (Prometheus scraping it: its query API shows the server's series
after training steps, and every dashboard expression evaluates there), then the `cpu-group`
profile (a head group of 2 sealed with its secret) trained through rank 0. `stop` drains every
server (exit 0), `down -v` leaves nothing. Grafana's image cannot be had here (no registry), so
its service is not started: its provisioning is checked against the stack as text says it. The
group plane's fence (an internal network for the store and Gloo, only gRPC and metrics
published) is checked statically, with no Docker."""

import json
import os
import pathlib
import re
import secrets
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import torch
import yaml

import remotehead

from conftest import COMPOSE, docker, logs, state, train_against_reference, wait_healthy

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
PROMETHEUS = "http://127.0.0.1:9090"


class Stack:
    def __init__(self, project: str, profile: str):
        self.project, self.profile = project, profile

    def compose(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run([*COMPOSE, "-f", str(COMPOSE_FILE), "-p", self.project,
                                 "--profile", self.profile, *args], capture_output=True,
                                text=True, timeout=timeout)
        assert result.returncode == 0, \
            f"docker-compose {' '.join(args)}: exit {result.returncode}\n{result.stderr[-4000:]}"
        return result.stdout

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip()

    def remaining(self) -> str:
        return docker("ps", "-a", "-q", "--filter",
                      f"label=com.docker.compose.project={self.project}").strip()


@pytest.fixture
def stack(request):
    stacks = []

    def make(profile: str) -> Stack:
        made = Stack(f"rhdeploy{os.getpid()}{profile.replace('-', '')}", profile)
        stacks.append(made)
        return made

    yield make
    for made in stacks:  # whatever a failed test left
        subprocess.run([*COMPOSE, "-f", str(COMPOSE_FILE), "-p", made.project, "--profile",
                        made.profile, "down", "-v", "--timeout", "30"], capture_output=True)


def query(expression: str) -> list:
    url = f"{PROMETHEUS}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(expression: str, accept, timeout: float = 90) -> list:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = query(expression)
            if accept(result):
                return result
        except OSError:  # Prometheus still starting
            result = None
        if time.monotonic() > deadline:
            raise AssertionError(f"{expression}: {result} after {timeout} s")
        time.sleep(1)


def stop_and_check_drained(stack: Stack, services) -> None:
    containers = {service: stack.container(service) for service in services}
    stack.compose("stop", "--timeout", "60")
    for service, container in containers.items():
        text = logs(container)
        assert state(container)["ExitCode"] == 0, f"{service}:\n{text[-3000:]}"
        # A server on its own says it stopped; a group's every rank that it drained with the
        # others (SIGTERM on any rank drains them all).
        assert ("remotehead-server: stopped" in text
                or "remotehead-server: drained (SIGTERM on global rank" in text), \
            f"{service}:\n{text[-3000:]}"
    stack.compose("down", "-v", "--timeout", "30")
    assert stack.remaining() == "", "down left containers"


def test_every_server_gets_the_time_its_drain_takes_before_sigkill():
    """Static (no Docker): `stop`'s SIGKILL comes after a server's drain — its calls' grace,
    on a group the saves on every rank, and the 5 s a signalled rank waits beyond them."""
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    servers = {name: s for name, s in services.items() if name.startswith("remotehead")}
    assert len(servers) == 4, sorted(servers)
    for name, service in servers.items():
        given = dict(a.split("=", 1) for a in service["command"] if "=" in a)
        grace = int(given.get("--shutdown_grace_seconds", 30))  # the server's defaults
        save = int(given.get("--drain_save_seconds", 60))
        period = service.get("stop_grace_period", "10s")
        assert period.endswith("s") and int(period[:-1]) >= grace + save + 5 + 10, (name, period)


def dashboard_expressions():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "remotehead.json").read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_cpu_profile_serves_and_prometheus_scrapes_it(stack):
    cpu = stack("cpu")
    cpu.compose("up", "-d", "--no-build", "remotehead-cpu", "prometheus")
    server = cpu.container("remotehead-cpu")
    print(f"remotehead-cpu healthy after {wait_healthy(server):.1f} s")
    wait_for('up{job="remotehead",instance="remotehead-cpu:9464"}',
             lambda r: r and r[0]["value"][1] == "1")

    train_against_reference("127.0.0.1:50051", "compose")
    # Prometheus (5 s scrapes) sees the steps: 4 fused ForwardBackward calls and their tokens.
    steps = wait_for('remotehead_requests_total{job="remotehead",rpc="ForwardBackward",code="OK"}',
                     lambda r: r and float(r[0]["value"][1]) >= 4)
    assert float(steps[0]["value"][1]) == 4
    tokens = wait_for('remotehead_tokens_total{head="compose"}',
                      lambda r: r and float(r[0]["value"][1]) >= 4 * 32)
    assert float(tokens[0]["value"][1]) == 4 * 32
    version = wait_for('remotehead_head_weight_version{head="compose"}',
                       lambda r: r and float(r[0]["value"][1]) >= 4)
    assert float(version[0]["value"][1]) == 4
    # A GRPO micro-batch with a reference and its optimizer step: the head-health row's GRPO
    # panels (clipped fraction, KL) have data too.
    with remotehead.Client("127.0.0.1:50051") as client:
        client.forward_backward("compose", torch.randn(32, 64), torch.randint(0, 1000, (32,)),
                                function="grpo", reduction="sum", gradient_id=("deploy", 4, 0),
                                aux={"advantages": torch.randn(32),
                                     "ref_logprobs": -7 - torch.rand(32)})
        client.optimizer_step("compose", sgd=dict(lr=0.5), zero_gradients=True)
    wait_for('remotehead_head_kl_mean{head="compose"}', bool)
    # The dashboard's server panels have data on this stack (Grafana's $__rate_interval as 1m;
    # the group panels' remotehead_group_info is the cpu-group profile's; the mesh panels' data a
    # mesh's, which no profile runs: test_deploy.py checks that a mesh's ranks export it).
    for title, expression in dashboard_expressions():
        if "remotehead_group_info" in expression:
            continue
        result = query(expression.replace("$__rate_interval", "1m"))
        assert isinstance(result, list), (title, expression)
    for title, expression in dashboard_expressions():
        if "rate(" not in expression and "group_info" not in expression \
                and "remotehead_mesh_" not in expression:
            assert query(expression), f"panel {title!r}: {expression} has no data"

    stop_and_check_drained(cpu, ["remotehead-cpu"])


def test_the_cpu_group_profile_trains_through_rank_0(stack):
    secret = DEPLOY / "group-secret"
    made_secret = not secret.exists()
    if made_secret:  # as the compose file's comment tells a user to
        secret.write_text(secrets.token_urlsafe(32) + "\n")
    try:
        group = stack("cpu-group")
        group.compose("up", "-d", "--no-build", "remotehead-rank0", "remotehead-rank1",
                      "prometheus")
        ranks = [group.container("remotehead-rank0"), group.container("remotehead-rank1")]
        for rank in ranks:
            wait_healthy(rank)
        assert "rank 1 of 2 (follows" in logs(ranks[1])
        assert "sealed with the group's secret" in logs(ranks[1])

        import remotehead
        train_against_reference("127.0.0.1:50051", "group", vocab=997)
        with remotehead.Client("127.0.0.1:50051") as client:
            info = client.describe_head("group")
            assert info.group_size == 2 and info.shards == ((0, 499), (499, 498))
        # Prometheus sees both ranks up, each with its rank (the dashboard's join).
        up = wait_for("remotehead_group_up * on (instance) group_left (rank) "
                      "remotehead_group_info", lambda r: len(r) == 2)
        assert sorted(s["metric"]["rank"] for s in up) == ["0", "1"]
        assert all(s["value"][1] == "1" for s in up)

        stop_and_check_drained(group, ["remotehead-rank0", "remotehead-rank1"])
    finally:
        if made_secret:
            secret.unlink()


def test_grafana_is_checked_as_text_since_its_image_cannot_be_had():
    """Not started (no registry here): its provisioning is checked against the compose file —
    the datasource is the stack's Prometheus service on its port, the dashboards provider reads
    the folder the dashboards are mounted on, the home dashboard is a file there. Every
    dashboard expression is evaluated by the live Prometheus in the tests above."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(reversed(v.split(":")[:2]) for v in grafana["volumes"])
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"].lstrip("./")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    url = urllib.parse.urlparse(source["url"])
    assert url.hostname == "prometheus" and "prometheus" in compose["services"]
    assert f"{url.port}:{url.port}" in compose["services"]["prometheus"]["ports"]
    [provider] = yaml.safe_load((provisioning / "dashboards" / "remotehead.yml").read_text())[
        "providers"]
    dashboards = DEPLOY / mounts[provider["options"]["path"]].lstrip("./")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (dashboards / home.rsplit("/", 1)[1]).is_file()
    assert re.fullmatch(r"\$\{REMOTEHEAD_GRAFANA_IMAGE:-grafana/grafana:[\d.]+\}",
                        grafana["image"])
    print("grafana: not started (its image cannot be pulled here); provisioning checked as text")


def flag_values(command) -> dict:
    return dict(a[2:].split("=", 1) for a in command if a.startswith("--") and "=" in a)


def test_the_group_plane_is_on_an_internal_network_only():
    """Statically (no Docker): a head group's ranks reach the store and each other's Gloo
    listeners by names that only an internal network resolves (their aliases there: the store's
    host and --group_transport_host), only the ranks are on that network, and every server
    publishes only its gRPC and metrics ports (the store's and Gloo's never); a single server
    has no group at all."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    networks = compose["networks"]
    servers = {name: service for name, service in compose["services"].items()
               if name.startswith("remotehead-")}
    groups = {name: flag_values(service["command"]) for name, service in servers.items()
              if int(flag_values(service["command"]).get("group_size", "1")) > 1}
    assert sorted(groups) == ["remotehead-rank0", "remotehead-rank1"]
    for name, service in servers.items():
        # Published: gRPC (50051) and metrics (9464) only, whatever the host port.
        targets = {int(p.split(":")[-1]) for p in service["ports"]}
        assert targets == {50051, 9464}, (name, service["ports"])
        if name not in groups:
            assert not any(f.startswith("group_") for f in flag_values(service["command"]))
            assert "networks" not in service  # the default network, no group plane
    planes = set()
    for name, values in groups.items():
        attached = servers[name]["networks"]
        internal = [n for n in attached if (networks.get(n) or {}).get("internal") is True]
        assert len(internal) == 1, (name, attached)
        plane = internal[0]
        planes.add(plane)
        aliases = {n: set((attached[n] or {}).get("aliases", [])) for n in attached}
        # This rank's Gloo address: its alias on the internal network and nowhere else.
        transport = values["group_transport_host"]
        assert transport in aliases[plane], (name, transport)
        assert all(transport not in a for n, a in aliases.items() if n != plane)
        assert transport not in compose["services"]  # a service name resolves on every network
        # The store: rank 0's alias on the internal network, never a published port.
        store_host, store_port = values["group_store"].rsplit(":", 1)
        [rank0] = [n for n, v in groups.items() if v["group_rank"] == "0"]
        assert store_host in (servers[rank0]["networks"][plane] or {}).get("aliases", [])
        assert int(store_port) not in {50051, 9464}
        assert "default" in attached  # gRPC and metrics: where trainers and Prometheus are
    assert len(planes) == 1
    [plane] = planes
    on_plane = [n for n, s in compose["services"].items() if plane in (s.get("networks") or {})]
    assert sorted(on_plane) == sorted(groups)
    prometheus = compose["services"]["prometheus"]
    assert plane not in (prometheus.get("networks") or {})
