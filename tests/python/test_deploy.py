"""deploy/ and docker/, checked without a Docker engine (none here): the compose file validates
with Debian's docker-compose for both profiles and mounts files that exist; Prometheus' config
passes promtool; every PromQL expression of the Grafana dashboard parses (promtool check rules)
and every metric it uses is one a live server exports (read from /metrics after a workload);
the Dockerfiles are multi-stage, run as a non-root user, expose the gRPC and metrics ports,
copy only what exists and health-check through docker/healthcheck.py, which itself answers 0
for a serving server and non-zero for a closed port."""

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
import yaml

import remotehead
from remotehead.local_server import LocalHeadGroup, LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "remotehead.json"
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
# The metrics README.md lists (and the dashboard may use).
EXPORTED = {
    "remotehead_requests_total", "remotehead_request_duration_seconds",
    "remotehead_step_phase_seconds", "remotehead_tokens_total",
    "remotehead_received_bytes_total", "remotehead_sent_bytes_total",
    "remotehead_inflight_requests", "remotehead_admission_active_requests",
    "remotehead_admission_queued_requests", "remotehead_admission_reserved_bytes",
    "remotehead_admission_budget_bytes", "remotehead_device_memory_allocated_bytes",
    "remotehead_device_memory_reserved_bytes", "remotehead_device_memory_peak_bytes",
    "remotehead_logits_chunk_max_bytes", "remotehead_heads", "remotehead_head_weight_version",
    "remotehead_head_accumulated_micro_batches", "remotehead_head_last_loss",
    # Synchronous optimizer steps of data-parallel trainers (the aborted counter appears with
    # its first abort, labelled by reason).
    "remotehead_sync_step_wait_seconds", "remotehead_sync_step_ranks_waiting",
    "remotehead_sync_steps_applied_total",
}
# What a head group's rank exports besides (README.md lists them too).
GROUP_EXPORTED = {
    "remotehead_group_info", "remotehead_group_up", "remotehead_group_collective_bytes_total",
    "remotehead_group_collectives_total", "remotehead_group_command_seconds",
}
# The servers each compose profile starts (with Prometheus and Grafana).
PROFILE_SERVERS = {"cpu": ["remotehead-cpu"], "gpu": ["remotehead-gpu"],
                   "cpu-group": ["remotehead-rank0", "remotehead-rank1"]}


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name}: installed by scripts/bootstrap (Debian package)"
    return path


def dashboard_expressions():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


