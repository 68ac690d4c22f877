"""deploy/k8s/, checked without a cluster (none here, none in CI): every overlay and the trainer
Job are rendered by `kubectl kustomize` and every document is validated offline by
kubernetes-validate against a pinned Kubernetes version (strict: unknown fields fail); the
manifests are cross-checked against the server (every flag exists in `remotehead-server
--helpfull`, container ports are the flags' ports, probes dial the gRPC port, the StatefulSet's
replicas equal --group_size, Services select the pods they mean, the headless Service is the
--group_store host, the image's paths are docker/Dockerfile's); and they are run for real: each
pod of the CPU overlay with K = 2 becomes a local remotehead-server process made from its
container's command, args and environment (downward API values substituted, Secrets and
ConfigMaps written where the pod mounts them, the cluster's names and ports mapped onto
loopback), the readiness probe is run as the manifest states it until every rank is ready, a
head is trained through the front Service against a local torch reference, and the trainer Job's
two pods run torchrun and train through the same front."""

import copy
import concurrent.futures
import functools
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import kubernetes_validate
import pytest
import torch
import yaml

import remotehead

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BINARY = os.path.abspath(os.environ.get("REMOTEHEAD_SERVER_BINARY",
                                        str(ROOT / "build" / "server" / "remotehead-server")))
KUBERNETES = "1.31"  # the Kubernetes version the manifests are validated against
# Every overlay: its device, whether it requests a GPU, its image tag, its processes (R·K) and R.
OVERLAYS = {"cpu": ("cpu", False, "remotehead:cpu", 1, 1),
            "gpu": ("cuda:0", True, "remotehead:cuda", 1, 1),
            "cpu-k2": ("cpu", False, "remotehead:cpu", 2, 1),
            "gpu-k2": ("cuda:0", True, "remotehead:cuda", 2, 1),
            "cpu-r2": ("cpu", False, "remotehead:cpu", 2, 2),
            "cpu-r2-k2": ("cpu", False, "remotehead:cpu", 4, 2),
            "gpu-r2-k2": ("cuda:0", True, "remotehead:cuda", 4, 2)}
# What the operator creates (docs/kubernetes.md): Secret name -> its keys.
SECRETS = {"remotehead-tls": {"tls.crt", "tls.key", "ca.crt"},
           "remotehead-token": {"token"}, "remotehead-group-secret": {"secret"}}
FILE_FLAGS = ("--tls_cert", "--tls_key", "--auth_token_file", "--group_secret_file")
VAR = re.compile(r"\$\((\w+)\)")


# ----- rendering and reading the manifests -----

