"""scripts/gpu-check: the one command of a GPU run, from a GPU kit (scripts/gpu-kit).

Phases, each under its own time limit (and all under --budget): what the machine is; the kit
installed into a prefix (no registry, no root changes); the CMake configuration against the
prefix's packages and this Python's torch, for the GPU's own architecture only; the build (all
cores); the CUDA twin suites and the NCCL group of one; the wire against the loopback TCP
limit (gpu_wire.py: the striped probe, and remotehead-wire-bench with a head on this machine's
device); scripts/bench-gpu's contenders at Cut
Cross-Entropy's and Liger-Kernel's shapes. `--device cpu` is the dry run: the same phases on the
CPU twins and small shapes (tests/system/test_gpu_kit.py runs it offline in a clean root).

Writes DIR/report.md (the tables), DIR/report.json (the same as data) and DIR/logs.tar.gz (every
phase's log). The exit status is a bit set: 1 install, configure or build failed; 2 a test
failed; 4 the wire or the benchmark failed; 8 a phase was cut by its time limit (0: everything ran and
passed). Standard library only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time

import gpu_wire
from gpu_report import markdown, rows_from_log, summarise_shape, why

ROOT = pathlib.Path(__file__).resolve().parents[2]
INSTALL, TESTS, BENCH, CUT = 1, 2, 4, 8

# Seconds per phase on the GPU machine (16 cores; the whole check within 9 minutes: the budget
# caps every phase, so what the build leaves goes to the benchmark, which comes last) and in the
# CPU dry run (2 cores, no compiler cache: the build is most of it).
LIMITS = {
    "cuda": dict(machine=20, install=40, configure=60, build=240, tests=160, wire=90, bench=400),
    "cpu": dict(machine=60, install=120, configure=180, build=1800, tests=600, wire=120,
                bench=300),
}
BUDGET = {"cuda": 540, "cpu": 3000}

# The suites a GPU run checks: (name, binary, gtest filter on CUDA, gtest filter in the dry
# run, shards on CUDA, shards in the dry run (of which the first runs: a small, fixed sample)).
# The CUDA filters select each suite's CUDA twin (tests/support/devices.h names the device last).
# The suites in ALONE read the device's free memory (cudaMemGetInfo: the auto budget), which
# other processes' allocations move: they run after the others, one at a time.
SUITES = [
    ("engine parity", "engine_parity_test", "*_cuda", "*_cpu", 8, (15, 1)),
    # The budget's cases measure their own process's allocator: sharded beside the others (the
    # first GPU run gave them one process after the others and cut them at 4 s a case).
    ("memory budget", "memory_budget_test", "*_cuda", "*_cpu", 4, (5, 1)),
    ("memory statistics", "memory_budget_test", "MemoryStats.*Cuda*", "MemoryStats.*", 1, (1, 1)),
    # The engine's defaults on the device (budget, chunk and block rows): no data, a plan.
    ("default plan", "memory_budget_test", "*DefaultPlan*/cuda", "*DefaultPlan*/cpu", 1, (1, 1)),
    ("head service", "head_service_test", "*/cuda", "*/cpu", 1, (1, 1)),
    ("server binary", "server_binary_test", "*/cuda:*Cuda*", "*/cpu", 1, (1, 1)),
    ("generation", "generation_test", "*", "*", 1, (1, 1)),
    # fp32 logits of a bf16 head: cuBLAS's fp32-output GEMM, the fp32 backward.
    ("fp32 logits", "fp32_logits_test", "*_cuda", "*_cpu", 1, (1, 1)),
    ("NCCL group of one", "process_group_test", "CudaProcessGroup.*", "CudaProcessGroup.*", 1,
     (1, 1)),
    # A server's rows in and dX out on the device's copy streams (core/device_transfer.h).
    ("device transfer", "device_transfer_test", "*OnCuda*", "*OnCpu*", 1, (1, 1)),
    # Where the binary's C++ runtime comes from (a LibTorch that exports std:: symbols).
    ("torch linkage", "torch_linkage_test", "*", "*", 1, (1, 1)),
    # The fused block's CUDA kernels: the engine with --fused_blocks against the reference, and
    # the kernels against their CPU twin (loss 1e-6 relative, dz within one ulp).
    ("fused block", "fused_block_test", "*_cuda*", "*_cpu*", 2, (3, 1)),
]
ALONE = {"memory statistics", "server binary"}
# compute-sanitizer's tools over the fused kernels at a small shape (FusedBlockOnCuda: one block
# of several tiles per dtype): (suite name, tool). CUDA only, after the other suites, one at a
# time; a machine without compute-sanitizer reports them failed, naming it.
SANITIZED = ("fused_block_test", "FusedBlockOnCuda.*")
SANITIZER_TOOLS = [("fused block memcheck", "memcheck"), ("fused block racecheck", "racecheck")]
# CPU suites the dry run adds (the torch range's proof that every layer builds and runs against
# the machine's torch): the C++ client against the server, the wire codec with protobuf and
# LibTorch in one process, the checkpoint directory's file operations (std::filesystem), the
# optimizers against torch::optim.
CPU_ONLY_SUITES = [("C++ client", "client_test", "*", 1, (1, 1)),
                   ("wire codec", "tensor_codec_test", "*", 1, (1, 1)),
                   ("checkpoint directory", "checkpoint_dir_test", "*", 1, (1, 1)),
                   ("optimizers", "optimizer_test", "*", 1, (1, 1))]
# The dry run's suites (`--device cpu` without --suites): one per layer — core (the optimizers
# against torch::optim, and where the binary's C++ runtime comes from), the server (the head
# service in process), the C++ client against the server, the wire codec, the Python client
# against the server binary — which proves that every layer builds and runs against the machine's
# torch. The CUDA suites' CPU halves are left out there: CTest runs every one of them against the
# project's own torch, and building them again took the dry run's clean room about half its time.
# `--suites all` runs every suite.
DRY_RUN_SUITES = ("torch linkage", "optimizers", "head service", "C++ client", "wire codec",
                  "Python client")
# The Python client against the server just built (CPU heads: the client's side is what differs
# with the machine's torch and grpcio; striping's threads and channels included), run by pytest
# with a JUnit report.
PYTHON_SUITES = ["tests/python/test_client.py", "tests/python/test_two_phase_and_grpo.py",
                 "tests/python/test_generation_wire.py", "tests/python/test_striping.py"]
BENCH_SHAPES = {"cuda": ["cce", "liger"], "cpu": ["256:64:2048:float32", "128:32:1000:bfloat16:30"]}
BENCH_STEPS = {"cuda": ("1", "3"), "cpu": ("1", "2")}



@dataclasses.dataclass
class Phase:
    name: str
    status: str = "not run"  # ok, failed, cut (time limit), skipped, not run
    seconds: float = 0.0
    limit: float = 0.0
    detail: str = ""


class Check:
    def __init__(self, args):
        self.args = args
        self.device = args.device
        self.out = pathlib.Path(args.out).resolve()
        self.prefix = pathlib.Path(args.prefix).resolve()
        self.logs = self.prefix / "logs"
        self.build = self.prefix / "build"
        self.start = time.monotonic()
        self.phases: dict[str, Phase] = {}
        self.report: dict = {"device": self.device, "phases": [], "machine": {}, "suites": [],
                             "bench": [], "source": str(ROOT)}
        self.env = dict(os.environ)

    # --- running things -------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def limit(self, name: str) -> float:
        return max(0.0, min(LIMITS[self.limit_set()][name], self.left()))

    def limit_set(self) -> str:
        return "cuda" if self.device == "cuda" else "cpu"

    def run(self, argv, log: str, timeout: float, env=None, cwd=None) -> tuple[int | None, str]:
        """Runs argv with its output in logs/LOG; (exit code or None when cut, output)."""
        path = self.logs / log
        with open(path, "a") as f:
            f.write(f"$ {' '.join(shlex.quote(str(a)) for a in argv)}\n")
            f.flush()
            try:
                p = subprocess.run([str(a) for a in argv], stdout=f, stderr=subprocess.STDOUT,
                                   timeout=max(timeout, 1), env=env or self.env, cwd=cwd,
                                   start_new_session=True)
                code = p.returncode
            except subprocess.TimeoutExpired:
                code = None
                f.write(f"\n[gpu-check: cut after {timeout:.0f} s]\n")
        return code, path.read_text(errors="replace")

    def phase(self, name: str, fn) -> Phase:
        ph = Phase(name, limit=self.limit(name))
        self.phases[name] = ph
        print(f"gpu-check: {name} (limit {ph.limit:.0f} s)", flush=True)
        began = time.monotonic()
        if ph.limit <= 1:
            ph.status, ph.detail = "cut", "no time left in the budget"
        else:
            try:
                ph.status, ph.detail = fn(ph.limit)
            except Exception as e:  # a phase's own failure is reported, the others still run
                ph.status, ph.detail = "failed", f"{type(e).__name__}: {e}"
        ph.seconds = time.monotonic() - began
        print(f"gpu-check: {name}: {ph.status} in {ph.seconds:.0f} s"
              f"{' — ' + ph.detail if ph.detail else ''}", flush=True)
        return ph

    def py(self, code: str) -> str:
        return subprocess.run([self.args.python, "-c", code], capture_output=True, text=True,
                              env=self.env, timeout=120).stdout.strip()

    # --- phases ----------------------------------------------------------------------------
    def machine(self, limit):
        m = self.report["machine"]
        info = json.loads(self.py(
            "import json, sys, torch\n"
            "c = torch.cuda.is_available()\n"
            "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__,\n"
            " 'torch_cuda': torch.version.cuda, 'cuda_available': c,\n"
            " 'gpu': torch.cuda.get_device_name(0) if c else None,\n"
            " 'capability': '%d.%d' % torch.cuda.get_device_capability(0) if c else None}))")
            or "{}")
        m.update(info)
        m["cores"] = os.cpu_count()
        m["platform"] = platform.platform()
        m["driver"] = None
        if info.get("cuda_available"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True)
            m["driver"] = smi.stdout.strip() or None
        m["packages"] = json.loads(self.py(
            "import json, importlib.metadata as md\n"
            "names = ['torch', 'triton', 'numpy', 'grpcio', 'protobuf', 'transformers', "
            "'accelerate', 'safetensors', 'pytest', 'setuptools', 'liger-kernel', "
            "'cut-cross-entropy', 'grpcio-tools']\n"
            "out = {}\n"
            "for n in names:\n"
            "    try: out[n] = md.version(n)\n"
            "    except md.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))") or "{}")
        for tool in ("cmake", "ninja", "g++", "nvcc"):
            v = subprocess.run(f"{tool} --version 2>/dev/null | grep -m1 -iE 'version|release|g\\+\\+|^[0-9]'",
                               shell=True, capture_output=True, text=True).stdout.strip()
            m[tool] = v or None
        if self.device == "cuda" and not info.get("cuda_available"):
            return "failed", "--device cuda: torch sees no CUDA device"
        return "ok", f"{info.get('gpu') or 'CPU'}, torch {info.get('torch')}"

    def install(self, limit):
        kit = pathlib.Path(self.args.kit).resolve()
        script = (f"source {shlex.quote(str(ROOT / 'scripts/lib/kit-install.sh'))} && "
                  f"kit_install {shlex.quote(str(kit))} {shlex.quote(str(self.prefix))} "
                  f"{shlex.quote(self.args.python)}")
        code, _ = self.run(["bash", "-c", script], "install.log", limit)
        if code is None:
            return "cut", ""
        if code != 0:
            return "failed", "see install.log"
        # The prefix's environment as kit_install wrote it (env.sh: its one home), and the
        # Python client of this source.
        dumped = subprocess.run(["bash", "-c", f"source {shlex.quote(str(self.prefix / 'env.sh'))}"
                                 " && env -0"], env=self.env, capture_output=True, check=True)
        self.env = dict(kv.split("=", 1) for kv in dumped.stdout.decode().split("\0") if "=" in kv)
        self.env["PYTHONPATH"] = f"{ROOT / 'client' / 'python'}:{self.env['PYTHONPATH']}"
        n = len(list((kit / "debs").glob("*.deb")))
        w = len(list((kit / "wheels").glob("*.whl")))
        return "ok", f"{n} packages, {w} wheels into {self.prefix}"

    def configure(self, limit):
        args = []
        if self.device == "cuda":
            arch = self.report["machine"].get("capability") or "9.0"
            args.append(f"-DTORCH_CUDA_ARCH_LIST={arch}")  # the GPU's own architecture only
            # The machine's compiler is not the one the project is checked with: its new
            # warnings are counted in the report, not fatal to the whole run.
            args.append("-DREMOTEHEAD_WERROR=OFF")
        else:
            # The CPU dry run proves that every layer builds, links and runs against the
            # machine's torch, which the optimisation level does not change: -O1 compiles about
            # a fifth faster than the project's -O3 (the head service's source: 12.8 s, 15.5 s).
            args.append("-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG")
        script = (f"source {shlex.quote(str(ROOT / 'scripts/lib/kit-install.sh'))} && "
                  f"kit_configure {shlex.quote(str(ROOT))} {shlex.quote(str(self.build))} "
                  f"{shlex.quote(str(self.prefix))} {shlex.quote(self.args.python)} "
                  + " ".join(shlex.quote(a) for a in args))
        code, _ = self.run(["bash", "-c", script], "configure.log", limit)
        if code is None:
            return "cut", ""
        if code != 0:
            log = (self.prefix / "configure.log").read_text(errors="replace")
            (self.logs / "configure.log").write_text(log)
            return "failed", "see configure.log"
        return "ok", " ".join(args)

    def suites(self, table):
        """The rows of a suite table that --suites selects (all of them by default)."""
        wanted = [w for w in self.args.suites.split(",") if w]
        if not wanted and self.device == "cpu":
            wanted = list(DRY_RUN_SUITES)
        if wanted == ["all"]:
            wanted = []
        return [row for row in table if not wanted or any(w in row[0] for w in wanted)]

    def targets(self) -> list[str]:
        t = ["remotehead_server_bin", "remotehead_python_stubs"]
        if "tests" in self.args.only:
            t += [s[1] for s in self.suites(SUITES)]
            if self.device == "cpu":
                t += [s[1] for s in self.suites(CPU_ONLY_SUITES)]
        if "wire" in self.args.only:
            t += ["remotehead_remote_bench", "remotehead_wire_bench"]
        if "bench" in self.args.only:
            t += ["remotehead_bench"]
        return t

    def build_phase(self, limit):
        argv = ["cmake", "--build", self.build, "-j", str(self.args.jobs)]
        for t in self.targets():
            argv += ["--target", t]
        code, log = self.run(argv, "build.log", limit)
        steps = re.findall(r"^\[(\d+)/(\d+)\]", log, re.M)
        done = f"{steps[-1][0]}/{steps[-1][1]} steps" if steps else ""
        if code is None:
            return "cut", done
        warnings = len(re.findall(r": warning: ", log))
        self.report["build_warnings"] = warnings
        done += f", {warnings} warnings"
        if code != 0:
            return "failed", f"{done}; see build.log"
        return self.stubs_load(done)

    def stubs_load(self, done):
        """The stubs the kit's generator wrote, loaded by this Python's protobuf; if they are
        not, the kit's pinned fallback runtime (wheels/fallback) goes first on the path."""
        probe = [self.args.python, "-c", "import remotehead.v1.head_service_pb2_grpc"]
        if subprocess.run(probe, env=self.env, capture_output=True).returncode == 0:
            self.report["stubs_runtime"] = "the machine's own protobuf"
            return "ok", done
        fallback = pathlib.Path(self.args.kit).resolve() / "wheels" / "fallback"
        target = self.prefix / "python-fallback"
        reqs = fallback / "requirements.txt"
        if reqs.is_file():
            code, _ = self.run([self.args.python, "-m", "pip", "install", "-q", "--no-index",
                                "--no-deps", "--target", target, "--find-links", fallback,
                                "-r", reqs], "install.log", 120)
            self.env["PYTHONPATH"] = f"{target}:{self.env['PYTHONPATH']}"
            if code == 0 and subprocess.run(probe, env=self.env).returncode == 0:
                self.report["stubs_runtime"] = "the kit's fallback: " + ", ".join(
                    l for l in reqs.read_text().split() if l)
                return "ok", done + "; stubs load with the kit's fallback protobuf"
        return "failed", done + "; the generated stubs do not load (see install.log)"

    def tests(self, limit):
        cuda = self.device == "cuda"
        jobs = []
        for name, binary, fcuda, fcpu, shards_cuda, (shards_cpu, run_cpu) in self.suites(SUITES):
            if cuda:
                jobs += [(name, binary, fcuda, shards_cuda, i) for i in range(shards_cuda)]
            else:
                jobs += [(name, binary, fcpu, shards_cpu, i) for i in range(run_cpu)]
        if not cuda:
            for name, binary, f, shards, (total, run_n) in self.suites(CPU_ONLY_SUITES):
                jobs += [(name, binary, f, total, i) for i in range(run_n)]
        elif self.suites([("fused block",)]):
            jobs += [(name, SANITIZED[0], SANITIZED[1], 1, 0, tool) for name, tool in
                     SANITIZER_TOOLS]
        deadline = time.monotonic() + limit
        results: dict[str, dict] = {}
        for name, *_ in jobs:
            results.setdefault(name, dict(suite=name, passed=0, failed=0, skipped=0,
                                          status="ok", failures=[], shards=0))
        env = dict(self.env, OMP_WAIT_POLICY="PASSIVE")

        def one(job):
            name, binary, gfilter, total, index, *tool = job
            exe = self.build / "tests" / binary
            label = re.sub(r"\W+", "_", name)  # two suites may run one binary at once
            report = self.prefix / f"gtest-{binary}-{label}-{index}.json"
            if not exe.exists():
                return name, None, "not built"
            wrapper = []
            if tool:
                sanitizer = shutil.which("compute-sanitizer", path=os.pathsep.join(
                    [os.environ.get("PATH", ""), "/usr/local/cuda/bin"]))
                if sanitizer is None:
                    return name, None, "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
                wrapper = [sanitizer, "--tool", tool[0], "--error-exitcode=1"]
            e = dict(env, GTEST_TOTAL_SHARDS=str(total), GTEST_SHARD_INDEX=str(index))
            code, _ = self.run([*wrapper, exe, f"--gtest_filter={gfilter}",
                                f"--gtest_output=json:{report}"],
                               f"test-{binary}-{label}-{index}.log", deadline - time.monotonic(),
                               env=e)
            if code is None:
                return name, None, "cut"
            if not report.exists():
                return name, None, f"exited {code} without a report"
            if tool and code != 0:  # the sanitizer's finding, whatever the cases said
                return name, None, f"{tool[0]} reported errors (exit {code})"
            return name, json.loads(report.read_text()), None

        def python_suites():
            report = self.prefix / "pytest.xml"
            e = dict(env, REMOTEHEAD_SERVER_BINARY=str(self.build / "server" / "remotehead-server"))
            code, log = self.run([self.args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  f"--junitxml={report}", *PYTHON_SUITES], "test-python.log",
                                 deadline - time.monotonic(), env=e, cwd=ROOT)
            r = dict(suite="Python client", passed=0, failed=0, skipped=0, status="ok",
                     failures=[], shards=1)
            if code is None or not report.exists():
                r["status"] = "cut" if code is None else "failed"
                r["failures"].append("cut" if code is None else f"exited {code} without a report")
                return r
            import xml.etree.ElementTree as ET
            for case in ET.parse(report).getroot().iter("testcase"):
                failure = case.find("failure")
                if failure is None:
                    failure = case.find("error")
                if failure is not None:
                    r["failed"] += 1
                    r["failures"].append(f"{case.get('classname')}.{case.get('name')}"
                                         + why(failure.get("message", "")))
                elif case.find("skipped") is not None:
                    r["skipped"] += 1
                else:
                    r["passed"] += 1
            r["status"] = "failed" if r["failed"] or code not in (0,) else "ok"
            return r

        def record(name, data, problem):
            r = results[name]
            r["shards"] += 1
            if problem:
                r["status"] = "cut" if problem == "cut" else "failed"
                r["failures"].append(problem)
                return
            for suite in data.get("testsuites", []):
                for t in suite.get("testsuite", []):
                    full = f"{suite['name']}.{t['name']}"
                    if t.get("failures"):
                        r["failed"] += 1
                        r["failures"].append(full + why(t["failures"][0].get("failure", "")))
                    elif t.get("result") == "SKIPPED":
                        r["skipped"] += 1
                    else:
                        r["passed"] += 1
            if r["failed"]:
                r["status"] = "failed"

        workers = max(1, min(self.args.jobs, 8) if cuda else self.args.jobs)
        alone = ALONE | {name for name, _ in SANITIZER_TOOLS}
        together = [j for j in jobs if not (cuda and j[0] in alone)]
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            python_job = pool.submit(python_suites) if self.suites([("Python client",)]) else None
            for result in pool.map(one, together):
                record(*result)
        for job in jobs:
            if job not in together:
                record(*one(job))
        self.report["suites"] = list(results.values()) + ([python_job.result()] if python_job
                                                          else [])
        results = {r["suite"]: r for r in self.report["suites"]}
        passed = sum(r["passed"] for r in results.values())
        failed = sum(r["failed"] for r in results.values())
        skipped = sum(r["skipped"] for r in results.values())
        detail = f"{passed} passed, {failed} failed, {skipped} skipped"
        if any(r["status"] == "cut" for r in results.values()):
            return "cut", detail
        if failed or any(r["status"] == "failed" for r in results.values()):
            return "failed", detail
        if passed == 0:
            return "failed", detail + ": nothing ran"
        return "ok", detail

    def wire(self, limit):
        return gpu_wire.wire_phase(self, limit)

    def bench(self, limit):
        deadline = time.monotonic() + limit
        shapes = BENCH_SHAPES[self.limit_set()]
        warmup, repeats = BENCH_STEPS[self.limit_set()]
        status, details = "ok", []
        for i, shape in enumerate(shapes):
            # Each shape its own share of what is left, so a slow first one leaves the second time.
            share = (deadline - time.monotonic()) / (len(shapes) - i)
            out = self.prefix / f"bench-{i}.json"
            code, log = self.run(
                [self.args.python, ROOT / "tests" / "bench" / "bench_peers.py", "--build",
                 self.build, "--device", "cuda:0" if self.device == "cuda" else "cpu",
                 "--shapes", shape, "--warmup", warmup, "--repeats", repeats, "--json", out,
                 *(["--peers", self.args.peers] if self.args.peers else [])],
                f"bench-{i}.log", share)
            if code == 0 and out.exists():
                data = json.loads(out.read_text())
                for s in data.get("shapes", []):
                    self.report["bench"].append(summarise_shape(s))
                details.append(f"{shape}: ok")
            else:
                status = "cut" if code is None else "failed"
                self.report["bench"].append({"shape": shape, "status": status,
                                             "rows": rows_from_log(log)})
                details.append(f"{shape}: {status}")
        return status, "; ".join(details)

    # --- the whole check ---------------------------------------------------------------------
    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        for f in self.logs.glob("*.log"):
            f.unlink()
        self.phase("machine", self.machine)
        if self.phase("install", self.install).status == "ok":
            if self.phase("configure", self.configure).status == "ok":
                self.phase("build", self.build_phase)
        built = self.phases.get("build") and self.phases["build"].status in ("ok", "cut")
        if built and "tests" in self.args.only:
            self.phase("tests", self.tests)
        if built and self.phases["build"].status == "ok":
            for name, fn in (("wire", self.wire), ("bench", self.bench)):
                if name in self.args.only:
                    self.phase(name, fn)
        return self.write()

    def write(self) -> int:
        for name in ("machine", "install", "configure", "build", "tests", "wire", "bench"):
            ph = self.phases.get(name) or (
                Phase(name, status="skipped", detail="not asked for (--only)")
                if name not in self.args.only else
                Phase(name, status="not run", detail="an earlier phase failed"))
            self.report["phases"].append(dataclasses.asdict(ph))
        self.report["seconds"] = time.monotonic() - self.start
        status = 0
        for ph in self.report["phases"]:
            if ph["status"] == "cut":
                status |= CUT
            elif ph["status"] in ("failed", "not run"):
                status |= {"tests": TESTS, "wire": BENCH, "bench": BENCH}.get(ph["name"], INSTALL)
        self.report["exit_status"] = status
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2))
        (self.out / "report.md").write_text(markdown(self.report))
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")
            if (self.prefix / "configure.log").exists():
                tar.add(self.prefix / "configure.log", arcname="logs/cmake-configure.log")
        print(markdown(self.report))
        counts = [sum(s[k] for s in self.report["suites"]) for k in ("passed", "failed",
                                                                     "skipped")]
        print(f"gpu-check: {counts[0]} passed, {counts[1]} failed, {counts[2]} skipped")
        print(f"gpu-check: report in {self.out} (report.md, report.json, logs.tar.gz); "
              f"exit status {status}")
        return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-check-report", help="where the report goes")
    p.add_argument("--kit", default=os.environ.get("REMOTEHEAD_GPU_KIT", ""),
                   help="the unpacked kit (default: the kit this source came from)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--python", default=sys.executable,
                   help="the Python whose torch the build links (default: this one)")
    p.add_argument("--prefix", default="", help="where the kit is installed and built "
                   "(default: /tmp/remotehead-gpu-check)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole check (default: 540 on CUDA, 3000 on the CPU)")
    # A second, shorter call on a machine (what the first one found, rerun): fewer phases,
    # suites and contenders, and the build of only what they need.
    p.add_argument("--only", default="tests,wire,bench",
                   help="the phases after the build to run (comma-separated; default: all)")
    p.add_argument("--suites", default="",
                   help="the suites to run: names or parts of names, comma-separated, or "
                        "'all' (default: all on CUDA, DRY_RUN_SUITES on the CPU), e.g. "
                        "'memory budget,torch linkage'")
    p.add_argument("--peers", default="",
                   help="the benchmark's contenders, in this order (default: bench_peers.py's)")
    args = p.parse_args(argv)
    args.only = [o for o in args.only.split(",") if o]
    for o in args.only:
        if o not in ("tests", "wire", "bench"):
            raise SystemExit(f"gpu-check: --only: expected tests, wire or bench; got {o!r}")
    if not args.kit:
        raise SystemExit("gpu-check: --kit: expected the kit's directory (scripts/gpu-kit OUT)")
    if not (pathlib.Path(args.kit) / "debs").is_dir():
        raise SystemExit(f"gpu-check: --kit: expected a kit (a debs/ folder); got {args.kit}")
    if args.device == "auto":
        probe = subprocess.run([args.python, "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True)
        args.device = "cuda" if probe.stdout.strip() == "True" else "cpu"
    args.prefix = args.prefix or "/tmp/remotehead-gpu-check"
    args.budget = args.budget or BUDGET["cuda" if args.device == "cuda" else "cpu"]
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
