"""deploy/ and docker/, checked without a Docker engine (none here): the compose file validates
with Debian's docker-compose for both profiles and mounts files that exist; Prometheus' config
passes promtool; every PromQL expression of the Grafana dashboard parses (promtool check rules)
and every metric it uses is one a live server exports (read from /metrics after a workload),
which are exactly the metrics docs/metrics.md lists;
the one Dockerfile, rendered for each of its variants (VARIANT=cuda, the default, and cpu; compose
builds each profile's), is multi-stage, runs as a non-root user, exposes the gRPC and metrics
ports, takes the variant's runtime image and device (FLAGS_device, which the server reads with
--fromenv=device), copies only what exists and health-checks through docker/healthcheck.py,
which itself answers 0 for a serving server and non-zero for a closed port."""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request

import pytest
import torch
import yaml

import remotehead
from remotehead.local_server import LocalHeadGroup, LocalServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "remotehead.json"
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
# The metrics docs/metrics.md lists (and the dashboard may use).
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
    # The head's health, published at an optimizer step (the workload takes one, with a GRPO
    # micro-batch that has a reference in its window).
    "remotehead_head_entropy_mean", "remotehead_head_logit_max",
    "remotehead_head_logit_max_mean", "remotehead_head_z_loss_mean",
    "remotehead_head_clipped_fraction", "remotehead_head_kl_mean",
    "remotehead_head_step_tokens_total",
    # Synchronous optimizer steps of data-parallel trainers (the aborted counter appears with
    # its first abort, labelled by reason).
    "remotehead_sync_step_wait_seconds", "remotehead_sync_step_ranks_waiting",
    "remotehead_sync_steps_applied_total",
}
# What a head group's rank exports besides (docs/metrics.md lists them too).
GROUP_EXPORTED = {
    "remotehead_group_info", "remotehead_group_up", "remotehead_group_collective_bytes_total",
    "remotehead_group_collectives_total", "remotehead_group_command_seconds",
}
# A mesh's ranks export these too (docs/meshes.md).
MESH_EXPORTED = {
    "remotehead_mesh_info", "remotehead_mesh_up", "remotehead_mesh_reduced_bytes_total",
    "remotehead_mesh_reduce_seconds_total", "remotehead_mesh_collective_bytes_total",
    "remotehead_mesh_checksums_total", "remotehead_mesh_steps_resolved_total",
    "remotehead_mesh_epoch", "remotehead_mesh_replicas_live", "remotehead_mesh_evictions_total",
    "remotehead_mesh_heals_total", "remotehead_mesh_heal_bytes_total",
}
# Listed in docs/metrics.md but exported only once something happens: the aborted counter
# appears with its first abort (no workload here aborts a synchronous step).
EXPORTED_ONCE_SEEN = {"remotehead_sync_steps_aborted_total"}
METRICS_DOC = ROOT / "docs" / "metrics.md"
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
            # Rank 0's alias on the internal network (test_compose.py checks the fence).
            assert f["--group_store"] == "remotehead-rank0-group:29500"
            assert f["--head"] == flags[0]["--head"]
            # The store is beyond loopback: every rank seals the log with the shared secret.
            assert f["--group_secret_file"] == "/run/secrets/remotehead-group-secret"
            assert "--state_dir" not in f
        for s in PROFILE_SERVERS[profile]:
            secrets = [x if isinstance(x, str) else x["source"] for x in services[s]["secrets"]]
            assert secrets == ["remotehead-group-secret"]
        assert config["secrets"]["remotehead-group-secret"]["file"].endswith("group-secret")
        # As docker-compose reads it: the group plane on an internal network of the ranks only.
        assert config["networks"]["group-plane"]["internal"] is True
        assert [s for s in services if "group-plane" in services[s].get("networks", {})] \
            == PROFILE_SERVERS[profile]
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


