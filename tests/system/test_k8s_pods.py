"""deploy/k8s/ run for real without a cluster: each pod of an overlay becomes a local
remotehead-server process made from its container's command, args and environment (downward API
values substituted, Secrets and ConfigMaps written where the pod mounts them, the cluster's names
and ports mapped onto loopback), the readiness probe is run as the manifest states it until every
rank is ready, a head is trained through the front Service against a local torch reference, and
the trainer Job's two pods run torchrun and train through the same front; every port the ranks
actually listen on is gRPC or metrics or one the NetworkPolicy admits from the group's pods only
(test_k8s.py checks the manifests themselves)."""

import concurrent.futures
import os
import pathlib
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import remotehead
from remotehead.local_server import free_port

from k8s_manifests import (ROOT, render, find, flags, expand, image_programs, pod_labels, selects,
                           admits)


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


def listening_ports(pid: int) -> dict:
    """{port: hex address} of the TCP sockets process `pid` listens on: its descriptors'
    socket:[inode] links matched against /proc/<pid>/net/tcp{,6} entries in state LISTEN."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", link)
        if match:
            inodes.add(match[1])
    found = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    address, port = fields[1].split(":")
                    found[int(port, 16)] = address
    return found


def check_listeners_are_fenced(cluster, documents, names, pods):
    """Every port a rank's process listens on (the real sockets, read from /proc) is gRPC or
    metrics, which the NetworkPolicy admits from anyone, or one it admits from the group's own
    pods only: the store (rank 0) and Gloo's listeners on ephemeral ports (every rank)."""
    policy = find(documents, "NetworkPolicy")
    [container] = find(documents, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    public = {named["grpc"], named["metrics"]}
    fenced = {}
    for name in names:
        ports = cluster.pods[name]["ports"]  # containerPort -> the local port standing for it
        in_pod = {local: port for port, local in ports.items()}
        listening = listening_ports(pods[name][0].pid)
        assert {ports[p] for p in public} <= set(listening), (name, listening)
        for local in listening:
            port = in_pod.get(local, local)  # a container port, else an ephemeral one
            assert admits(policy, None, port, named) == (port in public), (name, port)
            assert all(admits(policy, cluster.pods[n]["labels"], port, named) for n in names)
            if port not in public:
                fenced.setdefault(name, []).append(port)
    assert sorted(fenced) == sorted(names), fenced  # every rank has a Gloo listener
    assert named["store"] in fenced[names[0]], fenced  # rank 0 serves the store
    return fenced


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
        check_listeners_are_fenced(cluster, documents, names, pods)

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
        check_listeners_are_fenced(cluster, documents, names, pods)
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
