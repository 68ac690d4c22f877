"""The operator CLI (`remotehead`, remotehead/cli.py) against the real server binary, run as a
separate process as an operator would: heads / describe / save / drop / zero / health in text
and --json, exit codes that follow the server's statuses (0, 5 NOT_FOUND, 9
FAILED_PRECONDITION, 14 UNAVAILABLE, 16 UNAUTHENTICATED) with the server's message, usage
errors 64, and TLS with a bearer token from a file.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import pki
import remotehead
from remotehead.local_server import LocalServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))


def cli(*args, server=None):
    """Runs `python -m remotehead.cli`; (exit code, stdout, stderr)."""
    argv = [sys.executable, "-m", "remotehead.cli"]
    if server is not None:
        argv += ["--server", server]
    result = subprocess.run(argv + list(args), capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "client" / "python")})
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    with LocalServer(BINARY, ["--device=cpu", "--head=lm:64:8", f"--checkpoint_dir={checkpoints}"]) \
            as s:
        s.checkpoints = checkpoints
        yield s


def test_heads_and_describe_in_text_and_json(server):
    code, out, err = cli("heads", server=server.target)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "VOCAB", "HIDDEN", "DTYPE", "DEVICE", "VERSION",
                                "MICRO_BATCHES", "RANKS"]
    assert lines[1].split()[:4] == ["lm", "64", "8", "float32"]
    code, out, err = cli("--json", "heads", server=server.target)
    assert code == 0, err
    heads = json.loads(out)
    assert [h["head_id"] for h in heads] == ["lm"]
    assert heads[0]["vocab_size"] == 64 and heads[0]["dtype"] == "float32"
    code, out, err = cli("--json", "describe", "lm", server=server.target)
    assert code == 0, err
    assert json.loads(out) == heads[0]
    code, out, _ = cli("describe", "lm", server=server.target)
    assert "vocab_size: 64" in out.splitlines()


def test_zero_save_and_drop(server):
    with remotehead.Client(server.target) as client:
        client.upload_head("cli", torch.randn(16, 8))
        client.forward_backward("cli", torch.randn(4, 8), torch.randint(0, 16, (4,)),
                                gradient_id=("cli", 0, 0))
        assert client.describe_head("cli").accumulated_micro_batches == 1
        code, out, err = cli("--json", "zero", "cli", server=server.target)
        assert code == 0, err
        assert json.loads(out)["accumulated_micro_batches"] == 0
        assert client.fetch_gradients("cli")[0].abs().max().item() == 0
        code, out, err = cli("save", "cli", "cli.safetensors", server=server.target)
        assert code == 0, err
        assert "cli.safetensors" in out
        assert (server.checkpoints / "cli.safetensors").stat().st_size > 16 * 8 * 4
        code, out, err = cli("drop", "cli", server=server.target)
        assert code == 0, err
        with pytest.raises(remotehead.RemoteheadError):
            client.describe_head("cli")


def test_exit_codes_follow_the_servers_statuses(server, tmp_path):
    code, _, err = cli("describe", "missing", server=server.target)
    assert code == 5, err  # NOT_FOUND
    assert "NOT_FOUND" in err and '"missing"' in err
    code, _, err = cli("--json", "drop", "missing", server=server.target)
    assert code == 5
    assert json.loads(err)["code"] == "NOT_FOUND"
    code, _, err = cli("save", "lm", "../outside.safetensors", server=server.target)
    assert code == 3, err  # INVALID_ARGUMENT: a path leaving the checkpoint directory
    # A server without --checkpoint_dir refuses saves: FAILED_PRECONDITION.
    with LocalServer(BINARY, ["--device=cpu", "--head=lm:64:8"]) as plain:
        code, _, err = cli("save", "lm", "x.safetensors", server=plain.target)
        assert code == 9, err
        assert "--checkpoint_dir" in err
    # Nothing listening: UNAVAILABLE, for calls and for health.
    closed = f"127.0.0.1:{free_port()}"
    code, _, err = cli("--timeout", "3", "heads", server=closed)
    assert code == 14, err
    code, _, err = cli("--timeout", "3", "health", server=closed)
    assert code == 14, err
    # A bad command line: 64, not a gRPC code.
    code, _, err = cli("describe", server=server.target)
    assert code == 64, err
    code, _, err = cli("--cert", str(tmp_path / "x"), "heads", server=server.target)
    assert code == 64 and "--cert and --key" in err


def test_health(server):
    code, out, err = cli("health", server=server.target)
    assert code == 0, err
    assert out.strip() == "SERVING"
    code, out, _ = cli("--json", "health", server=server.target)
    assert json.loads(out) == {"server": server.target, "status": "SERVING"}


def test_tls_and_token(tmp_path):
    cert, key = pki.self_signed_certificate(tmp_path)
    token = tmp_path / "token"
    token.write_text("rh-cli-token-7c1f\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    args = ["--device=cpu", "--head=lm:64:8", f"--tls_cert={cert}", f"--tls_key={key}",
            f"--auth_token_file={token}"]
    with LocalServer(BINARY, args) as server:
        ca = str(cert)
        code, out, err = cli("--ca", ca, "--token-file", str(token), "heads",
                             server=server.target)
        assert code == 0, err
        assert out.splitlines()[1].split()[0] == "lm"
        code, _, err = cli("--ca", ca, "--token-file", str(wrong), "heads", server=server.target)
        assert code == 16, err  # UNAUTHENTICATED
        code, _, err = cli("--token-file", str(token), "heads", server=server.target)
        assert code == 64 and "--ca" in err  # a token is never sent in clear text
