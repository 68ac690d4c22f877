"""Smoke test of remotehead-bench: runs it with --json at a tiny shape and checks the report's
structure and what must hold whatever the machine's speed — engine results equal to naive,
transient memory of the chunked variants far below naive's and flat in N, PyTorch's
linear_cross_entropy measured next to them, the phases of a step within that step. No timing
asserts: timing targets are read off a benchmark run, not a unit test."""
import json
import subprocess
import sys

bench = sys.argv[1]
args = [bench, "--json", "--n", "512,2048", "--d", "64", "--v", "4000", "--repeats", "1",
        "--memory_budget_bytes", str(2 << 20)]
report = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)

peaks = {}
for result in report["results"]:
    n = result["n"]
    assert result["gemm_seconds"] > 0, result
    variants = result["variants"]
    naive = variants["naive"]
    assert naive["step_seconds"] > 0 and naive["peak_bytes"] > 0, naive
    # PyTorch's linear_cross_entropy, measured in the same run (a chunked baseline: below naive).
    lce = variants["torch_lce"]
    assert not lce["skipped"] and lce["step_seconds"] > 0, (n, lce)
    assert 0 < lce["peak_bytes"] < naive["peak_bytes"], (n, lce, naive)
    assert lce["ratio_to_naive"] > 0 and result["fused_over_torch_lce"] > 0, result
    # Where the marked fused step's time went: every phase within that step, what no phase
    # covers its time minus theirs (never negative).
    phases = result["fused_phases"]
    assert phases["step"] > 0 and phases["other"] >= 0, phases
    marked = sum(v for k, v in phases.items() if k not in ("step", "other"))
    assert abs(marked + phases["other"] - phases["step"]) <= 1e-9 * max(1.0, phases["step"]), phases
    for name in ("fused", "two_phase"):
        v = variants[name]
        assert v["step_seconds"] > 0, (n, name, v)
        diffs = v["max_abs_diff"]
        assert diffs["loss"] < 1e-5, (n, name, diffs)
        assert diffs["grad_hidden"] < 1e-6, (n, name, diffs)
        assert diffs["grad_weight"] < 1e-6, (n, name, diffs)
        assert 0 < v["peak_bytes"] < 0.25 * naive["peak_bytes"], (n, name, v, naive)
        peaks.setdefault(name, []).append(v["peak_bytes"])
for name, values in peaks.items():
    # 4x the rows: the chunked variants' transient memory must not grow (O(N) bookkeeping aside).
    assert values[-1] <= values[0] + 64 * (2048 - 512), (name, values)
print("remotehead-bench --json: structure, accuracy and memory checks passed")
