"""scripts/bench-gpu: remotehead against the real alternatives, one run, one device.

Every contender computes the same training step of a vocabulary head with a mean cross-entropy
loss: loss, dX [N, D] and dW [V, D] from X [N, D], W [V, D] and targets (10% ignored), at the
same shape, dtype and device:

  naive        plain PyTorch autograd over the full [N, V] logits (upcast to fp32)
  torch_lce    torch.nn.functional.linear_cross_entropy, LinearCrossEntropyOptions() (chunked)
  liger        Liger-Kernel's LigerFusedLinearCrossEntropyLoss (CUDA; skipped if not installed)
  cce          Apple's Cut Cross-Entropy, cut_cross_entropy.linear_cross_entropy (CUDA; ditto)
  remotehead   the engine in-process (remotehead-bench, C++), fp32 dW accumulator
  remotehead_fused   the same with fused function blocks (--fused_blocks: the CUDA kernel,
               the CPU twin on a CPU), beside today's engine in the same run
  remotehead_memory  the memory mode: dW accumulated in the head's bf16 / fp16 (grad_dtype)
               and a 256 MiB transient budget, fused blocks on CUDA
  remotehead_server  the same step from this Python process through a remotehead-server on
               loopback on the same device (remotehead.Client.forward_backward; dW on the
               server)

Columns: the median step time over --repeats after --warmup untimed steps; peak device bytes
of the step above what was held before it ("step peak"; the Python peers' backward allocates
dX and dW inside the step, remotehead's are preallocated) and the same with the step's gradient
outputs counted for everyone ("+grads": remotehead's dX and fp32 dW added), so both readings are
there; max |Δ| of the loss and of dX against an fp32 reference (fp32 copies of X and W, the
logits in fp32, autograd, row chunks). Softcap (cap·tanh(z/cap)) is applied by the contenders
that support it (naive, liger, cce, remotehead); torch_lce has none and runs without it, its
accuracy then measured against the reference without softcap, which the table says.

Each contender runs in its own process (a clean allocator, one contender's failure or OOM
reported, not fatal).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from plot_bench import measure_step, sync  # noqa: E402  (the benches' timing and peak rules)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The published shapes: Cut Cross-Entropy's paper benchmark and Liger-Kernel's FLCE benchmark.
SHAPES = {
    "cce": dict(n=8192, d=2304, v=256000, dtype="bfloat16", softcap=30.0),
    "liger": dict(n=16384, d=4096, v=128256, dtype="bfloat16", softcap=0.0),
    "seed": dict(n=2048, d=1024, v=32000, dtype="float32", softcap=0.0),
}
PEERS = ["naive", "torch_lce", "liger", "cce", "remotehead", "remotehead_fused",
         "remotehead_memory", "remotehead_server"]
# The memory mode's transient budget (StepOptions::memory_budget_bytes): chunks of a few hundred
# rows at V = 256,000 — what keeps its peak near Cut Cross-Entropy's, the bf16 dW included.
MEMORY_MODE_BUDGET = 256 << 20
IGNORED_FRACTION = 0.1
NO_SOFTCAP = {"torch_lce"}


def parse_shape(text: str) -> dict:
    if text in SHAPES:
        return dict(SHAPES[text], name=text)
    parts = text.split(":")
    if len(parts) not in (4, 5) or parts[3] not in DTYPES:
        raise SystemExit(f"--shapes: expected cce, liger, seed or N:D:V:dtype[:softcap]; got "
                         f"{text!r}")
    n, d, v = (int(p) for p in parts[:3])
    return dict(n=n, d=d, v=v, dtype=parts[3], softcap=float(parts[4]) if len(parts) == 5
                else 0.0, name=text)


def make_inputs(shape: dict, device: torch.device):
    """X, W, targets: drawn on the CPU from a fixed seed (the same values in every process)."""
    g = torch.Generator().manual_seed(0)
    dtype = DTYPES[shape["dtype"]]
    x = torch.randn(shape["n"], shape["d"], generator=g)
    w = torch.randn(shape["v"], shape["d"], generator=g) / math.sqrt(shape["d"])
    t = torch.randint(0, shape["v"], (shape["n"],), generator=g)
    t[torch.rand(shape["n"], generator=g) < IGNORED_FRACTION] = -100
    return x.to(device, dtype), w.to(device, dtype), t.to(device)


def peer_step(name: str, softcap: float):
    """(step(x, w, t) -> loss) for a Python contender; dX and dW land in x.grad, w.grad."""
    cap = softcap if name not in NO_SOFTCAP else 0.0
    if name == "naive":
        def step(x, w, t):
            z = (x @ w.t()).float()
            if cap > 0:
                z = cap * torch.tanh(z / cap)
            loss = F.cross_entropy(z, t, ignore_index=-100)
            loss.backward()
            return loss
    elif name == "torch_lce":
        options = torch.nn.LinearCrossEntropyOptions()

        def step(x, w, t):
            loss = F.linear_cross_entropy(x, w, t, ignore_index=-100, options=options)
            loss.backward()
            return loss
    elif name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100,
                                              softcap=cap if cap > 0 else None)

        def step(x, w, t):
            loss = fn(w, x, t)
            loss.backward()
            return loss
    elif name == "cce":
        from cut_cross_entropy import linear_cross_entropy

        def step(x, w, t):
            loss = linear_cross_entropy(x, w, t, ignore_index=-100,
                                        softcap=cap if cap > 0 else None)
            loss.backward()
            return loss
    else:
        raise ValueError(name)
    return step, cap


def measure_python_peer(name, shape, device, warmup, repeats) -> dict:
    step, cap = peer_step(name, shape["softcap"])
    x, w, t = make_inputs(shape, device)
    x.requires_grad_(True)
    w.requires_grad_(True)

    def prepare():
        x.grad = None
        w.grad = None

    seconds, peak, loss = measure_step(lambda: step(x, w, t), prepare, device, warmup, repeats)
    return {"seconds": seconds, "peak_bytes": peak,
            "peak_with_grads_bytes": peak, "softcap": cap, "loss": loss.item(),
            "grad_hidden": x.grad.detach().cpu()}


def grad_bytes(shape, dw_element_bytes=4) -> int:
    """dX in the head's dtype and remotehead's dW accumulator (fp32 unless the memory mode's)."""
    elt = torch.tensor([], dtype=DTYPES[shape["dtype"]]).element_size()
    return shape["n"] * shape["d"] * elt + shape["v"] * shape["d"] * dw_element_bytes


def measure_remotehead(shape, device, warmup, repeats, build, mode="") -> dict:
    """remotehead-bench's fused variant; `mode` "fused" (--fused_blocks) or "memory" (the memory
    mode: dW in the head's half-precision dtype, MEMORY_MODE_BUDGET, fused blocks on CUDA)."""
    argv = [os.path.join(build, "tests", "bench", "remotehead-bench"), "--json",
            f"--device={device}", f"--n={shape['n']}", f"--d={shape['d']}", f"--v={shape['v']}",
            f"--dtype={shape['dtype']}", f"--softcap={shape['softcap']}",
            f"--warmup={warmup}", f"--repeats={repeats}", "--torch_lce=false",
            "--skip_naive_above_bytes=0"]
    dw_element_bytes = 4
    if mode == "fused" or (mode == "memory" and device.type == "cuda"):
        argv.append("--fused_blocks")
    if mode == "memory":
        if shape["dtype"] == "float32":
            raise RuntimeError("the memory mode is a half-precision head's")
        argv += [f"--grad_dtype={shape['dtype']}", f"--memory_budget_bytes={MEMORY_MODE_BUDGET}"]
        dw_element_bytes = 2
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"remotehead-bench exited {done.returncode}: {done.stderr.strip()}")
    fused = json.loads(done.stdout)["results"][0]["variants"]["fused"]
    return {"seconds": fused["step_seconds"], "peak_bytes": fused["peak_bytes"],
            "peak_with_grads_bytes": fused["peak_bytes"] + grad_bytes(shape, dw_element_bytes),
            "softcap": shape["softcap"],
            "note": "its own inputs (same shape and distribution); accuracy: see server row"}


