"""The CPU image (docker/Dockerfile, VARIANT=cpu), built by scripts/test-deploy from the clone on
a locally made Debian base, run for real: its health check goes healthy, a trainer on the host
trains through it (losses and dX = a float64 torch run, the weights after SGD too), SIGTERM
(`docker stop`) drains it, saving the head's training state into its volume, and started again
it restores that state; the build's extra CA certificates are nowhere in the image."""

import os

import pytest
import torch

import remotehead
from conftest import IMAGE, docker, logs, published, state, train_against_reference, \
    wait_healthy

STATE_DIR = "/var/lib/remotehead/state"


def test_the_image_trains_drains_on_sigterm_and_restores_its_state(names):
    prefix, made = names
    container, volume = f"{prefix}-server", f"{prefix}-state"
    made["containers"].append(container)
    made["volumes"].append(volume)
    docker("volume", "create", volume)
    docker("run", "-d", "--name", container, "-v", f"{volume}:{STATE_DIR}",
           "-p", "127.0.0.1::50051", "-p", "127.0.0.1::9464", IMAGE, f"--state_dir={STATE_DIR}")
    print(f"healthy after {wait_healthy(container):.1f} s")
    assert docker("inspect", "--format", "{{.Config.User}}", container).strip() == "remotehead"

    trained = train_against_reference(published(container, 50051), "toy")
    print("losses", trained.losses)

    # SIGTERM: the server drains, saves the head's state into the volume and exits 0.
    docker("stop", "--time", "60", container)
    stopped = state(container)
    text = logs(container)
    assert stopped["ExitCode"] == 0, text[-3000:]
    assert 'head state saved: "toy" version 4' in text, text[-3000:]
    assert "remotehead-server: stopped" in text

    # Started again on the same volume: the head is back at version 4 with the trained weights.
    docker("start", container)
    wait_healthy(container)
    assert 'head restored: "toy" version 4' in logs(container)
    with remotehead.Client(published(container, 50051)) as client:
        assert client.describe_head("toy").weight_version == 4
        weight, _ = client.export_weights("toy")

    torch.testing.assert_close(weight.double(), trained.weight, rtol=1e-4, atol=1e-5)


def test_the_builds_extra_ca_is_not_in_the_image():
    """scripts/test-deploy hands the build a CA certificate of its own (with the machine's
    bundle) as the secret extra_ca; no file of the final image holds it."""
    extra = os.environ.get("REMOTEHEAD_DEPLOY_EXTRA_CA")
    if not extra:
        pytest.fail("REMOTEHEAD_DEPLOY_EXTRA_CA is not set: run this through scripts/test-deploy")
    lines = [line for line in open(extra).read().splitlines()
             if line and not line.startswith("-----")]
    marker = lines[len(lines) // 2]  # a line of the certificate's body
    result = docker("run", "--rm", "--user", "root", "--entrypoint", "sh", IMAGE, "-c",
                    f"grep -rlF '{marker}' / --exclude-dir=proc --exclude-dir=sys "
                    "--exclude-dir=dev 2>/dev/null; true", timeout=600)
    assert result.strip() == "", f"the build's extra CA is in the image: {result}"
