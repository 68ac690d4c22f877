"""deploy/k8s/, checked without a cluster (none here, none in CI): every overlay and the trainer
Job are rendered by `kubectl kustomize` and every document is validated offline by
kubernetes-validate against a pinned Kubernetes version (strict: unknown fields fail); the
manifests are cross-checked against the server (every flag exists in `remotehead-server
--helpfull`, container ports are the flags' ports, probes dial the gRPC port, the StatefulSet's
replicas equal --group_size, Services select the pods they mean, the headless Service is the
--group_store host, the image's paths are docker/Dockerfile's), and the NetworkPolicy fences the
group plane: the group's pods reach each other on every port, anyone else gRPC and metrics only.
test_k8s_pods.py runs them."""

import copy
import socket

import kubernetes_validate
import pytest

from k8s_manifests import (ROOT, KUBERNETES, OVERLAYS, SECRETS, FILE_FLAGS, VAR, render, find,
                           flags, expand, literal_env, host_port, server_flags, dockerfile,
                           pod_labels, selects, selects_pods, admits)


@pytest.mark.parametrize("folder", ["base", *(f"overlays/{o}" for o in OVERLAYS), "trainer"])
def test_every_document_validates_against_the_pinned_kubernetes(folder):
    documents = render(folder)
    kinds = sorted(d["kind"] for d in documents)
    # A mesh adds a Service per replica front and a disruption budget for its other replicas.
    replicas = OVERLAYS[folder.split("/")[1]][4] if folder.startswith("overlays/") else 1
    services = ["Service"] * (2 + (replicas if replicas > 1 else 0))
    budgets = ["PodDisruptionBudget"] * (2 if replicas > 1 else 1)
    expected = (["ConfigMap", "Job", "Service"] if folder == "trainer" else
                ["NetworkPolicy", *budgets, *services, "StatefulSet"])
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

    # The drain at SIGTERM (docs/kubernetes.md): the kubelet's SIGKILL comes after the calls'
    # grace, the saves' time and the 5 s a signalled rank waits beyond them, with a margin; no
    # preStop hook spends that grace before the server's SIGTERM.
    drain = int(resolved["--shutdown_grace_seconds"]) + int(resolved["--drain_save_seconds"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 5 + 10, (
        pod["terminationGracePeriodSeconds"], drain)
    assert "preStop" not in container.get("lifecycle", {})

    # The image's user; a PodDisruptionBudget that lets no rank of a group go, nor on a mesh
    # (which survives a lost replica: --mesh_min_replicas 1) a rank of replica 0, which leads and
    # serves the store; the other replicas' pods may go one at a time (each rejoins, healed).
    assert pod["securityContext"]["runAsUser"] == uid
    pdb = find(documents, "PodDisruptionBudget", "remotehead")["spec"]
    assert pdb["maxUnavailable"] == 0
    held = [g for g in range(size) if selects_pods(pdb["selector"], pod_labels(statefulset, g))]
    if replicas == 1:
        assert held == list(range(size))
        assert resolved["--mesh_min_replicas"] == "0"
    else:
        assert held == list(range(per_replica))
        assert resolved["--mesh_min_replicas"] == "1"
        others = find(documents, "PodDisruptionBudget", "remotehead-replicas")["spec"]
        assert others["maxUnavailable"] == 1
        assert [g for g in range(size) if selects_pods(others["selector"],
                                                       pod_labels(statefulset, g))] == \
            list(range(per_replica, size))


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_network_policy_fences_the_group_plane(overlay):
    """The policy selects every pod of the group (mesh); those pods reach each other on every
    port (the store, and Gloo / NCCL on ephemeral ports); the trainer Job's pods, and anything
    outside the namespace, reach gRPC and metrics only — not the store, not any other port."""
    size = OVERLAYS[overlay][3]
    documents = render(f"overlays/{overlay}")
    statefulset = find(documents, "StatefulSet")
    policy = find(documents, "NetworkPolicy")
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert set(named) == {"grpc", "metrics", "store"}
    servers = [pod_labels(statefulset, r) for r in range(size)]
    assert all(selects(policy["spec"]["podSelector"]["matchLabels"], s) for s in servers)
    job = find(render("trainer"), "Job")
    trainer = {**job["spec"]["template"]["metadata"]["labels"],
               "batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert not selects(policy["spec"]["podSelector"]["matchLabels"], trainer)
    ephemeral = (1024, 32768, 45678, 60999)  # Gloo's / NCCL's listeners: any port
    for source in servers:
        for port in (*named.values(), *ephemeral):
            assert admits(policy, source, port, named), (source, port)
    for source in (trainer, None, {"app.kubernetes.io/name": "remotehead"}):
        for port in (named["grpc"], named["metrics"]):
            assert admits(policy, source, port, named), (source, port)
        for port in (named["store"], *ephemeral):
            assert not admits(policy, source, port, named), (source, port)
    # The check is real: a rule admitting every port to everyone is caught.
    opened = copy.deepcopy(policy)
    opened["spec"]["ingress"].append({})
    assert admits(opened, None, named["store"], named)


def test_the_pod_spec_says_why_its_grace_period_is_what_it_is():
    """terminationGracePeriodSeconds is explained where it is set: by the flags it must exceed."""
    text = (ROOT / "deploy" / "k8s" / "base" / "statefulset.yaml").read_text()
    before = text.split("terminationGracePeriodSeconds:")[0].splitlines()[:-1]  # its own line
    comment = []
    for line in reversed(before):
        if not line.strip().startswith("#"):
            break
        comment.insert(0, line)
    comment = " ".join(comment)
    for words in ("--shutdown_grace_seconds", "--drain_save_seconds", "ANY pod", "preStop"):
        assert words in comment, (words, comment)


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
    assert "NetworkPolicy" in text and "remotehead-group-plane" in text


# ----- the manifests, run for real -----
