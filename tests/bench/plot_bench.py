"""PyTorch's linear_cross_entropy and --plot for remotehead-bench and remotehead-remote-bench.
Measures PyTorch's own chunked torch.nn.functional.linear_cross_entropy
(LinearCrossEntropyOptions()) at the shapes of a benchmark's report (its JSON, --report) in the
same run — a Python-only baseline, so it is measured here — and draws the report as step time
and peak memory against N. The measurement follows the bench's conventions:

  inputs   X [N, D] and W [V, D] in the bench's dtype on its device, targets with the same share
           of ignored tokens (-100), the same reduction (and bias);
  time     the median over the bench's --repeats after its --warmup untimed steps, with X.grad
           and W.grad reset before each step (backward allocates dX and dW, as naive's do);
  peak     the transient bytes of the last step: the peak of bytes held by tensors during it
           minus those held before it — CUDA from the caching allocator's statistics, CPU from
           the profiler's record of every allocation and free (profile_memory), the same count
           the benches' own CPU allocator keeps.

  python plot_bench.py --report report.json --measure      # one line: TORCH_LCE {json}
  python plot_bench.py --report report.json --out bench.png

--measure prints the measurements for the bench to report (remotehead-bench puts them in its
table and JSON as the variant torch_lce). --out writes the PNG: two panels, time and peak memory
against N, log scales; a report without torch_lce is measured first, and its rows (time and
peak, their ratios to naive and to the fused engine) are printed for the table above.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# Each series: its label in the picture, colour, marker, line style and marker size (fused and
# two-phase have the same peak: the larger marker stays visible under the smaller).
STYLE = {
    "naive": ("naive (full logits)", "tab:red", "o", "-", 6),
    "torch_lce": ("PyTorch linear_cross_entropy", "tab:orange", "s", "-", 6),
    "fused": ("fused", "tab:blue", "^", "-", 9),
    "two_phase": ("two-phase", "tab:green", "v", "-", 5),
    "fused_remote": ("fused, remote (trainer)", "tab:blue", "^", "--", 9),
    "two_phase_remote": ("two-phase, remote (trainer)", "tab:green", "v", "--", 5),
    "gemm": ("bare GEMMs (floor)", "tab:gray", "", ":", 0),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


@contextlib.contextmanager
def quiet_native_stderr():
    """The profiler's native start/stop log lines (and, without a GPU, its failed device query)
    go to file descriptor 2; they are not results."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def cpu_transient_bytes(step) -> int:
    """Peak bytes held by CPU tensors during `step()` above those held before it."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_native_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    cpu = torch._C._autograd.DeviceType.CPU
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == cpu)
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return peak


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(step, prepare, device, warmup, repeats):
    """(median seconds, transient bytes, the last step's result) of `step()`, with `prepare()`
    (e.g. gradients reset to None, so that backward allocates them inside the step) before each
    run outside the clock: `warmup` untimed runs, max(1, repeats) timed ones, then one more warm
    run for the peak, measured apart from the timed ones (the CPU profiler slows what it
    records)."""
    times = []
    for i in range(warmup + max(1, repeats)):
        prepare()
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    prepare()
    result = {}
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result["last"] = step()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = cpu_transient_bytes(lambda: result.setdefault("last", step()))
    return statistics.median(times), peak, result["last"]


def measure_lce(n, d, v, *, dtype, device, reduction, bias, ignored_fraction, warmup, repeats,
                seed=0) -> dict:
    """PyTorch's chunked linear_cross_entropy, one training step (loss, dX, dW): median time and
    transient bytes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator).to(device, dtype).requires_grad_(True)
    w = (0.02 * torch.randn(v, d, generator=generator)).to(device, dtype).requires_grad_(True)
    b = torch.zeros(v, device=device, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,), generator=generator)
    targets[torch.rand(n, generator=generator) < ignored_fraction] = -100
    targets = targets.to(device)
    options = torch.nn.LinearCrossEntropyOptions()

    def prepare():
        for t in (x, w, b):
            if t is not None:
                t.grad = None

    def step():
        loss = F.linear_cross_entropy(x, w, targets, linear_bias=b, reduction=reduction,
                                      ignore_index=-100, options=options)
        loss.backward()

    seconds, peak, _ = measure_step(step, prepare, device, warmup, repeats)
    return {"seconds": seconds, "peak_bytes": peak}


def bench_series(report):
    """remotehead-bench: one (D, V) and several N; its variants and the torch baseline."""
    cfg = report["config"]
    shapes = [(r["n"], cfg["d"], cfg["v"]) for r in report["results"]]
    names = ["naive", "fused", "two_phase", "gemm"]
    if all(not r["variants"].get("torch_lce", {"skipped": True})["skipped"]
           for r in report["results"]):
        names.append("torch_lce")  # measured already (--measure), reported by the bench
    series = {name: {"seconds": [], "peak_bytes": []} for name in names}
    for r in report["results"]:
        for name in series:
            variant = r["variants"][name]
            series[name]["seconds"].append(variant["step_seconds"])
            series[name]["peak_bytes"].append(None if name == "gemm" else variant["peak_bytes"])
    settings = {"dtype": cfg["dtype"], "device": cfg["device"], "reduction": cfg["reduction"],
                "bias": cfg["bias"], "ignored_fraction": cfg["ignored_fraction"],
                "warmup": cfg["warmup"], "repeats": cfg["repeats"], "threads": cfg["threads"]}
    title = (f"remotehead-bench: D={cfg['d']}, V={cfg['v']:,}, {cfg['dtype']}, {cfg['device']}, "
             f"{cfg['function']}")
    lce = cfg["function"] == "cross_entropy"
    return shapes, series, settings, title, lce