def run_workload(target, optimizer_step=True):
    """An upload, steps (a GRPO one with a reference), a forward, a failing call and an optimizer
    step (unless the caller takes its own): every kind of metric gets a sample."""
    with remotehead.Client(target) as client:
        client.upload_head("deploy", torch.randn(64, 16))
        client.forward_backward("deploy", torch.randn(8, 16), torch.randint(0, 64, (8,)),
                                gradient_id=("deploy", 0, 0))
        client.forward_backward("deploy", torch.randn(8, 16), torch.randint(0, 64, (8,)),
                                function="grpo", reduction="sum", gradient_id=("deploy", 0, 1),
                                aux={"advantages": torch.randn(8), "ref_logprobs": -torch.rand(8)})
        client.forward("deploy", torch.randn(8, 16), torch.randint(0, 64, (8,)))
        with pytest.raises(remotehead.RemoteheadError):
            client.describe_head("missing")
        if optimizer_step:
            client.optimizer_step("deploy", sgd=dict(lr=0.1), zero_gradients=True)


def test_the_metrics_doc_lists_exactly_the_exported_metrics():
    """docs/metrics.md's table (the operators' reference) names every metric the test below finds
    a live server and a live group exporting, and nothing else."""
    documented = re.findall(r"^\| `(remotehead_[a-z0-9_]+)` \|", METRICS_DOC.read_text(), re.M)
    assert len(documented) == len(set(documented)), f"listed twice in {METRICS_DOC}: {documented}"
    assert set(documented) == EXPORTED | GROUP_EXPORTED | MESH_EXPORTED | EXPORTED_ONCE_SEEN


def test_a_mesh_exports_the_server_metrics_and_its_own():
    """The leader of a mesh of 2 replicas of 1 (no group inside) after the same workload and an
    optimizer step: the server's metrics and the mesh's, with its replica."""
    with LocalHeadGroup(BINARY, size=2, replicas=2,
                        args=["--device=cpu", "--metrics_address=127.0.0.1:0"]) as mesh:
        torch.manual_seed(0)
        run_workload(mesh.fronts[0], optimizer_step=False)
        with remotehead.Client(mesh.fronts) as client:
            client.optimizer_step("deploy", sgd=dict(lr=0.1), zero_gradients=True)
        exported, _ = exported_metrics(mesh.ranks[0].metrics_port)
        assert exported == EXPORTED | MESH_EXPORTED, exported ^ (EXPORTED | MESH_EXPORTED)
        for replica, rank in enumerate(mesh.ranks):  # replica 1 took no step: the mesh's own
            exported, body = exported_metrics(rank.metrics_port)
            assert MESH_EXPORTED <= exported, MESH_EXPORTED - exported
            assert f'remotehead_mesh_info{{replica="{replica}",replicas="2"}} 1' in body, body
            assert "remotehead_mesh_up 1" in body
            # The step's commit decision: read as "apply" once by every rank.
            assert 'remotehead_mesh_steps_resolved_total{decision="apply"} 1' in body, body
            assert 'remotehead_mesh_steps_resolved_total{decision="abort"} 0' in body, body


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
    # A mesh's ranks export its own besides (test_a_mesh_exports_the_server_metrics_and_its_own).
    exported = group_exported | MESH_EXPORTED
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
    # The head's health row.
    assert {"remotehead_head_entropy_mean", "remotehead_head_logit_max",
            "remotehead_head_logit_max_mean", "remotehead_head_z_loss_mean",
            "remotehead_head_clipped_fraction", "remotehead_head_kl_mean",
            "remotehead_head_step_tokens_total"} <= used
    # And a head group's ranks: their memory, their collectives, whether the group is up.
    assert {"remotehead_group_info", "remotehead_group_collective_bytes_total",
            "remotehead_group_up", "remotehead_group_command_seconds"} <= used
    # And a mesh's: whether each replica is up, its steps' commit decisions, its checksums, its
    # epoch and serving replicas, its heals.
    assert {"remotehead_mesh_info", "remotehead_mesh_up", "remotehead_mesh_steps_resolved_total",
            "remotehead_mesh_checksums_total", "remotehead_mesh_epoch",
            "remotehead_mesh_replicas_live", "remotehead_mesh_evictions_total",
            "remotehead_mesh_heals_total", "remotehead_mesh_heal_bytes_total"} <= used


