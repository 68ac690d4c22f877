"""What the deploy tests share (scripts/test-deploy runs them after building the images): the
Docker and compose commands, containers' health and ports, and a few training steps through a
server against a float64 torch reference — the same steps whatever runs the server."""

import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass

import pytest
import torch

import remotehead

# scripts/test-deploy says which client and which images: Debian's docker.io client (its
# BuildKit needs no buildx), `sudo` in front where the user is not root.
DOCKER = shlex.split(os.environ.get("REMOTEHEAD_DOCKER", "/usr/bin/docker"))
COMPOSE = shlex.split(os.environ.get("REMOTEHEAD_COMPOSE", "docker-compose"))
IMAGE = os.environ.get("REMOTEHEAD_DEPLOY_IMAGE", "remotehead:cpu")


def docker(*args: str, check: bool = True, timeout: float = 300) -> str:
    result = subprocess.run([*DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: exit {result.returncode}\n"
                             f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result.stdout


def state(container: str) -> dict:
    return json.loads(docker("inspect", "--format", "{{json .State}}", container))


def logs(container: str) -> str:
    result = subprocess.run([*DOCKER, "logs", container], capture_output=True, text=True,
                            timeout=60)
    return result.stdout + result.stderr


def wait_healthy(container: str, timeout: float = 240) -> float:
    """Seconds until the image's HEALTHCHECK says healthy; fails with the log otherwise."""
    start = time.monotonic()
    while True:
        current = state(container)
        health = current.get("Health", {}).get("Status")
        if health == "healthy":
            return time.monotonic() - start
        if not current["Running"] or health == "unhealthy" or \
                time.monotonic() - start > timeout:
            raise AssertionError(f"{container}: {current.get('Status')}, health {health} after "
                                 f"{time.monotonic() - start:.0f} s\n{logs(container)[-4000:]}")
        time.sleep(1)


def published(container: str, port: int) -> str:
    """host:port the engine published a container port on (docker port)."""
    line = docker("port", container, f"{port}/tcp").splitlines()[0]
    host, _, number = line.rpartition(":")
    return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '[::]') else host}:{number}"


@dataclass
class Trained:
    losses: list
    weight: torch.Tensor  # the float64 reference's weights after the steps


def train_against_reference(target: str, head: str, *, vocab: int = 1000, hidden_size: int = 64,
                            steps: int = 4, lr: float = 0.5, seed: int = 0) -> Trained:
    """Uploads a head, takes `steps` fused steps with server-side SGD, and checks each loss and
    dX against the float64 full-logits reference (1e-5 relative loss; dX 1e-4), then the
    server's weights against the reference's (1e-4)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.02
    reference = weight.clone().double()
    losses = []
    with remotehead.Client(target) as client:
        client.upload_head(head, weight)
        for step in range(steps):
            hidden = torch.randn(32, hidden_size, generator=generator)
            labels = torch.randint(0, vocab, (32,), generator=generator)
            result = client.forward_backward(head, hidden, labels,
                                             gradient_id=("deploy", step, 0))
            w = reference.clone().requires_grad_(True)
            x = hidden.double().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(x @ w.T, labels)
            loss.backward()
            assert abs(result.loss - loss.item()) <= 1e-5 * abs(loss.item()), \
                (step, result.loss, loss.item())
            torch.testing.assert_close(result.grad_hidden.double(), x.grad, rtol=1e-4,
                                       atol=1e-6)
            client.optimizer_step(head, sgd=dict(lr=lr), zero_gradients=True)
            reference -= lr * w.grad
            losses.append(result.loss)
        exported, _ = client.export_weights(head)
    torch.testing.assert_close(exported.double(), reference, rtol=1e-4, atol=1e-5)
    return Trained(losses, reference)


@pytest.fixture
def names(request):
    """Unique container / project names for a test; whatever it made is removed at the end."""
    prefix = f"rhdeploy-{os.getpid()}-{request.node.name.replace('_', '')[:20]}"
    made = {"containers": [], "volumes": []}
    yield prefix, made
    for container in made["containers"]:
        docker("rm", "-f", container, check=False)
    for volume in made["volumes"]:
        docker("volume", "rm", "-f", volume, check=False)