@functools.lru_cache(maxsize=None)
def render(folder: str):
    kubectl = shutil.which("kubectl")
    assert kubectl, ("kubectl (with kustomize v5) is needed to render deploy/k8s: install it "
                     "(the development and CI machines have it)")
    result = subprocess.run([kubectl, "kustomize", str(K8S / folder)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {folder}:\n{result.stderr}"
    return tuple(yaml.safe_load_all(result.stdout))


def find(documents, kind, name=None):
    found = [d for d in documents if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}; got {len(found)}"
    return found[0]


def flags(args):
    """--name=value arguments as a dict (every argument must have that form)."""
    out = {}
    for a in args:
        match = re.fullmatch(r"(--[\w-]+)=(.*)", a)
        assert match, f"expected --flag=value; got {a!r}"
        out[match[1]] = match[2]
    return out


def expand(text: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion in command and args: a defined variable is replaced, $$ is
    a literal $, an undefined reference stays as it is."""
    return re.sub(r"\$\$|\$\((\w+)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def literal_env(container):
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def host_port(address: str):
    host, port = address.rsplit(":", 1)
    return host, int(port)


@functools.lru_cache(maxsize=None)
def server_flags():
    result = subprocess.run([BINARY, "--helpfull"], capture_output=True, text=True, timeout=60)
    flags_ = set(re.findall(r"^\s+--(\w+) \(", result.stdout, re.M))
    assert {"listen", "group_size", "tls_cert"} <= flags_, result.stdout[-2000:]
    return flags_


@functools.lru_cache(maxsize=None)
def dockerfile():
    """The image's paths: the server (ENTRYPOINT), the Python of its venv and the health check
    (HEALTHCHECK, a copy of docker/healthcheck.py), and the user's uid."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    binary = re.search(r'^ENTRYPOINT \["([^"]+)"', text, re.M)[1]
    python, healthcheck = re.search(r'^\s*CMD \["([^"]+python[^"]*)", "([^"]+)"', text,
                                    re.M).groups()
    directory = re.search(r"cp docker/healthcheck\.py (\S+?)/?[;\s]", text)[1]
    assert healthcheck == f"{directory}/healthcheck.py", (healthcheck, directory)
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)[^\n]* remotehead", text)[1])
    return binary, python, healthcheck, uid


# The image's files the tests run from the clone.
def image_programs():
    binary, python, healthcheck, _ = dockerfile()
    return {binary: BINARY, python: sys.executable,
            healthcheck: str(ROOT / "docker" / "healthcheck.py")}


def pod_labels(statefulset, ordinal: int):
    """The labels of pod `ordinal`: the template's and those the StatefulSet controller adds."""
    name = statefulset["metadata"]["name"]
    return {**statefulset["spec"]["template"]["metadata"]["labels"],
            "statefulset.kubernetes.io/pod-name": f"{name}-{ordinal}",
            "apps.kubernetes.io/pod-index": str(ordinal)}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ----- offline validation -----

@pytest.mark.parametrize("folder", ["base", *(f"overlays/{o}" for o in OVERLAYS), "trainer"])
def test_every_document_validates_against_the_pinned_kubernetes(folder):
    documents = render(folder)
    kinds = sorted(d["kind"] for d in documents)
    # A mesh adds a Service per replica front.
    replicas = OVERLAYS[folder.split("/")[1]][4] if folder.startswith("overlays/") else 1
    services = ["Service"] * (2 + (replicas if replicas > 1 else 0))
    expected = (["ConfigMap", "Job", "Service"] if folder == "trainer" else
                ["PodDisruptionBudget", *services, "StatefulSet"])
    assert kinds == expected
    for document in documents:
        assert kubernetes_validate.validate(document, KUBERNETES, strict=True) == KUBERNETES


def test_the_validation_is_real_and_offline(monkeypatch):
    """A mistake fails: an unknown field (strict), a wrong type, a missing required field; and
    the schemas are the package's own files (no network: sockets are refused meanwhile)."""
    def no_network(*args, **kwargs):
        raise AssertionError("kubernetes-validate tried to reach the network")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    statefulset = find(render("overlays/cpu-k2"), "StatefulSet")
    kubernetes_validate.validate(statefulset, KUBERNETES, strict=True)
    unknown = copy.deepcopy(statefulset)
    unknown["spec"]["template"]["spec"]["containers"][0]["argz"] = ["--listen=0.0.0.0:1"]
    wrong_type = copy.deepcopy(statefulset)
    wrong_type["spec"]["replicas"] = "2"
    missing = copy.deepcopy(statefulset)
    del missing["spec"]["selector"]
    for bad in (unknown, wrong_type, missing):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES, strict=True)


# ----- the manifests against the server -----

