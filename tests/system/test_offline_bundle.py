"""The offline bundle for air-gapped machines: scripts/bundle writes the source, the build's
Debian packages with their libraries and the Python wheels (never torch). Installing a kit into a
prefix and building there against another torch with the kit's packages only
(scripts/lib/kit-install.sh, which scripts/install-offline and scripts/gpu-check share) is
proved offline in a clean room by tests/system/test_gpu_kit.py."""

import pathlib
import subprocess
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