def scrape(port: int, metric: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text,
                                                     re.M)]
    if not values:
        raise RuntimeError(f"/metrics has no {metric}")
    return max(values)


def measure_remotehead_server(shape, device, warmup, repeats, build) -> dict:
    import remotehead  # client/python, on PYTHONPATH from scripts/bench-gpu
    from remotehead.local_server import LocalServer

    x, w, t = make_inputs(shape, device)
    args = [f"--device={device}", "--metrics_address=127.0.0.1:0"]
    with LocalServer(os.path.join(build, "server", "remotehead-server"), args) as server:
        client = remotehead.Client(server.target)
        client.upload_head("lm", w)
        del w
        resident = scrape(server.metrics_port, "remotehead_device_memory_allocated_bytes")
        params = {"softcap": shape["softcap"]} if shape["softcap"] > 0 else {}
        times, result = [], None
        for i in range(warmup + repeats):
            sync(device)
            start = time.perf_counter()
            result = client.forward_backward("lm", x, t, params=params,
                                             gradient_id=("bench", i, 0))
            dx = result.grad_hidden.to(device)  # where the trainer's backward needs it
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        peak = scrape(server.metrics_port, "remotehead_device_memory_peak_bytes") - resident
        client.close()
    return {"seconds": statistics.median(times), "peak_bytes": int(peak),
            "peak_with_grads_bytes": int(peak) + shape["v"] * shape["d"] * 4,
            "softcap": shape["softcap"], "loss": result.loss,
            "grad_hidden": dx.cpu(),
            "note": "the server's /metrics peak above its resident W and dW (the upload's "
                    "buffers included); dX is in the trainer"}


