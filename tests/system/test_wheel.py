"""The installable Python client: `python -m build` on a copy of client/python and proto/ alone
(no C++ build, no stubs in the tree: they are generated at build time by setup.py) makes an
sdist that carries the .proto (and the requirements files the build reads) and, from that sdist, a
wheel, whose dependencies are client/python/requirements.txt's; the wheel installs
into a fresh virtual environment, whose `remotehead` entry point and `import remotehead` then
work against the real server binary, including a step. The environment is offline: the wheel
is installed with --no-index --no-deps, and the dependencies (torch, grpcio, protobuf, numpy,
the project's pins) are those of the project's environment, seen through a .pth file.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

from remotehead.local_server import LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))


def run(argv, **kwargs):
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300,
                            **kwargs)
    assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(ROOT / "proto", source / "proto")
    shutil.copytree(ROOT / "client" / "python", source / "client" / "python",
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    shutil.rmtree(source / "client" / "python" / "remotehead" / "v1", ignore_errors=True)
    # Offline: --no-isolation builds with the environment's setuptools and grpcio-tools (which
    # build checks is the pin of requirements-build.txt, setup.py's setup_requires).
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist",
         source / "client" / "python"])
    (sdist,) = (tmp / "dist").glob("remotehead-*.tar.gz")
    with tarfile.open(sdist) as archive:
        assert any(n.endswith("proto/remotehead/v1/head_service.proto")
                   for n in archive.getnames()), archive.getnames()
        # The requirements the wheel's build reads: its dependencies and its build's.
        for name in ("requirements.txt", "requirements-build.txt"):
            assert any(n.endswith(f"-0.1.0/{name}") for n in archive.getnames()), name
    (built,) = (tmp / "dist").glob("remotehead-*.whl")
    return built


def test_the_wheel_holds_the_generated_stubs_and_the_entry_point(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "remotehead/v1/head_service_pb2.py" in names
    assert "remotehead/v1/head_service_pb2_grpc.py" in names
    assert "remotehead/cli.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "remotehead = remotehead.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # Its dependencies are client/python/requirements.txt's, the pins' one home.
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    depends = [line.split(":", 1)[1].strip()
               for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
               if line.startswith("Requires-Dist:")]
    lines = (ROOT / "client" / "python" / "requirements.txt").read_text().splitlines()
    assert depends == [r for r in (line.split("#", 1)[0].strip() for line in lines) if r]


def test_installed_into_a_fresh_environment_it_steps_against_the_server(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    python, cli = venv / "bin" / "python", venv / "bin" / "remotehead"
    # The dependencies, offline: the project environment's packages, after the venv's own.
    purelib = pathlib.Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"]).strip())
    (purelib / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([python, "-m", "pip", "install", "--no-index", "--no-deps", wheel])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the installed copy
    where = run([python, "-c", "import remotehead; print(remotehead.__file__)"], env=env)
    assert where.startswith(str(venv)), where
    with LocalServer(BINARY, ["--device=cpu", "--head=lm:64:8"]) as server:
        listed = run([cli, "--server", server.target, "heads"], env=env)
        assert listed.splitlines()[1].split()[:3] == ["lm", "64", "8"]
        step = ("import torch, remotehead\n"
                f"c = remotehead.Client('{server.target}')\n"
                "torch.manual_seed(0)\n"
                "r = c.forward_backward('lm', torch.randn(5, 8), torch.randint(0, 64, (5,)),\n"
                "                       gradient_id=('wheel', 0, 0))\n"
                "assert r.grad_hidden.shape == (5, 8)\n"
                "print(c.describe_head('lm').accumulated_micro_batches)\n")
        assert run([python, "-c", step], env=env).strip() == "1"
