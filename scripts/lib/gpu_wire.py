"""gpu-check's wire phase (scripts/lib/gpu_check.py), both of its measurements in one run:

- the striped probe of remotehead-remote-bench: a step's X up and dX down over 1 and 4 streams
  (StepHeader.stripe) on a one-token head at a shape whose bytes dominate, X and dX alone, next
  to the loopback TCP limit of one connection (its server computes on the CPU);
- remotehead-wire-bench with the machine's device as the server's (a CUDA head on a GPU): X of
  128 MiB (4 MiB in the CPU dry run), fp32 and bf16, C = 1, 2, 4, on gRPC's HTTP/2 settings and
  on the largest: the service's bytes per second against the loopback limit of 1 and C
  connections, each server thread's CPU seconds per call, and every C exact (--check: one
  stream's bits, the in-process engine's dX).
"""

from __future__ import annotations

import json
import subprocess
import time

WIRE_SHAPE = {"cuda": "8192:4096:64", "cpu": "1024:256:64"}
SERVICE_X_BYTES = {"cuda": 128 << 20, "cpu": 4 << 20}
# gRPC's HTTP/2 settings and the largest frames, window and write buffer (FRAME:WINDOW:WRITE):
# on 2 cores they made no difference (docs/benchmarks.md); the GPU machine's 16 say whether they do.
HTTP2_SWEEP = ("default", "16777215:16777216:16777216")


def run_json(argv, out, log, env, timeout):
    """Runs argv with stdout to `out` (JSON) and stderr to `log`; its exit code (None: cut)."""
    with open(out, "w") as f, open(log, "w") as err:
        try:
            return subprocess.run(argv, stdout=f, stderr=err, env=env, timeout=max(timeout, 1),
                                  start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            return None


def striped_probe(check, timeout):
    """The remote bench's probe: (status, detail, the report's wire entry)."""
    exe = check.build / "tests" / "bench" / "remotehead-remote-bench"
    out = check.prefix / "wire.json"
    code = run_json([exe, "--json", f"--shapes={WIRE_SHAPE[check.limit_set()]}", "--repeats=3",
                     "--warmup=1", "--loopback_bytes=1073741824", "--streams=1,4"],
                    out, check.logs / "wire.log", check.env, timeout)
    if code is None:
        return "cut", "", None
    if code != 0:
        return "failed", f"exited {code}; see wire.log", None
    data = json.loads(out.read_text())
    shape = data["shapes"][0]
    striped = {str(x["streams"]): x for x in shape.get("striped_wire", [])}
    w = {"shape": WIRE_SHAPE[check.limit_set()],
         "wire_gb_per_s": shape["wire_goodput_gb_per_s"],
         "step_gb_per_s": shape["remote_goodput_gb_per_s"],
         "loopback_tcp_gb_per_s": data["loopback_tcp_gb_per_s"],
         "wire_vs_loopback": shape["wire_vs_loopback"], "echo_exact": shape["echo_exact"],
         # The step's own path over C streams (StepHeader.stripe), X up and dX down.
         "streams": {c: {"gb_per_s": x["gb_per_s"], "vs_loopback": x["vs_loopback"],
                         "dx_max_rel_diff": x["dx_max_rel_diff"]}
                     for c, x in striped.items()}}
    exact = w["echo_exact"] and set(w["streams"]) == {"1", "4"} and all(
        x["dx_max_rel_diff"] <= 1e-6 for x in w["streams"].values())
    by_streams = "; ".join(f"{c} stream{'s' * (c != '1')} {x['gb_per_s']:.2f} GB/s = "
                           f"{x['vs_loopback']:.2f}" for c, x in w["streams"].items())
    return ("ok" if exact else "failed"), (
        f"{by_streams} of the loopback TCP limit ({w['loopback_tcp_gb_per_s']:.2f} GB/s); "
        f"X and dX alone {w['wire_gb_per_s']:.2f} GB/s"), w


def service(check, timeout):
    """remotehead-wire-bench on the machine's device: (status, detail, its summary)."""
    exe = check.build / "tests" / "bench" / "remotehead-wire-bench"
    out = check.prefix / "wire-service.json"
    code = run_json([exe, "--json", "--check", f"--device={check.device}",
                     f"--x_bytes={SERVICE_X_BYTES[check.limit_set()]}", "--streams=1,2,4",
                     "--repeats=3", "--warmup=1", f"--http2_settings={','.join(HTTP2_SWEEP)}"],
                    out, check.logs / "wire-service.log", check.env, timeout)
    if code is None:
        return "cut", "", None
    if code not in (0, 1):  # 1: --check found a C that is not exact (the JSON says which)
        return "failed", f"remotehead-wire-bench exited {code}; see wire-service.log", None
    data = json.loads(out.read_text())
    s = {"loopback_tcp_gb_per_s": data["loopback_tcp_gb_per_s"],
         "in_process_seconds": data["in_process_seconds"], "exact": data["exact"],
         "rows": [{k: r[k] for k in ("http2", "dtype", "streams", "seconds", "gb_per_s", "vs_loopback_1",
                                     "vs_loopback_c", "dx_vs_one_stream", "server_cpu_seconds",
                                     "server_minor_faults", "client_minor_faults") if k in r}
                  for r in data["rows"]]}
    best = max(s["rows"], key=lambda r: r["gb_per_s"])
    return ("ok" if s["exact"] else "failed"), (
        f"the service {best['gb_per_s']:.2f} GB/s = {best['vs_loopback_1']:.2f} of one "
        f"connection's limit at best ({best['dtype']}, C = {best['streams']}); every C exact: "
        f"{'yes' if s['exact'] else 'NO'}"), s


def wire_phase(check, limit):
    """Both measurements within `limit` seconds; the phase's (status, detail)."""
    began = time.monotonic()
    status, detail, w = striped_probe(check, limit)
    if w is None:
        return status, detail
    check.report["wire"] = w
    s_status, s_detail, w["service"] = service(check, limit - (time.monotonic() - began))
    worst = next(x for x in ("cut", "failed", "ok") if x in (status, s_status))
    return worst, f"{detail}; {s_detail}"