def reference(shape, device, softcap: float, chunk_rows: int = 1024):
    """fp32 loss and dX: fp32 copies of X and W, autograd over row chunks."""
    x, w, t = make_inputs(shape, device)
    x, w = x.float(), w.float()
    valid = max(int((t != -100).sum()), 1)
    total, dx = 0.0, torch.empty_like(x)
    for s in range(0, x.shape[0], chunk_rows):
        xc = x[s:s + chunk_rows].detach().requires_grad_(True)
        z = xc @ w.t()
        if softcap > 0:
            z = softcap * torch.tanh(z / softcap)
        loss = F.cross_entropy(z, t[s:s + chunk_rows], ignore_index=-100, reduction="sum") / valid
        loss.backward()
        total += loss.item()
        dx[s:s + chunk_rows] = xc.grad
    return total, dx.cpu()


def run_child(args) -> None:
    """One contender, in this process; prints one JSON line (tensors compared here)."""
    shape = parse_shape(args.shapes)
    device = torch.device(args.device)
    try:
        if args.peer in ("remotehead", "remotehead_fused", "remotehead_memory"):
            out = measure_remotehead(shape, device, args.warmup, args.repeats, args.build,
                                     args.peer.removeprefix("remotehead").lstrip("_"))
        elif args.peer == "remotehead_server":
            out = measure_remotehead_server(shape, device, args.warmup, args.repeats, args.build)
        else:
            if args.peer in ("liger", "cce") and device.type != "cuda":
                raise RuntimeError("runs on CUDA only")
            out = measure_python_peer(args.peer, shape, device, args.warmup, args.repeats)
        if "grad_hidden" in out:
            dx = out.pop("grad_hidden")
            ref_loss, ref_dx = reference(shape, device, out["softcap"])
            out["d_loss"] = abs(out["loss"] - ref_loss)
            out["d_hidden"] = (dx.float() - ref_dx).abs().max().item()
    except ImportError as e:
        out = {"skipped": f"not installed ({e.name})"}
    except Exception as e:  # noqa: BLE001  one contender's failure is reported, not fatal
        out = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    print("PEER " + json.dumps(out))


