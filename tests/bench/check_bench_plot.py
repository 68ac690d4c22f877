"""Smoke test of --plot in remotehead-bench and remotehead-remote-bench at tiny shapes: each
writes a PNG with PyTorch linear_cross_entropy measured in the same run (the engine bench
reports it as a variant, the remote bench's plot prints its rows), and what must
hold whatever the machine's speed does: the chunked baselines' transient memory below naive's,
and the remote steps' trainer-side memory (X and dX) far below it. No timing asserts."""
import json
import pathlib
import re
import subprocess
import sys
import tempfile

bench, remote_bench = sys.argv[1], sys.argv[2]
PNG = b"\x89PNG\r\n\x1a\n"


def lce_rows(output):
    """{"N:D:V": (step_s, peak_MiB)} from plot_bench.py's rows."""
    rows = {}
    section = output.split("# PyTorch linear_cross_entropy (chunked)", 1)[1]
    for line in section.splitlines()[2:]:
        match = re.match(r"\s*(\d+:\d+:\d+)\s+([\d.]+)\s+\S+\s+([\d.]+)", line)
        if not match:
            break
        rows[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    return rows


with tempfile.TemporaryDirectory() as tmp:
    # remotehead-bench: PyTorch's op is a variant of its report (measured once, drawn too).
    png = pathlib.Path(tmp) / "bench.png"
    run = subprocess.run([bench, "--json", "--n", "512,2048", "--d", "64", "--v", "4000",
                          "--repeats", "1", "--plot", str(png)],
                         check=True, capture_output=True, text=True)
    report = json.loads(run.stdout)
    assert "TORCH_LCE" not in run.stderr and "# PyTorch" not in run.stderr, run.stderr
    for result in report["results"]:
        naive, lce = result["variants"]["naive"], result["variants"]["torch_lce"]
        assert lce["step_seconds"] > 0 and 0 < lce["peak_bytes"] < naive["peak_bytes"], result
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000

    # remotehead-remote-bench: the rows measured by the script under the table (stderr: --json).
    png = pathlib.Path(tmp) / "remote.png"
    run = subprocess.run([remote_bench, "--shapes=2048:64:4000", "--repeats=1", "--warmup=0",
                          "--check", "--json", "--plot", str(png)],
                         check=True, capture_output=True, text=True)
    shape = json.loads(run.stdout)["shapes"][0]
    plot = shape["plot"]
    assert plot["naive_seconds"] > 0 and plot["two_phase_remote_seconds"] > 0, plot
    naive = plot["naive_peak_bytes"]
    x_bytes = 2048 * 64 * 4
    for key in ("fused_remote_trainer_peak_bytes", "two_phase_remote_trainer_peak_bytes"):
        # The trainer holds X's rows and dX (a few X-sized buffers), never [N, V].
        assert 0 < plot[key] <= 8 * x_bytes < naive, (key, plot[key], naive)
    assert 0 < plot["fused_in_process_peak_bytes"] < naive, plot
    seconds, peak_mib = lce_rows(run.stderr)["2048:64:4000"]
    assert 0 < peak_mib < naive / 2**20, (peak_mib, naive)
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000
print("--plot: both benchmarks drew their pictures with PyTorch linear_cross_entropy measured")
