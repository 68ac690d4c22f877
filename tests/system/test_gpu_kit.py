"""The GPU kit (scripts/gpu-kit) and its one command (scripts/gpu-check), end to end on this
machine, as the first GPU run will use them:

- the kit for the GPU machine's Python fits one carry (at most 60 MiB), holds the source, the
  build's Debian packages and only the wheels the machine lacks (scripts/lib/gpu-machine.txt);
- the CPU dry run (`gpu-check --device cpu`) in a clean room (tests/gpu/cleanroom): a Debian root
  made here with a compiler, CMake, Ninja and Python but none of the build's -dev packages, no
  network (no route, no name service), and a stand-in for the machine's Python with the machine's
  torch (2.11: the low end of the torch range the project builds against). The kit is installed
  into a prefix there, configured against the prefix's packages only, core, server and the C++
  client built against torch 2.11 and one suite per layer run (gpu_check.DRY_RUN_SUITES: core's
  optimizers and torch linkage, the head service, the C++ client, the wire codec, the Python
  client), then the wire and the benchmark's contenders: the report says every phase passed.

Slow (a build with no compiler cache): it replaces the offline bundle's full recompile.
"""

import json
import os
import pathlib
import subprocess
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMIT_BYTES = 60 * 2**20


def run(argv, timeout, **kwargs):
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def machine(command):
    return run(["python3", ROOT / "scripts" / "lib" / "gpu_machine.py", *command], 60).split()


def size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the clean room needs root "
                                "(namespaces, mounts, chroot); CI runs as root")


@pytest.fixture(scope="module")
def cleanroom():
    out = run([ROOT / "tests" / "gpu" / "cleanroom", "prepare"], timeout=1800)
    facts = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return facts["root"], facts["python"]


def test_the_kit_for_the_gpu_machine_fits_one_carry(tmp_path):
    kit = tmp_path / "kit"
    run([ROOT / "scripts" / "gpu-kit", kit], timeout=1200)
    total = size(kit)
    assert total <= LIMIT_BYTES, f"the kit is {total / 2**20:.1f} MiB (limit 60 MiB)"
    manifest = (kit / "MANIFEST").read_text()
    python_version = machine(["get", "python-version"])[0]
    assert f"python wheels for: {python_version}" in manifest, manifest
    with tarfile.open(kit / "source.tar.gz") as archive:
        names = set(archive.getnames())
    for f in ("source/CMakeLists.txt", "source/scripts/gpu-check", "source/scripts/lib/gpu_check.py",
              "source/scripts/lib/gpu-machine.txt", "source/tests/bench/bench_peers.py"):
        assert f in names, f
    debs = [p.name for p in (kit / "debs").glob("*.deb")]
    for package in ("libgrpc++-dev_", "libprotobuf-dev_", "protobuf-compiler-grpc_",
                    "libabsl-dev_", "prometheus-cpp-dev_", "libgtest-dev_", "libgloo-dev_"):
        assert any(d.startswith(package) for d in debs), package
    assert not any(d.startswith(("libc6_", "libstdc++6_")) for d in debs), debs
    # Only what the machine lacks, for its Python; nothing it has (torch, numpy, transformers...).
    wanted = machine(["kit-requirements"])
    assert (kit / "wheels" / "requirements.txt").read_text().split() == wanted
    wheels = sorted(p.name.lower() for p in (kit / "wheels").glob("*.whl"))
    assert len(wheels) == len(wanted), wheels
    tag = "cp" + python_version.replace(".", "")
    for line in wanted:
        name = line.split("==")[0].replace("-", "_")
        wheel = next((w for w in wheels if w.startswith(name + "-")), None)
        assert wheel, (name, wheels)
        assert "py3-none-any" in wheel or tag in wheel, wheel
    has = {line.split()[0].replace("_", "-").lower() for line in (ROOT / "scripts/lib/gpu-machine.txt").read_text()
           .splitlines() if line.strip() and not line.startswith("#")}
    assert not any(w.split("-")[0].replace("_", "-") in has for w in wheels), wheels
    fallback = (kit / "wheels" / "fallback" / "requirements.txt").read_text().split()
    assert fallback == machine(["fallback-requirements"])
    assert len(list((kit / "wheels" / "fallback").glob("*.whl"))) == len(fallback)
    assert os.access(kit / "gpu-check", os.X_OK)


