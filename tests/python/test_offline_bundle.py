"""The offline bundle for air-gapped machines, end to end on this machine: scripts/bundle writes
the source, the build's Debian packages with their libraries and the Python wheels (never torch);
scripts/install-offline unpacks it into a clean prefix — no root changes, the packages with
dpkg -x — and builds against the given Python's torch with the bundle's packages only (CMake
finds gRPC, protobuf and Abseil in the prefix, the server binary loads gRPC from there), runs
a core and a server test suite, and the server it built takes a step from the client running on
the bundle's own Python packages. Slow (downloads and a compile of the server): it is what
keeps the air-gapped path from rotting."""

import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(argv, timeout, **kwargs):
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "remotehead-bundle"
    run([ROOT / "scripts" / "bundle", out], timeout=1200)
    return out


def test_the_bundle_holds_source_packages_and_wheels_but_not_torch(bundle):
    manifest = (bundle / "MANIFEST").read_text()
    assert "commit: " in manifest and "debs: " in manifest
    debs = [p.name for p in (bundle / "debs").glob("*.deb")]
    for package in ("libgrpc++-dev_", "libprotobuf-dev_", "protobuf-compiler-grpc_",
                    "libabsl-dev_", "prometheus-cpp-dev_", "libgtest-dev_", "nlohmann-json3-dev_",
                    "libgloo-dev_", "libgrpc29_", "libprotobuf32_"):
        assert any(d.startswith(package) for d in debs), package
    # What every machine that compiles C++ has stays out (the target's own C library is used).
    assert not any(d.startswith(("libc6_", "libstdc++6_", "libgcc-s1_")) for d in debs), debs
    wheels = [p.name.lower() for p in (bundle / "wheels").iterdir()]
    for package in ("grpcio_tools-", "grpcio-", "protobuf-", "transformers-", "pytest-"):
        assert any(w.startswith(package) for w in wheels), package
    assert not any(w.startswith(("torch-", "nvidia_", "triton-")) for w in wheels), wheels
    assert (bundle / "source" / "CMakeLists.txt").is_file()
    assert (bundle / "source" / "scripts" / "install-offline").is_file()
    with tarfile.open(f"{bundle}.tar.gz") as archive:
        assert "remotehead-bundle/MANIFEST" in archive.getnames()


def test_installed_offline_into_a_prefix_it_builds_tests_and_steps(bundle, tmp_path):
    prefix = tmp_path / "prefix"
    # The bundle's own install script, from the unpacked tarball, as on the target.
    target = tmp_path / "target"
    target.mkdir()
    with tarfile.open(f"{bundle}.tar.gz") as archive:
        archive.extractall(target)
    unpacked = target / "remotehead-bundle"
    out = run([unpacked / "source" / "scripts" / "install-offline", unpacked,
               "--prefix", prefix, "--python", sys.executable,
               "--targets", "remotehead_server_bin remotehead_python_stubs memory_budget_test "
                            "head_service_test",
               "--tests", "^(HeadServiceTest|MemoryBudgetWorkspace|MemoryStats)\\."],
              timeout=2400, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert "100% tests passed" in out, out[-3000:]

    # The bundle's packages, not the system's: CMake found them in the prefix, and the server
    # binary loads gRPC from there (with its environment; the build also has that RPATH).
    cache = (prefix / "build" / "CMakeCache.txt").read_text()
    deps = str(prefix / "deps")
    for package in ("gRPC_DIR", "absl_DIR", "prometheus-cpp_DIR"):
        line = next(l for l in cache.splitlines() if l.startswith(package + ":"))
        assert deps in line, line
    server = prefix / "build" / "server" / "remotehead-server"
    env_sh = prefix / "env.sh"
    ldd = run(["bash", "-c", f"source {env_sh} && ldd {server}"], timeout=60)
    grpc = next(l for l in ldd.splitlines() if "libgrpc++.so" in l)
    assert deps in grpc, grpc

    # The client on the bundle's Python packages (first on PYTHONPATH) steps against it.
    step = ("import grpc, remotehead, torch\n"
            "from remotehead.local_server import LocalServer\n"
            f"assert grpc.__file__.startswith('{prefix / 'python'}'), grpc.__file__\n"
            f"with LocalServer('{server}', ['--device=cpu', '--head=lm:64:8']) as s:\n"
            "    c = remotehead.Client(s.target)\n"
            "    r = c.forward_backward('lm', torch.randn(5, 8), torch.randint(0, 64, (5,)),\n"
            "                           gradient_id=('offline', 0, 0))\n"
            "    print(tuple(r.grad_hidden.shape), c.describe_head('lm').accumulated_micro_batches)\n"
            "    c.close()\n")
    printed = run(["bash", "-c", f'source {env_sh} && "{sys.executable}" -c "$0"', step],
                  timeout=300)
    assert printed.strip().splitlines()[-1] == "(5, 8) 1", printed