@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_statefulset_matches_the_server(overlay):
    device, gpu, image, size, replicas = OVERLAYS[overlay]
    documents = render(f"overlays/{overlay}")
    statefulset = find(documents, "StatefulSet")
    name = statefulset["metadata"]["name"]
    spec = statefulset["spec"]
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    binary, python, healthcheck, uid = dockerfile()

    # Every flag is the server's; every $(VAR) is defined by the container's environment.
    assert container["command"] == [binary]
    args = flags(container["args"])
    assert {f[2:] for f in args} <= server_flags(), set(args) - {
        f"--{f}" for f in server_flags()}
    env_names = {e["name"] for e in container["env"]}
    for a in container["args"]:
        assert set(VAR.findall(a)) <= env_names, f"{a}: a variable the pod does not define"
    env = literal_env(container)
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]
              if "valueFrom" in e}
    assert fields == {"POD_INDEX": "metadata.labels['apps.kubernetes.io/pod-index']",
                      "POD_IP": "status.podIP"}
    assert args["--group_rank"] == "$(POD_INDEX)"  # ordinal = rank
    resolved = {k: expand(v, env) for k, v in args.items()}

    # K: the StatefulSet's replicas are the group's size; all ranks start together.
    assert spec["replicas"] == int(resolved["--group_size"]) == size
    assert spec["podManagementPolicy"] == "Parallel"
    assert resolved["--device"] == device
    assert container["image"] == image
    limits = container["resources"].get("limits", {})
    assert (limits.get("nvidia.com/gpu") == 1) == gpu
    assert ("nvidia.com/gpu" in container["resources"]["requests"]) == gpu

    # Ports: the containers' are the flags'; the store's host is rank 0 through the headless
    # Service, which publishes pods before they are ready.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert host_port(resolved["--listen"]) == ("0.0.0.0", ports["grpc"])
    assert host_port(resolved["--metrics_address"]) == ("0.0.0.0", ports["metrics"])
    store_host, store_port = host_port(resolved["--group_store"])
    assert store_port == ports["store"]
    assert store_host == f"{name}-0.{spec['serviceName']}"
    assert args["--group_store_bind"] == "$(POD_IP)"
    headless = find(documents, "Service", spec["serviceName"])["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert all(selects(headless["selector"], pod_labels(statefulset, r)) for r in range(size))
    assert {p["targetPort"] for p in headless["ports"]} <= set(ports)
    assert selects(spec["selector"]["matchLabels"], pod_labels(statefulset, 0))

    # The front: rank 0 only, on the gRPC port.
    front = find(documents, "Service", "remotehead")["spec"]
    assert [r for r in range(size) if selects(front["selector"], pod_labels(statefulset, r))] \
        == [0]
    assert [p["targetPort"] for p in front["ports"]] == ["grpc"]

    # R replicas (a mesh): R divides the processes; each replica's front (global rank r·K) has
    # a Service of its own, which is what that front announces (--group_front_address with
    # "{replica}" filled in); with R = 1 the front announces the front Service.
    assert int(resolved["--group_replicas"]) == replicas and size % replicas == 0
    per_replica = size // replicas
    for r in range(replicas):
        announced = resolved["--group_front_address"].replace("{replica}", str(r))
        host, port = host_port(announced)
        service = find(documents, "Service", host)["spec"]
        assert [g for g in range(size)
                if selects(service["selector"], pod_labels(statefulset, g))] == [r * per_replica]
        assert {p["port"]: p["targetPort"] for p in service["ports"]} == {port: "grpc"}

    # Prometheus scrapes the metrics port.
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"

    # Files come from the Secrets the docs list, mounted where the flags point.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def source(path):
        directory, file = path.rsplit("/", 1)
        volume = volumes[mounts[directory]]
        kind = "secret" if "secret" in volume else "configMap"
        items = {i["path"]: i["key"] for i in volume[kind].get("items", [])}
        return kind, volume[kind].get("secretName") or volume[kind].get("name"), \
            items.get(file, file)

    for flag in FILE_FLAGS:
        kind, secret, key = source(args[flag])
        assert kind == "secret" and key in SECRETS[secret], (flag, secret, key)
    assert {v["secret"]["secretName"] for v in volumes.values() if "secret" in v} == set(SECRETS)

    # The probes: the image's health check, over TLS on the gRPC port.
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    for probe in probes:
        command = probe["exec"]["command"]
        assert command == probes[0]["exec"]["command"]
        assert command[0] == python
        assert command[1] == healthcheck
        options = dict(c.split("=", 1) for c in command[2:-1])
        assert source(options["--ca"])[2] == "ca.crt"
        assert host_port(command[-1]) == ("127.0.0.1", ports["grpc"])
    assert probes[0]["failureThreshold"] * probes[0]["periodSeconds"] >= 120

    # Durable state: the claim is mounted on every rank, and --state_dir is it on every rank
    # (a group's rank keeps its shard's states there, in rank-<g>).
    [claim] = spec["volumeClaimTemplates"]
    state_mount = [m["mountPath"] for m in container["volumeMounts"]
                   if m["name"] == claim["metadata"]["name"]]
    assert state_mount == ["/var/lib/remotehead/state"]
    assert resolved["--state_dir"] == state_mount[0]

    # The image's user; a PodDisruptionBudget over every rank that lets none go.
    assert pod["securityContext"]["runAsUser"] == uid
    pdb = find(documents, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 0
    assert all(selects(pdb["selector"]["matchLabels"], pod_labels(statefulset, r))
               for r in range(size))


def test_the_trainer_job_matches_the_front_and_torchrun():
    job = find(render("trainer"), "Job")
    service = find(render("trainer"), "Service")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    assert container["command"] == ["torchrun"]
    script = next(i for i, a in enumerate(container["args"]) if a.endswith(".py"))
    torchrun, trainer = flags(container["args"][:script]), flags(container["args"][script + 1:])
    assert int(torchrun["--nnodes"]) == spec["completions"]
    assert torchrun["--node_rank"] == "$(NODE_RANK)"
    [node_rank] = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] \
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # Node 0's pod by its Indexed-Job hostname under the headless Service.
    assert torchrun["--master_addr"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert service["metadata"]["name"] == pod["subdomain"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {
        "batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert int(torchrun["--master_port"]) == container["ports"][0]["containerPort"]
    # The trainers dial the front Service on its port, with the server's CA and token.
    server = render("overlays/cpu-k2")
    front = find(server, "Service", "remotehead")
    host, port = host_port(trainer["--server"])
    assert host == front["metadata"]["name"] and port == front["spec"]["ports"][0]["port"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    for flag, secret, key in (("--ca", "remotehead-tls", "ca.crt"),
                              ("--token-file", "remotehead-token", "token")):
        directory, file = trainer[flag].rsplit("/", 1)
        assert mounts[directory]["secret"]["secretName"] == secret
        assert mounts[directory]["secret"]["items"] == [{"key": key, "path": file}]
    directory, file = container["args"][script].rsplit("/", 1)
    configmap = find(render("trainer"), "ConfigMap")
    assert mounts[directory]["configMap"]["name"] == configmap["metadata"]["name"]
    assert file in configmap["data"]


def test_the_docs_name_every_overlay_and_secret():
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in text
    for secret, keys in SECRETS.items():
        assert secret in text and all(k in text for k in keys)


# ----- the manifests, run for real -----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A stand-in for the cluster on loopback: every pod's ports mapped to free local ports, the
    cluster's DNS names (pods through headless Services, Services) mapped onto them, volumes in
    a directory per pod, Secrets and ConfigMaps written there."""

    def __init__(self, root: pathlib.Path, secrets_: dict):
        self.root = root
        self.secrets = secrets_
        self.configmaps = {}
        self.pods = {}  # name -> {"ports": {containerPort: local}, "labels": {...}}
        self.services = {}  # name -> (selector, {port: targetPort})
        self.headless = set()
        self.processes = []

    def add_documents(self, documents):
        for d in documents:
            if d["kind"] == "ConfigMap":
                self.configmaps[d["metadata"]["name"]] = d["data"]
            if d["kind"] == "Service":
                spec = d["spec"]
                self.services[d["metadata"]["name"]] = (
                    spec["selector"], {p["port"]: p["targetPort"] for p in spec["ports"]})
                if spec.get("clusterIP") == "None":
                    self.headless.add(d["metadata"]["name"])

    def add_pod(self, name: str, labels: dict, container: dict):
        named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        self.pods[name] = {"labels": labels, "named": named,
                           "ports": {port: free_port() for port in named.values()}}

    def localize(self, pod: str, argv, volumes: dict):
        """Pod `pod`'s arguments as they mean on loopback: mounted paths -> the pod's
        directories; HOST:PORT of this pod (0.0.0.0, 127.0.0.1), of a pod by its name under a
        headless Service, or of a Service -> 127.0.0.1 and the local port; a pod's name alone
        -> 127.0.0.1, and a bare --…port=N -> the local port of the one pod named beside it."""
        named = [p for a in argv for p in re.findall(r"([a-z0-9-]+)\.([a-z0-9-]+)", a)
                 if p[0] in self.pods and p[1] in self.headless]
        out = []
        for text in argv:
            for mount, directory in sorted(volumes.items(), key=lambda m: -len(m[0])):
                text, n = re.subn(rf"(^|=){re.escape(mount)}(?=/|$)",
                                  lambda m: m[1] + str(directory), text)
                if n:
                    break

            def address(match):
                target = self.resolve(pod, match["host"], int(match["port"]))
                return f"127.0.0.1:{target}" if target else match[0]
            text = re.sub(r"(?P<host>[A-Za-z0-9.-]+):(?P<port>\d{2,5})\b", address, text)
            for name, service in named:
                text = re.sub(rf"(^|=){name}\.{service}(\.[a-z0-9.-]+)?$",
                              lambda m: m[1] + "127.0.0.1", text)
            port = re.fullmatch(r"(--[\w-]*port=)(\d+)", text)
            if port:
                targets = {self.pods[p]["ports"].get(int(port[2])) for p, _ in named} - {None}
                assert len(targets) == 1, f"{text}: whose port? {named}"
                text = f"{port[1]}{targets.pop()}"
            out.append(text)
        return out

    def resolve(self, pod: str, host: str, port: int):
        """The local port behind host:port as pod `pod` dials it; None when not the cluster's."""
        if host in ("0.0.0.0", "127.0.0.1", "localhost"):
            return self.pods[pod]["ports"].get(port)
        names = host.split(".")
        if len(names) >= 2 and names[1] in self.headless and names[0] in self.pods:
            return self.pods[names[0]]["ports"].get(port)
        if names[0] in self.services:
            selector, ports = self.services[names[0]]
            chosen = [p for p, v in self.pods.items() if selects(selector, v["labels"])]
            assert len(chosen) == 1, f"Service {names[0]} selects {chosen}"
            target = ports[port]
            target = self.pods[chosen[0]]["named"].get(target, target)
            return self.pods[chosen[0]]["ports"][target]
        return None

    def volumes(self, pod: str, spec: dict, container: dict) -> dict:
        """mountPath -> a local directory holding what the pod would see there."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out = {}
        for mount in container.get("volumeMounts", []):
            directory = self.root / pod / mount["name"]
            directory.mkdir(parents=True, exist_ok=True)
            volume = volumes.get(mount["name"], {})
            if "secret" in volume or "configMap" in volume:
                kind = "secret" if "secret" in volume else "configMap"
                source = volume[kind]
                data = (self.secrets[source["secretName"]] if kind == "secret"
                        else self.configmaps[source["name"]])
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    path = directory / item["path"]
                    path.write_bytes(data[item["key"]] if isinstance(data[item["key"]], bytes)
                                     else data[item["key"]].encode())
                    path.chmod(0o440)
            out[mount["mountPath"]] = directory
        return out

    def environment(self, pod: str, container: dict, annotations: dict) -> dict:
        """The container's environment: literal values ($(VAR) of earlier ones expanded) and the
        downward API's fields; any other source fails (this stand-in would not know it)."""
        env = {}
        labels = self.pods[pod]["labels"]
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
                continue
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            item = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if path == "metadata.name":
                env[e["name"]] = pod
            elif path == "status.podIP":
                env[e["name"]] = "127.0.0.1"
            elif item:
                env[e["name"]] = (labels if item[1] == "labels" else annotations)[item[2]]
            else:
                raise AssertionError(f"{e['name']}: a field this test does not substitute: {path}")
        return env

    def start(self, pod: str, spec: dict, annotations: dict, programs: dict, extra_env: dict):
        """The pod's one container as a local process; programs maps the image's paths to
        local ones. Returns (process, log path, volumes, environment)."""
        [container] = spec["containers"]
        volumes = self.volumes(pod, spec, container)
        env = self.environment(pod, container, annotations)
        argv = [expand(a, env) for a in container["command"] + container.get("args", [])]
        argv = [programs.get(argv[0], argv[0])] + self.localize(pod, argv[1:], volumes)
        log = self.root / f"{pod}.log"
        process = subprocess.Popen(argv, env={**extra_env, **env}, stdout=log.open("w"),
                                   stderr=subprocess.STDOUT, cwd=self.root)
        self.processes.append(process)
        return process, log, volumes, env

    def stop(self):
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        codes = [process.wait(timeout=60) for process in self.processes]
        self.processes = []
        return codes


def certificate(directory: pathlib.Path):
    """A self-signed certificate for the names a cluster's clients use: the front Service
    (remotehead, which the probe checks) and 127.0.0.1 (this test's clients)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is installed by scripts/bootstrap"
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=remotehead", "-addext",
                    "subjectAltName=DNS:remotehead,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert.read_bytes(), key.read_bytes()


def start_statefulset(documents, root: pathlib.Path):
    """Every pod of the rendered StatefulSet as a local process, with fresh Secrets (a
    certificate for the front's names, a token, a group secret); returns once the readiness
    probe, run as the manifest states it, succeeds on every pod. (cluster, pod names, {name:
    (process, log, volumes, env)}, certificate, token); the caller stops the cluster."""
    statefulset = find(documents, "StatefulSet")
    cert, key = certificate(root)
    token = secrets.token_hex(16)
    cluster = Cluster(root / "pods", {
        "remotehead-tls": {"tls.crt": cert, "tls.key": key, "ca.crt": cert},
        "remotehead-token": {"token": token + "\n"},
        "remotehead-group-secret": {"secret": secrets.token_hex(32)}})
    cluster.add_documents(documents)
    programs = image_programs()
    template = statefulset["spec"]["template"]
    [container] = template["spec"]["containers"]
    names = [f"{statefulset['metadata']['name']}-{r}"
             for r in range(statefulset["spec"]["replicas"])]
    for r, name in enumerate(names):
        cluster.add_pod(name, pod_labels(statefulset, r), container)
    pods = {}
    try:
        for name in names:
            pods[name] = cluster.start(name, template["spec"], template["metadata"]["annotations"],
                                       programs, {"PATH": os.environ["PATH"]})
        deadline = time.monotonic() + 60
        for name in names:
            process, log, volumes, env = pods[name]
            probe = [expand(a, env) for a in container["readinessProbe"]["exec"]["command"]]
            probe = [programs.get(a, a) for a in cluster.localize(name, probe, volumes)]
            while True:
                assert process.poll() is None, f"{name} exited {process.returncode}:\n" \
                    + log.read_text()
                ready = subprocess.run(probe, capture_output=True, text=True, timeout=30)
                if ready.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"{name} never ready: {ready.stderr}\n" \
                    + log.read_text()
                time.sleep(0.3)
    except BaseException:
        cluster.stop()
        raise
    return cluster, names, pods, cert, token


def front_target(cluster, documents, names):
    """The front Service's address (remotehead:50051) as a trainer in the cluster dials it."""
    front = find(documents, "Service", "remotehead")
    [target] = cluster.localize(
        names[0], [f"{front['metadata']['name']}:{front['spec']['ports'][0]['port']}"], {})
    return target


def test_the_single_server_keeps_its_state_on_its_claim(tmp_path):
    """overlays/cpu (K = 1): ready as its probe says, and --state_dir is the claim's mount: a
    saved state lands in the pod's volume."""
    documents = render("overlays/cpu")
    cluster, names, pods, cert, token = start_statefulset(documents, tmp_path)
    _, log, volumes, env = pods[names[0]]
    [container] = find(documents, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    probe = [expand(a, env) for a in container["livenessProbe"]["exec"]["command"]]
    probe = [image_programs().get(a, a) for a in cluster.localize(names[0], probe, volumes)]
    try:
        assert subprocess.run(probe, capture_output=True).returncode == 0
        # The probe checks the certificate's name: another name fails.
        other = [re.sub(r"^--server-name=.*", "--server-name=other", a) for a in probe]
        assert other != probe
        failed = subprocess.run(other, capture_output=True, text=True)
        assert failed.returncode == 1 and "unhealthy" in failed.stderr
        with remotehead.Client(front_target(cluster, documents, names),
                               root_certificates=cert, token=token) as client:
            client.create_head("k1", 16, 4, seed=1)
            assert client.describe_head("k1").group_size <= 1
            client.save_head_state("k1")
        state = volumes["/var/lib/remotehead/state"]
        assert any(p.is_file() for p in state.rglob("*")), log.read_text()
    finally:
        codes = cluster.stop()
    assert codes == [0], log.read_text()
    assert subprocess.run(probe, capture_output=True).returncode == 1  # stopped: not live


def test_the_cpu_group_of_two_runs_as_its_manifests_say_and_trains(tmp_path):
    documents = render("overlays/cpu-k2")
    statefulset = find(documents, "StatefulSet")
    template = statefulset["spec"]["template"]
    cluster, names, pods, cert, token = start_statefulset(documents, tmp_path)
    assert len(names) == 2
    try:
        logs = {name: pods[name][1].read_text() for name in names}
        assert "rank 0 of 2 (the front" in logs[names[0]], logs[names[0]]
        assert "rank 1 of 2 (follows" in logs[names[1]], logs[names[1]]
        assert "sealed with the group's secret" in logs[names[1]]
        assert "TLS" in logs[names[0]] and "bearer-token auth on" in logs[names[0]]

        # Prometheus' view: each pod's annotated port serves /metrics with the token.
        for name in names:
            port = cluster.pods[name]["ports"][
                int(template["metadata"]["annotations"]["prometheus.io/port"])]
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=10) as reply:
                assert re.search(r"^remotehead_group_up(\{[^}]*\})? 1$", reply.read().decode(),
                                 re.M)

        # A head trained through the front Service, against a local torch reference.
        target = front_target(cluster, documents, names)
        vocab, hidden_size, lr = 37, 8, 0.5
        torch.manual_seed(3)
        weight = torch.randn(vocab, hidden_size) * 0.3
        with remotehead.Client(target, root_certificates=cert, token=token) as client:
            client.upload_head("k8s", weight)
            info = client.describe_head("k8s")
            assert info.group_size == 2 and info.shards == ((0, 19), (19, 18))
            reference = weight.clone().double()
            for step in range(3):
                hidden = torch.randn(11, hidden_size)
                labels = torch.randint(0, vocab, (11,))
                result = client.forward_backward("k8s", hidden, labels,
                                                 gradient_id=("k8s-test", step, 0))
                w = reference.clone().requires_grad_(True)
                x = hidden.double().requires_grad_(True)
                loss = torch.nn.functional.cross_entropy(x @ w.T, labels)
                loss.backward()
                assert abs(result.loss - loss.item()) <= 1e-5 * abs(loss.item())
                torch.testing.assert_close(result.grad_hidden.double(), x.grad, rtol=1e-4,
                                           atol=1e-6)
                client.optimizer_step("k8s", sgd=dict(lr=lr), zero_gradients=True)
                reference -= lr * w.grad
            exported, _ = client.export_weights("k8s")
            torch.testing.assert_close(exported.double(), reference, rtol=1e-4, atol=1e-5)

        # A client that dials rank 1 is told to use the front Service (--group_front_address).
        rank1 = f"127.0.0.1:{cluster.pods[names[1]]['ports'][50051]}"
        deadline = time.monotonic() + 10
        with remotehead.Client(rank1, root_certificates=cert, token=token) as client:
            while True:
                with pytest.raises(remotehead.NotTheFrontError) as refused:
                    client.list_heads()
                if refused.value.front or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert refused.value.front == target

        # The trainer Job: its two pods run torchrun against the front, as job.yaml says.
        job_documents = render("trainer")
        cluster.add_documents(job_documents)
        job = find(job_documents, "Job")
        job_pod = job["spec"]["template"]
        job_name = job["metadata"]["name"]
        trainer_env = {"PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
                       "PYTHONPATH": str(ROOT / "client" / "python")}
        trainers = []
        for index in range(job["spec"]["completions"]):
            name = f"{job_name}-{index}"
            labels = {**job_pod["metadata"]["labels"], "batch.kubernetes.io/job-name": job_name}
            cluster.add_pod(name, labels, job_pod["spec"]["containers"][0])
        for index in range(job["spec"]["completions"]):
            name = f"{job_name}-{index}"
            annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
            trainers.append(cluster.start(name, job_pod["spec"], annotations, {}, trainer_env))
        for process, log, _, _ in trainers:
            assert process.wait(timeout=120) == 0, log.read_text()
        out = trainers[0][1].read_text()
        match = re.search(r"trained: first loss ([\d.]+), last loss ([\d.]+), head version "
                          r"(\d+)", out)
        assert match, out
        args = job_pod["spec"]["containers"][0]["args"]
        script = next(i for i, a in enumerate(args) if a.endswith(".py"))
        steps = int(flags(args[script + 1:])["--steps"])
        assert int(match[3]) == steps  # one synchronous step per global step, not one per rank
        assert float(match[2]) < 0.9 * float(match[1]), out
    finally:
        codes = cluster.stop()
        logs = "".join(f"--- {log}\n{log.read_text()}" for _, log, _, _ in pods.values())
    assert codes[:len(names)] == [0] * len(names), logs


def test_the_cpu_mesh_of_two_groups_runs_as_its_manifests_say_and_trains(tmp_path):
    """overlays/cpu-r2-k2: 4 pods, 2 replicas of groups of 2. Every pod ready by its probe, each
    knows its replica and shard; two trainers, each at its own replica front's Service (trainer
    t at remotehead-replica-(t mod 2)), add their micro-batches and take synchronous SGD steps:
    both replicas hold the same weights, equal to a float64 torch reference of the average; a
    saved state lands on every pod's claim, as that rank's shard, under one state id."""
    documents = render("overlays/cpu-r2-k2")
    cluster, names, pods, cert, token = start_statefulset(documents, tmp_path)
    assert len(names) == 4
    try:
        logs = {name: pods[name][1].read_text() for name in names}
        assert "replica 0 of 2, rank 0 of 2 (the leader" in logs[names[0]], logs[names[0]]
        assert "replica 1 of 2, rank 0 of 2 (a replica's front" in logs[names[2]]
        assert "replica 1 of 2, rank 1 of 2 (follows" in logs[names[3]]
        fronts = [cluster.localize(names[0], [f"remotehead-replica-{r}:50051"], {})[0]
                  for r in range(2)]
        assert fronts[0] == front_target(cluster, documents, names)  # the leader
        vocab, hidden_size, lr, world = 37, 8, 0.5, 2
        torch.manual_seed(5)
        weight = torch.randn(vocab, hidden_size) * 0.3
        reference = weight.clone().double()
        with remotehead.Client(fronts, rank=0, root_certificates=cert, token=token) as leader:
            leader.upload_head("mesh", weight)
            for step in range(2):
                batches = [(torch.randn(9, hidden_size), torch.randint(0, vocab, (9,)))
                           for _ in range(world)]
                w = reference.clone().requires_grad_(True)
                sum(torch.nn.functional.cross_entropy(x.double() @ w.T, t)
                    for x, t in batches).backward()
                reference -= lr * w.grad / world

                def trainer(rank):
                    with remotehead.Client(fronts, rank=rank, root_certificates=cert,
                                           token=token) as client:
                        x, t = batches[rank]
                        client.forward_backward("mesh", x, t, accumulate=True,
                                                gradient_id=(f"k8s/rank-{rank}", step, 0))
                        return client.optimizer_step("mesh", sgd=dict(lr=lr),
                                                     zero_gradients=True,
                                                     synchronous=(step, rank, world))
                with concurrent.futures.ThreadPoolExecutor(world) as pool:
                    infos = list(pool.map(trainer, range(world)))
                assert [i.weight_version for i in infos] == [step + 1] * world
            exported = []
            for front in fronts:
                with remotehead.Client(front, root_certificates=cert, token=token) as client:
                    exported.append(client.export_weights("mesh")[0])
            assert torch.equal(exported[0], exported[1])
            torch.testing.assert_close(exported[0].double(), reference, rtol=1e-4, atol=1e-5)
            # Durable state: every pod saves its shard on its own claim, under one state id.
            state_id = leader.save_head_state("mesh").state_id
        for g, name in enumerate(names):
            claim = pods[name][2]["/var/lib/remotehead/state"]
            assert (claim / f"rank-{g}" / "mesh" / f"{state_id}.safetensors").is_file(), name
    finally:
        codes = cluster.stop()
    assert codes == [0, 0, 0, 0], "".join(p[1].read_text() for p in pods.values())