@needs_root
def test_the_dry_run_builds_against_the_machines_torch_offline_in_a_clean_room(cleanroom,
                                                                                 tmp_path):
    rootfs, python = cleanroom
    # The clean room: no -dev package of the build, no route out, the stand-in's torch.
    probe = run([ROOT / "tests" / "gpu" / "cleanroom", "run", "--", "bash", "-c",
                 f"ls /usr/include/grpcpp /usr/include/absl 2>&1; cat /proc/net/route; "
                 f"{python} -c 'import torch; print(torch.__version__)'"], timeout=120)
    assert probe.count("No such file or directory") == 2, probe
    assert len([l for l in probe.splitlines() if "\t" in l]) == 1, probe  # the header alone
    torch_version = machine(["standin-requirements"])[0].split("==")[1]
    assert probe.strip().splitlines()[-1].startswith(torch_version), probe

    work = tmp_path / "work"
    out = run([ROOT / "tests" / "gpu" / "dry-run", work], timeout=3600, cwd=tmp_path)
    report = json.loads((work / "report" / "report.json").read_text())
    assert report["exit_status"] == 0, out[-3000:]
    assert all(p["status"] == "ok" for p in report["phases"]), report["phases"]
    assert report["machine"]["torch"].startswith(torch_version)
    assert {s["suite"] for s in report["suites"]} == {
        "torch linkage", "optimizers", "head service", "C++ client", "wire codec",
        "Python client"}
    for s in report["suites"]:
        assert s["failed"] == 0 and s["passed"] > 0, s
    # The prefix's packages, not the system's (there are none in the room anyway).
    cache = (work / "prefix" / "build" / "CMakeCache.txt").read_text()
    for package in ("gRPC_DIR", "absl_DIR", "prometheus-cpp_DIR"):
        line = next(l for l in cache.splitlines() if l.startswith(package + ":"))
        assert str(work / "prefix" / "deps") in line, line
    # The wire: a step over 1 and 4 streams (the same dX), next to the loopback TCP limit of the
    # same run.
    wire = report["wire"]
    assert wire["echo_exact"] and set(wire["streams"]) == {"1", "4"}, wire
    assert wire["wire_gb_per_s"] > 0 and wire["loopback_tcp_gb_per_s"] > 0, wire
    assert abs(wire["wire_vs_loopback"] * wire["loopback_tcp_gb_per_s"]
               - wire["wire_gb_per_s"]) < 1e-6 * wire["wire_gb_per_s"], wire
    for streams in wire["streams"].values():
        assert streams["gb_per_s"] > 0 and streams["dx_max_rel_diff"] <= 1e-6, wire
        assert abs(streams["vs_loopback"] * wire["loopback_tcp_gb_per_s"]
                   - streams["gb_per_s"]) < 1e-6 * streams["gb_per_s"], wire
    # The service (remotehead-wire-bench on the machine's device): fp32 and bf16 over 1, 2 and 4
    # streams, every C exact, each ratio against the limit measured in the same run, the server's
    # compute threads named among its threads' CPU times.
    service = wire["service"]
    assert service["exact"], service
    assert {(r["dtype"], r["streams"]) for r in service["rows"]} == {
        (d, c) for d in ("float32", "bfloat16") for c in (1, 2, 4)}, service
    for r in service["rows"]:
        limit = service["loopback_tcp_gb_per_s"][str(r["streams"])]
        assert r["gb_per_s"] > 0 and r["dx_vs_one_stream"] == 0, r
        assert abs(r["vs_loopback_c"] * limit - r["gb_per_s"]) < 1e-6 * r["gb_per_s"], r
        assert "rh-compute" in r["server_cpu_seconds"], r
    # The benchmark's contenders that run on the CPU, each with a time, and the ratios.
    assert report["bench"], report
    for shape in report["bench"]:
        assert shape["status"] == "ok", shape
        for peer in ("naive", "remotehead", "remotehead_server"):
            assert shape["rows"][peer].get("seconds", 0) > 0, (peer, shape)
        assert shape["rows"]["remotehead_server"]["d_loss"] < 1e-2, shape
        assert "server_vs_in_process" in shape
    md = (work / "report" / "report.md").read_text()
    assert "| build | ok |" in md and "remotehead_server" in md
    with tarfile.open(work / "report" / "logs.tar.gz") as archive:
        assert "logs/build.log" in archive.getnames()
    assert out.splitlines()[-2].startswith("gpu-check: "), out[-500:]
