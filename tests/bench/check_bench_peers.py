"""Smoke test of scripts/bench-gpu on the CPU at a tiny shape with a softcap: every contender
that runs on the CPU is measured, in the same run, and its loss and dX agree with the fp32
reference; the CUDA-only ones (Liger-Kernel, Cut Cross-Entropy) are skipped with the reason;
PyTorch's linear_cross_entropy, which has no softcap, is said to run without it. No timing
asserts."""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

root, build = pathlib.Path(sys.argv[1]), sys.argv[2]
with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "peers.json"
    done = subprocess.run(
        [str(root / "scripts" / "bench-gpu"), "--device", "cpu", "--shapes",
         "256:64:1000:float32:30", "--warmup", "0", "--repeats", "1", "--json", str(out)],
        env={**os.environ, "REMOTEHEAD_BUILD_DIR": build}, capture_output=True, text=True,
        timeout=600)
    print(done.stdout)
    print(done.stderr, file=sys.stderr)
    assert done.returncode == 0, done.returncode
    report = json.loads(out.read_text())

assert report["device"] == "cpu" and report["gpu"] == "CPU", report
(shape,) = report["shapes"]
assert shape["shape"]["softcap"] == 30.0
results = shape["results"]
for name in ("naive", "torch_lce", "remotehead", "remotehead_server"):
    r = results[name]
    assert "skipped" not in r, (name, r)
    assert r["seconds"] > 0 and r["peak_bytes"] > 0, (name, r)
    assert r["peak_with_grads_bytes"] >= r["peak_bytes"], (name, r)
for name in ("liger", "cce"):
    reason = results[name]["skipped"]
    assert "CUDA only" in reason or "not installed" in reason, (name, reason)
# Accuracy against the fp32 reference (every contender computes in fp32 here).
for name in ("naive", "torch_lce", "remotehead_server"):
    assert results[name]["d_loss"] < 1e-5 and results[name]["d_hidden"] < 1e-6, (name, results)
assert results["naive"]["softcap"] == 30.0 and results["remotehead_server"]["softcap"] == 30.0
assert results["torch_lce"]["softcap"] == 0.0
assert "no softcap support" in done.stdout
# remotehead's dX and fp32 dW are preallocated: "+grads" adds them (256·64·4 + 1000·64·4).
ours = results["remotehead"]
assert ours["peak_with_grads_bytes"] - ours["peak_bytes"] == 256 * 64 * 4 + 1000 * 64 * 4, ours
assert "server on loopback / in-process:" in done.stdout
# The fused blocks' CPU twin beside today's engine; the memory mode is a half-precision head's.
assert "skipped" not in results["remotehead_fused"] and \
    results["remotehead_fused"]["peak_with_grads_bytes"] == \
    results["remotehead_fused"]["peak_bytes"] + 256 * 64 * 4 + 1000 * 64 * 4, results
assert "half-precision" in results["remotehead_memory"]["skipped"], results
# …which a bf16 shape runs: its "+grads" counts a bf16 dW (256·64·2 + 1000·64·2).
with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "memory.json"
    done = subprocess.run(
        [str(root / "scripts" / "bench-gpu"), "--device", "cpu", "--shapes",
         "256:64:1000:bfloat16", "--peers", "remotehead_memory", "--warmup", "0", "--repeats",
         "1", "--json", str(out)],
        env={**os.environ, "REMOTEHEAD_BUILD_DIR": build}, capture_output=True, text=True,
        timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    memory = json.loads(out.read_text())["shapes"][0]["results"]["remotehead_memory"]
assert memory["peak_with_grads_bytes"] - memory["peak_bytes"] == 256 * 64 * 2 + 1000 * 64 * 2, \
    memory
print("bench-gpu smoke: ok")