def remote_bench_series(report):
    """remotehead-remote-bench: its shapes (N:D:V); time of every variant, and the trainer's
    transient bytes (for the remote variants, the client process's: X and dX)."""
    shapes = [(r["n"], r["d"], r["v"]) for r in report["shapes"]]
    columns = {
        "naive": ("naive_seconds", "naive_peak_bytes"),
        "fused": ("in_process_seconds", "fused_in_process_peak_bytes"),
        "fused_remote": ("remote_seconds", "fused_remote_trainer_peak_bytes"),
        "two_phase_remote": ("two_phase_remote_seconds", "two_phase_remote_trainer_peak_bytes"),
    }
    series = {name: {"seconds": [], "peak_bytes": []} for name in columns}
    for r in report["shapes"]:
        values = {**r, **r["plot"]}
        for name, (seconds, peak) in columns.items():
            series[name]["seconds"].append(values[seconds])
            series[name]["peak_bytes"].append(values[peak])
    settings = {"dtype": "float32", "device": "cpu", "reduction": "mean", "bias": False,
                "ignored_fraction": 0.0, "warmup": report["warmup"],
                "repeats": report["repeats"], "threads": report["torch_threads"]}
    title = (f"remotehead-remote-bench: cross-entropy, float32, CPU, server on loopback "
             f"({report['cores']} cores shared)")
    return shapes, series, settings, title, True


def ratio(a, b):
    return f"{a / b:.3f}" if a is not None and b not in (None, 0) else "-"


def print_rows(shapes, series) -> None:
    print("\n# PyTorch linear_cross_entropy (chunked), measured by plot_bench.py in this run; its "
          "peak, as naive's, includes the dX and dW its backward allocates (fused's are "
          "preallocated)")
    print(f"{'N:D:V':>20}  {'step_s':>9}  {'x_naive':>7}  {'peak_MiB':>9}  {'peak/naive':>10}  "
          f"{'fused/lce time':>14}  {'fused/lce peak':>14}")
    lce, naive, fused = series["torch_lce"], series["naive"], series["fused"]
    for i, (n, d, v) in enumerate(shapes):
        print(f"{f'{n}:{d}:{v}':>20}  {lce['seconds'][i]:9.4f}  "
              f"{ratio(lce['seconds'][i], naive['seconds'][i]):>7}  "
              f"{lce['peak_bytes'][i] / 2**20:9.1f}  "
              f"{ratio(lce['peak_bytes'][i], naive['peak_bytes'][i]):>10}  "
              f"{ratio(fused['seconds'][i], lce['seconds'][i]):>14}  "
              f"{ratio(fused['peak_bytes'][i], lce['peak_bytes'][i]):>14}")


def draw(shapes, series, title, out) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    same_dv = len({(d, v) for _, d, v in shapes}) == 1
    labels = [str(n) if same_dv else f"{n}:{d}:{v}" for n, d, v in shapes]
    positions = list(range(len(shapes)))
    fig, (time_ax, peak_ax) = plt.subplots(1, 2, figsize=(13, 5.2))
    fig.suptitle(title, fontsize=10)
    for name, values in series.items():
        label, color, marker, line, size = STYLE[name]
        for ax, key, scale in ((time_ax, "seconds", 1.0), (peak_ax, "peak_bytes", 2**-20)):
            points = [(p, y * scale) for p, y in zip(positions, values[key])
                      if y is not None and y > 0]
            if points:
                ax.plot(*zip(*points), line, color=color, marker=marker, markersize=size,
                        label=label)
    for ax, ylabel in ((time_ax, "step time (s), median"),
                       (peak_ax, "peak transient memory (MiB)")):
        ax.set_yscale("log")
        ax.set_xticks(positions, labels, rotation=0 if same_dv else 20)
        ax.set_xlabel("N (tokens per step)" if same_dv else "N:D:V")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def measure_all(shapes, settings) -> dict:
    device = torch.device(settings["device"])
    measured = [measure_lce(n, d, v, dtype=DTYPES[settings["dtype"]], device=device,
                            reduction=settings["reduction"], bias=settings["bias"],
                            ignored_fraction=settings["ignored_fraction"],
                            warmup=settings["warmup"], repeats=settings["repeats"])
                for n, d, v in shapes]
    return {key: [m[key] for m in measured] for key in ("seconds", "peak_bytes")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", required=True, help="the bench's JSON report")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--measure", action="store_true",
                      help="print PyTorch linear_cross_entropy's measurements (TORCH_LCE line)")
    what.add_argument("--out", help="the PNG to write")
    args = p.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    kinds = {"remotehead-bench": bench_series, "remotehead-remote-bench": remote_bench_series}
    if report.get("bench") not in kinds:
        print(f"plot_bench.py: --report: expected a report of {' or '.join(kinds)}; got "
              f"bench={report.get('bench')!r}", file=sys.stderr)
        return 2
    shapes, series, settings, title, lce = kinds[report["bench"]](report)
    if settings["threads"]:
        torch.set_num_threads(settings["threads"])
    if args.measure:
        if not lce:
            print("plot_bench.py: PyTorch's linear_cross_entropy is cross-entropy only",
                  file=sys.stderr)
            return 2
        print("TORCH_LCE " + json.dumps(measure_all(shapes, settings)), flush=True)
        return 0
    if lce and "torch_lce" not in series:
        series["torch_lce"] = measure_all(shapes, settings)
        print_rows(shapes, series)
    elif not lce:
        print("\n# PyTorch linear_cross_entropy: cross-entropy only; not measured for this "
              "function")
    draw(shapes, series, title, args.out)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
