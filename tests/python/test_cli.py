"""The operator CLI (`remotehead`, remotehead/cli.py) against the real server binary, run as a
separate process as an operator would: heads / describe / save / drop / zero / health in text
and --json, exit codes that follow the server's statuses (0, 5 NOT_FOUND, 9
FAILED_PRECONDITION, 14 UNAVAILABLE, 16 UNAUTHENTICATED) with the server's message, usage
errors 64, and TLS with a bearer token from a file. Bad input from argv (bytes that are not
UTF-8 included), $REMOTEHEAD_SERVER or the files the command line names ends with exit 64 and
one line on stderr naming the argument, never a traceback nor a call with what gRPC would
make of it.
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


def cli(*args, server=None, env=None):
    """Runs `python -m remotehead.cli` (arguments str or bytes, as argv may hold any bytes);
    (exit code, stdout, stderr)."""
    argv = [sys.executable, "-m", "remotehead.cli"]
    if server is not None:
        argv += ["--server", server]
    result = subprocess.run(argv + list(args), capture_output=True, text=True, timeout=120,
                            env={**os.environ, **(env or {}),
                                 "PYTHONPATH": str(ROOT / "client" / "python")})
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


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs an operator may get wrong: certificates, keys and tokens, good and bad."""
    d = tmp_path_factory.mktemp("inputs")
    cert, key = pki.self_signed_certificate(d)
    other = d / "other"
    other.mkdir()
    _, other_key = pki.self_signed_certificate(other)
    (d / "junk_pem").write_text("not a certificate\n")
    (d / "latin1-token").write_bytes("jeton-\xe9t\xe9\n".encode("latin-1"))  # not UTF-8
    (d / "spaced-token").write_text("two words\n")
    (d / "empty-token").write_text(" \n")
    os.mkfifo(d / "fifo")  # opening it would block until a writer came
    return {"cert": str(cert), "key": str(key), "other_key": str(other_key), "dir": str(d),
            **{name: str(d / name) for name in ("junk_pem", "latin1-token", "spaced-token",
                                                 "empty-token", "fifo")}}


# (arguments before the command, the command, what the one line must name). Files by key of
# the `files` fixture ({cert}, ...). Nothing listens at the server they name: bad input must
# be refused before any call (the code before this check exited 1 with a traceback, or 14
# after calling a server made of what gRPC did with the input).
BAD_INPUTS = {
    "head id not UTF-8": ([], ["describe", b"\xff"], "ID: expected UTF-8 text; got b'\\xff'"),
    "drop id not UTF-8": ([], ["drop", b"lm\xc3"], "ID: expected UTF-8"),
    "zero id not UTF-8": ([], ["zero", b"\xfe"], "ID: expected UTF-8"),
    "save path not UTF-8": ([], ["save", "lm", b"ckpt/\xff.safetensors"], "PATH: expected UTF-8"),
    "weight name not UTF-8": ([], ["save", "lm", "x", "--weight-name", b"\xff"],
                              "--weight-name: expected UTF-8"),
    "token not UTF-8": (["--ca", "{cert}", "--token-file", "{latin1-token}"], ["heads"],
                        "--token-file: expected one token of visible ASCII characters"),
    "token with a space": (["--ca", "{cert}", "--token-file", "{spaced-token}"], ["heads"],
                           "got byte 0x20 at offset 3"),
    "token file empty": (["--ca", "{cert}", "--token-file", "{empty-token}"], ["heads"],
                         "--token-file: expected one bearer token"),
    "token file missing": (["--ca", "{cert}", "--token-file", "{dir}/none"], ["heads"],
                           "--token-file: cannot read"),
    "token file a FIFO": (["--ca", "{cert}", "--token-file", "{fifo}"], ["heads"],
                          "--token-file: expected a regular file; got a special file"),
    "token file a directory": (["--ca", "{cert}", "--token-file", "{dir}"], ["heads"],
                               "--token-file: expected a regular file; got a directory"),
    "CA not PEM": (["--ca", "{junk_pem}"], ["heads"], "--ca: expected PEM certificates"),
    "CA a device": (["--ca", "/dev/zero"], ["heads"], "--ca: expected a regular file"),
    "cert not PEM": (["--ca", "{cert}", "--cert", "{junk_pem}", "--key", "{key}"], ["heads"],
                     "--cert: expected PEM certificates"),
    "key not PEM": (["--ca", "{cert}", "--cert", "{cert}", "--key", "{junk_pem}"], ["heads"],
                    "--key: expected an unencrypted PEM private key"),
    "key of another cert": (["--ca", "{cert}", "--cert", "{cert}", "--key", "{other_key}"],
                            ["heads"], "--key: expected the private key of the certificate"),
    "client cert without TLS": (["--cert", "{cert}", "--key", "{key}"], ["heads"],
                                "--cert and --key: expected --ca as well"),
    "server not UTF-8": (["--server", b"\xff:1"], ["heads"], "--server: expected UTF-8"),
    "server empty": (["--server", ""], ["health"], "--server: expected HOST:PORT"),
    "server without port": (["--server", "127.0.0.1"], ["heads"], "--server: expected HOST:PORT"),
    "server port too big": (["--server", "127.0.0.1:99999"], ["heads"],
                            "--server: expected HOST:PORT"),
    "server bad IPv6": (["--server", "[::1:1"], ["heads"], "--server: expected HOST:PORT"),
    "timeout not a number": (["--timeout", "nan"], ["heads"],
                             "--timeout: expected a positive number"),
    "timeout negative": (["--timeout", "-1"], ["heads"], "--timeout: expected a positive number"),
    "unknown command": ([], ["bogus"], "invalid choice"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_64(case, files):
    before, command, named = BAD_INPUTS[case]
    args = [a.format(**files) if isinstance(a, str) else a for a in before]
    if "--server" not in args:
        args = ["--server", f"127.0.0.1:{free_port()}"] + args
    code, out, err = cli("--timeout", "5", *args, *command)
    assert code == 64, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert named in err, err
    assert out == ""


def test_bad_input_from_the_environment_is_one_line_and_exit_64():
    for value, named in ((b"\xffhost:1", "$REMOTEHEAD_SERVER: expected UTF-8 text"),
                         (b"", "$REMOTEHEAD_SERVER: expected HOST:PORT")):
        code, _, err = cli("heads", env={"REMOTEHEAD_SERVER": os.fsdecode(value)})
        assert code == 64, err
        assert len(err.splitlines()) == 1 and named in err, err


def test_bad_input_with_json_is_one_json_document(files):
    code, out, err = cli("--json", "--ca", files["cert"], "--token-file", files["latin1-token"],
                         "describe", "lm", server=f"127.0.0.1:{free_port()}")
    assert code == 64 and out == ""
    error = json.loads(err)
    assert error["code"] == "USAGE" and error["message"].startswith("--token-file:"), err
    # The token is never shown, whatever is wrong with it.
    assert "jeton" not in err