DOCKERFILE = ROOT / "docker" / "Dockerfile"
# The images docker/Dockerfile builds, by its build argument VARIANT: the runtime stage's base
# image and the server's device (the environment variable FLAGS_device, read by --fromenv).
VARIANTS = {"cuda": ("nvidia/cuda:13.0.1-base-ubuntu24.04", "auto"),
            "cpu": ("ubuntu:24.04", "cpu")}
# The variant each compose profile's servers build.
PROFILE_VARIANTS = {"cpu": "cpu", "gpu": "cuda", "cpu-group": "cpu"}


def dockerfile_instructions(path: pathlib.Path):
    """(INSTRUCTION, rest) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def substitute(text: str, variables: dict) -> str:
    def value(match):
        name = match.group(1) or match.group(2)
        assert name in variables, f"${name}: not a declared ARG"
        return variables[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def render_dockerfile(path: pathlib.Path, build_args: dict):
    """What `docker build --build-arg K=V …` builds from `path`: the build stages, each
    {"name", "base", "instructions"} (FROM's image or stage name with the global ARGs
    substituted), and the final image's instructions: those of the last stage after those of
    the stages it is built FROM, in order."""
    variables, stages = {}, []
    for word, rest in dockerfile_instructions(path):
        if word == "FROM":
            image, _, name = rest.partition(" AS ")
            stages.append({"name": name.strip() or None,
                           "base": substitute(image.strip(), variables), "instructions": []})
        elif stages:
            stages[-1]["instructions"].append((word, rest))
        else:
            assert word == "ARG", f"{word} before the first FROM"
            name, _, default = rest.partition("=")
            variables[name] = build_args.get(name, substitute(default, variables))
    assert set(build_args) <= set(variables), f"undeclared build arguments: {build_args}"
    by_name = {stage["name"]: stage for stage in stages[:-1] if stage["name"]}
    final, stage = [], stages[-1]
    while True:
        final[:0] = stage["instructions"]
        if stage["base"] not in by_name:
            return stages, stage["base"], final
        stage = by_name[stage["base"]]


def environment(instructions) -> dict:
    """The ENV the instructions set (ENV K=V …)."""
    env = {}
    for word, rest in instructions:
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


@pytest.mark.parametrize("profile,server",
                         [("cpu", "remotehead-cpu"), ("gpu", "remotehead-gpu")])
def test_server_keeps_checkpoints_and_state_on_named_volumes(profile, server):
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
    build = config["services"][server]["build"]
    _, _, final = render_dockerfile(ROOT / build["dockerfile"], build.get("args", {}))
    created = " ".join(rest for word, rest in final if word == "RUN")
    for flag in ("--checkpoint_dir", "--state_dir"):
        assert flag in flags, f"{server} runs without {flag}"
        directory = flags[flag]
        assert mounts.get(directory) in config.get("volumes", {}), \
            f"{flag}={directory} is not a named volume of {server}: {mounts}"
        assert re.search(r"install -d -o remotehead\b[^&]*" + re.escape(directory), created), \
            f"{build['dockerfile']} does not create {directory} for the user remotehead"
    assert int(flags["--checkpoint_every_steps"]) > 0


@pytest.mark.parametrize("profile", sorted(PROFILE_SERVERS))
def test_compose_builds_the_one_dockerfile_with_the_profiles_variant(profile):
    result = subprocess.run([tool("docker-compose"), "-f", str(DEPLOY / "docker-compose.yml"),
                             "--profile", profile, "config"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    builds = [services[s]["build"] for s in PROFILE_SERVERS[profile] if "build" in services[s]]
    assert builds, f"no server of the {profile} profile builds its image"
    for build in builds:
        assert build["dockerfile"] == "docker/Dockerfile"
        assert build["args"] == {"VARIANT": PROFILE_VARIANTS[profile]}
    # And a server that builds nothing runs an image of its profile's variant that one builds.
    images = {services[s]["image"] for s in PROFILE_SERVERS[profile]}
    assert images == {"remotehead:" + PROFILE_VARIANTS[profile]}


def test_the_dockerfile_is_the_one_there_is():
    assert sorted(p.name for p in (ROOT / "docker").glob("Dockerfile*")) == ["Dockerfile"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dockerfile_is_multi_stage_non_root_with_health_check(variant):
    stages, base, final = render_dockerfile(DOCKERFILE, {"VARIANT": variant})
    assert len(stages) >= 2
    # The variant's own runtime image and device; the build stage is the same for both.
    assert (base, environment(final)["FLAGS_device"]) == VARIANTS[variant]
    assert ("NVIDIA_DRIVER_CAPABILITIES" in environment(final)) == (variant == "cuda")
    assert stages[0]["base"] == "nvidia/cuda:13.0.1-devel-ubuntu24.04"
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    exposed = {p for word, rest in final if word == "EXPOSE" for p in rest.split()}
    assert exposed == {"50051", "9464"}
    health = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert len(health) == 1 and "healthcheck.py" in health[0] and "50051" in health[0]
    entrypoint = json.loads(next(rest for word, rest in final if word == "ENTRYPOINT"))
    assert "--metrics_address=0.0.0.0:9464" in entrypoint
    assert "--listen=0.0.0.0:50051" in entrypoint
    assert "--fromenv=device" in entrypoint
    for stage in stages:
        for word, rest in stage["instructions"]:
            if word == "COPY" and not rest.startswith("--from"):
                source = rest.split()[0]
                assert (ROOT / source).exists(), f"COPY {source}: missing"


def test_the_base_images_are_build_arguments_whose_defaults_are_the_published_images():
    # A mirror, a registry of one's own, or a locally made base (no registry) replaces them.
    stages, base, _ = render_dockerfile(DOCKERFILE, {"VARIANT": "cpu",
                                                     "BUILD_BASE": "local/base:bookworm",
                                                     "CPU_RUNTIME_BASE": "local/base:runtime"})
    assert (stages[0]["base"], base) == ("local/base:bookworm", "local/base:runtime")
    _, base, _ = render_dockerfile(DOCKERFILE, {"CUDA_RUNTIME_BASE": "mirror/cuda:base"})
    assert base == "mirror/cuda:base"
    stages, _, _ = render_dockerfile(DOCKERFILE, {})
    assert stages[0]["base"] == "nvidia/cuda:13.0.1-devel-ubuntu24.04"


def test_dockerfile_defaults_to_the_cuda_variant_and_has_no_other():
    assert render_dockerfile(DOCKERFILE, {})[1:] == render_dockerfile(DOCKERFILE,
                                                                      {"VARIANT": "cuda"})[1:]
    stages, _, _ = render_dockerfile(DOCKERFILE, {})
    assert {s["name"] for s in stages if (s["name"] or "").startswith("runtime-")} == {
        "runtime-" + variant for variant in VARIANTS}


def test_the_server_takes_its_device_from_flags_device_and_a_later_flag_overrides_it():
    """The images' ENTRYPOINT reads --device from FLAGS_device (--fromenv=device); a --device
    after the image name, as `docker run IMAGE --device=…` appends it, wins."""
    def device_error(env_device, *args):
        result = subprocess.run([BINARY, "--listen=127.0.0.1:0", "--metrics_address=",
                                 "--fromenv=device", *args], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "FLAGS_device": env_device})
        assert result.returncode != 0
        return result.stderr
    assert 'got "from-env"' in device_error("from-env")
    assert 'got "from-flag"' in device_error("from-env", "--device=from-flag")


def test_healthcheck_script_reports_serving_and_down(live_server):
    script = str(ROOT / "docker" / "healthcheck.py")
    assert subprocess.run([sys.executable, script, live_server.target],
                          timeout=30).returncode == 0
    closed = free_port()
    down = subprocess.run([sys.executable, script, f"127.0.0.1:{closed}"], capture_output=True,
                          text=True, timeout=30)
    assert down.returncode == 1 and "unhealthy: UNAVAILABLE" in down.stderr
