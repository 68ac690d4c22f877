"""deploy/k8s/'s manifests rendered and read (`kubectl kustomize`), for the checks that need no
cluster: test_k8s.py (validation, and the manifests against the server and the image) and
test_k8s_pods.py (the pods run as local processes)."""

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

import yaml


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


def selects_pods(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions In / NotIn) against a pod's labels."""
    operators = {"In": lambda v, values: v in values,
                 "NotIn": lambda v, values: v not in values}
    return selects(selector.get("matchLabels", {}), labels) and all(
        operators[e["operator"]](labels.get(e["key"]), e["values"])
        for e in selector.get("matchExpressions", []))


def admits(policy: dict, source, port: int, named: dict) -> bool:
    """Whether NetworkPolicy `policy` (Ingress) lets `source` connect to TCP `port` of a pod it
    selects: `source` is the labels of a pod in the same namespace, or None for anything else
    (another namespace, outside the cluster); `named` maps the pod's port names to numbers.
    Only what the manifests use is understood (podSelector matchLabels, ports by name or number);
    anything else fails the test rather than being guessed."""
    assert "Ingress" in policy["spec"]["policyTypes"]
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        if peers is not None:
            for peer in peers:
                assert set(peer) == {"podSelector"} and set(peer["podSelector"]) <= {
                    "matchLabels"}, f"a peer this check does not understand: {peer}"
            if source is None or not any(selects(p["podSelector"].get("matchLabels", {}), source)
                                         for p in peers):
                continue
        ports = rule.get("ports")
        if ports is None:
            return True
        for p in ports:
            assert p.get("protocol", "TCP") == "TCP" and "endPort" not in p, p
            if named.get(p["port"], p["port"]) == port:
                return True
    return False


# ----- offline validation -----