@pytest.mark.parametrize("profile", sorted(PROFILE_SERVERS))
def test_compose_file_validates_for_each_profile(profile):
    result = subprocess.run([tool("docker-compose"), "-f", str(DEPLOY / "docker-compose.yml"),
                             "--profile", profile, "config"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    # docker-compose 1.29 prints every service; the profiles say which ones start.
    services = config["services"]
    assert set(services) == {s for servers in PROFILE_SERVERS.values() for s in servers} | {
        "prometheus", "grafana"}
    assert [name for name, s in services.items() if profile in s.get("profiles", [])] \
        == sorted(PROFILE_SERVERS[profile] + ["prometheus", "grafana"],
                  key=list(services).index)
    for server in PROFILE_SERVERS[profile]:
        ports = {str(p["target"]) if isinstance(p, dict) else str(p).split(":")[-1]
                 for p in config["services"][server]["ports"]}
        assert ports == {"50051", "9464"}
    server = PROFILE_SERVERS[profile][0]
    if profile == "gpu":
        devices = services[server]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    dockerfile = config["services"][server]["build"]["dockerfile"]
    assert (ROOT / dockerfile).is_file()
    if profile == "cpu-group":
        # Every rank: the same head, the group's size and store, its own rank.
        flags = [dict(a.split("=", 1) for a in services[s]["command"] if "=" in a)
                 for s in PROFILE_SERVERS[profile]]
        assert [f["--group_rank"] for f in flags] == ["0", "1"]
        for f in flags:
            assert f["--group_size"] == "2"
            assert f["--group_store"] == "remotehead-rank0:29500"
            assert f["--head"] == flags[0]["--head"]
            # The store is beyond loopback: every rank seals the log with the shared secret.
            assert f["--group_secret_file"] == "/run/secrets/remotehead-group-secret"
            assert "--state_dir" not in f
        for s in PROFILE_SERVERS[profile]:
            secrets = [x if isinstance(x, str) else x["source"] for x in services[s]["secrets"]]
            assert secrets == ["remotehead-group-secret"]
        assert config["secrets"]["remotehead-group-secret"]["file"].endswith("group-secret")
    for name in ("prometheus", "grafana"):
        for volume in config["services"][name]["volumes"]:
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            assert pathlib.Path(source).exists(), f"{name} mounts {source}, which is missing"


def test_prometheus_config_passes_promtool():
    result = subprocess.run([tool("promtool"), "check", "config", str(DEPLOY / "prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_expression_is_valid_promql(tmp_path):
    expressions = dashboard_expressions()
    assert len(expressions) >= 12
    # Grafana's interval variables are substituted as Grafana would before the query is sent.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, (_, expr) in enumerate(expressions)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([tool("promtool"), "check", "rules", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


@pytest.fixture(scope="module")
def live_server():
    with LocalServer(BINARY, ["--device=cpu", "--metrics_address=127.0.0.1:0"]) as server:
        yield server


@pytest.fixture(scope="module")
def live_group():
    with LocalHeadGroup(BINARY, size=2, args=["--device=cpu", "--metrics_address=127.0.0.1:0"]) \
            as group:
        yield group


def exported_metrics(port):
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return set(re.findall(r"^# TYPE (\w+) \w+$", body, re.MULTILINE)), body


def run_workload(target):
    """An upload, a step, a forward and a failing call: every kind of metric gets a sample."""
    with remotehead.Client(target) as client:
        client.upload_head("deploy", torch.randn(64, 16))
        client.forward_backward("deploy", torch.randn(8, 16), torch.randint(0, 64, (8,)),
                                gradient_id=("deploy", 0, 0))
        client.forward("deploy", torch.randn(8, 16), torch.randint(0, 64, (8,)))
        with pytest.raises(remotehead.RemoteheadError):
            client.describe_head("missing")


def test_dashboard_uses_only_metrics_the_server_exports(live_server, live_group):
    torch.manual_seed(0)
    run_workload(live_server.target)
    exported, _ = exported_metrics(live_server.metrics_port)
    assert exported == EXPORTED
    # A head group's front after the same: the same metrics, and the group's own.
    run_workload(live_group.target)
    group_exported, _ = exported_metrics(live_group.ranks[0].metrics_port)
    assert group_exported == EXPORTED | GROUP_EXPORTED
    # Every rank says which it is (what the dashboard joins on).
    for rank, server in enumerate(live_group.ranks):
        _, body = exported_metrics(server.metrics_port)
        assert f'remotehead_group_info{{rank="{rank}",size="2"}} 1' in body, body
        assert "remotehead_group_up 1" in body
    exported = group_exported
    used = set()
    for title, expr in dashboard_expressions():
        names = {re.sub(r"_(bucket|sum|count)$", "", n)
                 for n in re.findall(r"\bremotehead_\w+", expr)}
        assert names, f"{title}: {expr} uses no remotehead metric"
        assert names <= exported, f"{title}: {sorted(names - exported)} not exported"
        used |= names
    # The dashboard shows every kind of state the issue asks for.
    assert {"remotehead_device_memory_allocated_bytes", "remotehead_request_duration_seconds",
            "remotehead_step_phase_seconds", "remotehead_tokens_total",
            "remotehead_requests_total", "remotehead_inflight_requests",
            "remotehead_head_weight_version", "remotehead_head_last_loss"} <= used
    # And a head group's ranks: their memory, their collectives, whether the group is up.
    assert {"remotehead_group_info", "remotehead_group_collective_bytes_total",
            "remotehead_group_up", "remotehead_group_command_seconds"} <= used


def dockerfile_stages(path: pathlib.Path):
    """Instructions per stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word.upper(), rest.strip()))
    return stages


@pytest.mark.parametrize("profile,server,dockerfile",
                         [("cpu", "remotehead-cpu", "Dockerfile.cpu"),
                          ("gpu", "remotehead-gpu", "Dockerfile.cuda")])
def test_server_keeps_checkpoints_and_state_on_named_volumes(profile, server, dockerfile):
    """--checkpoint_dir and --state_dir are directories the image creates for its non-root user,
    mounted from named volumes, so saved weights and training state outlive the container."""
    result = subprocess.run([tool("docker-compose"), "-f", str(DEPLOY / "docker-compose.yml"),
                             "--profile", profile, "config"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    flags = dict(arg.split("=", 1) for arg in config["services"][server]["command"] if "=" in arg)
    mounts = {}
    for volume in config["services"][server]["volumes"]:
        source, target = ((volume["source"], volume["target"]) if isinstance(volume, dict)
                          else volume.split(":")[:2])
        mounts[target] = source
    final_stage = dockerfile_stages(ROOT / "docker" / dockerfile)[-1]
    created = " ".join(rest for word, rest in final_stage if word == "RUN")
    for flag in ("--checkpoint_dir", "--state_dir"):
        assert flag in flags, f"{server} runs without {flag}"
        directory = flags[flag]
        assert mounts.get(directory) in config.get("volumes", {}), \
            f"{flag}={directory} is not a named volume of {server}: {mounts}"
        assert re.search(r"install -d -o remotehead\b[^&]*" + re.escape(directory), created), \
            f"{dockerfile} does not create {directory} for the user remotehead"
    assert int(flags["--checkpoint_every_steps"]) > 0

@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_is_multi_stage_non_root_with_health_check(name):
    stages = dockerfile_stages(ROOT / "docker" / name)
    assert len(stages) >= 2
    final = stages[-1]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    exposed = {p for word, rest in final if word == "EXPOSE" for p in rest.split()}
    assert exposed == {"50051", "9464"}
    health = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert len(health) == 1 and "healthcheck.py" in health[0] and "50051" in health[0]
    entrypoint = json.loads(next(rest for word, rest in final if word == "ENTRYPOINT"))
    assert "--metrics_address=0.0.0.0:9464" in entrypoint
    assert "--listen=0.0.0.0:50051" in entrypoint
    for stage in stages:
        for word, rest in stage:
            if word == "COPY" and not rest.startswith("--from"):
                source = rest.split()[0]
                assert (ROOT / source).exists(), f"COPY {source}: missing"


def test_healthcheck_script_reports_serving_and_down(live_server):
    script = str(ROOT / "docker" / "healthcheck.py")
    assert subprocess.run([sys.executable, script, live_server.target],
                          timeout=30).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    down = subprocess.run([sys.executable, script, f"127.0.0.1:{closed}"], capture_output=True,
                          text=True, timeout=30)
    assert down.returncode == 1 and "unhealthy: UNAVAILABLE" in down.stderr