def mib(b):
    return f"{b / 2**20:,.0f}" if b is not None else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--shapes", default="",
                   help="comma list of cce, liger, seed or N:D:V:dtype[:softcap]; default "
                        "cce,liger on CUDA, seed on the CPU")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--build", default=os.environ.get("REMOTEHEAD_BUILD_DIR", "build"))
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument("--peer", default="", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        args.device = "cuda:0"
    if args.peer:
        run_child(args)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device: expected an available device; got {args.device} but CUDA "
                         "is not available")
    shapes = args.shapes or ("cce,liger" if device.type == "cuda" else "seed")
    peers = [q for q in args.peers.split(",") if q]
    for q in peers:
        if q not in PEERS:
            raise SystemExit(f"--peers: expected names from {PEERS}; got {q!r}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# bench-gpu: {gpu}; torch {torch.__version__}"
          f"{', CUDA ' + torch.version.cuda if device.type == 'cuda' else ''}; "
          f"{torch.get_num_threads()} CPU threads; median of {args.repeats} after {args.warmup} "
          "warm-up steps")
    report = {"device": args.device, "gpu": gpu, "torch": torch.__version__,
              "cuda": torch.version.cuda, "shapes": []}
    for text in shapes.split(","):
        shape = parse_shape(text)
        print(f"\n## {shape['name']}: N={shape['n']} D={shape['d']} V={shape['v']} "
              f"{shape['dtype']} softcap={shape['softcap']:g}")
        print(f"{'contender':>18}  {'step_ms':>9}  {'step peak MiB':>13}  {'+grads MiB':>10}  "
              f"{'|Δloss|':>9}  {'max|ΔdX|':>9}  note")
        rows = {}
        for peer in peers:
            cmd = [sys.executable, os.path.abspath(__file__), "--peer", peer, "--shapes", text,
                   "--device", args.device, "--warmup", str(args.warmup), "--repeats",
                   str(args.repeats), "--build", args.build]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PEER ")), None)
            r = json.loads(line[5:]) if line else {
                "skipped": f"exited {done.returncode}: {done.stderr.strip()[-200:]}"}
            rows[peer] = r
            if "skipped" in r:
                print(f"{peer:>18}  skipped: {r['skipped']}")
                continue
            note = r.get("note", "")
            if shape["softcap"] > 0 and r["softcap"] == 0:
                note = "no softcap support: run without it, vs the reference without it"
            dl = f"{r['d_loss']:.2e}" if "d_loss" in r else "-"
            dh = f"{r['d_hidden']:.2e}" if "d_hidden" in r else "-"
            print(f"{peer:>18}  {r['seconds'] * 1e3:9.2f}  {mib(r['peak_bytes']):>13}  "
                  f"{mib(r['peak_with_grads_bytes']):>10}  {dl:>9}  {dh:>9}  {note}")
        timed = {k: r for k, r in rows.items() if "skipped" not in r}
        others = {k: r for k, r in timed.items() if not k.startswith("remotehead")}
        for name in ("remotehead", "remotehead_fused", "remotehead_memory"):
            mine = timed.get(name)
            if mine and others:
                fastest = min(others, key=lambda k: others[k]["seconds"])
                print(f"{name} in-process / fastest peer ({fastest}): "
                      f"{mine['seconds'] / others[fastest]['seconds']:.3f}× time, "
                      f"{6 * shape['n'] * shape['d'] * shape['v'] / mine['seconds'] / 1e12:.0f} "
                      "TFLOP/s (6NDV)")
            if mine and "cce" in timed:
                ratio = mine["peak_with_grads_bytes"] / timed["cce"]["peak_with_grads_bytes"]
                print(f"{name} / cce peak (+grads): {ratio:.3f}×")
        ours = timed.get("remotehead")
        if ours and "remotehead_server" in timed:
            print(f"server on loopback / in-process: "
                  f"{timed['remotehead_server']['seconds'] / ours['seconds']:.3f}× time")
        report["shapes"].append({"shape": shape, "results": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
