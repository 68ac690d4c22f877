"""What a synchronous optimizer step costs W data-parallel trainers that share one head.

One remotehead-server (CPU, started here on loopback) and one fp32 head of V × D per run; W
trainer processes (each its own gRPC client, one torch thread) run --steps global steps (after
--warmup untimed ones) of what a DDP rank does with an offloaded head:

  forward_backward   one fused step of the rank's N rows (random hidden [N, D] and targets,
                     seeded by the rank), dW added on the server under the rank's own
                     GradientId("run/rank-R", step, 0), reduction "mean"
  optimizer_step     AdamW, zero_gradients, synchronous=(step, rank, W): returns once every
                     rank asked; the server applies the step once with dW averaged over ranks

Each trainer records, per step, the wall-clock times (time.time(): one machine) at which its
forward_backward started and ended, at which it called optimizer_step and at which the answer
came, and writes them to a JSON file the parent reads. Reported per W:

  tokens/s     W·N·steps / the wall time of the timed steps (first rank's first start to the
               last answer)
  step         the global step time: median over steps of (last answer − first start)
  sync cost    median over steps of (last answer − last call): from the last rank's arrival to
               everyone's answer — the optimizer step itself plus the coordination
  wait         median over steps of (last answer − first call): how long the earliest rank
               idled at the step (it includes the time the others' forward_backward took
               beyond its own: the ranks' steps share the server)
  optimizer    the same AdamW step from a single caller (no `synchronous`), timed by the parent
               in the same run, before and after the trainer runs (median of both rounds), on
               a head of the same shape that has accumulated dW (a small forward_backward
               before each step, untimed), zero_gradients on
  added        (sync cost − optimizer) / step: what the synchronous step adds to a global step

With --replicas R (and --ranks-per-replica K) the head lives on a mesh of R replicas of K
server processes each (docs/meshes.md) instead of one server: trainer t dials replica t mod R's
front, and each run also reports, from the leader's /metrics around it:

  reduce/step  the bytes of dW rank 0 summed over the replicas per global step
               (remotehead_mesh_reduced_bytes_total), against the model ceil(V/K)·D·4
  reduce ms    the time rank 0 spent summing them per global step
               (remotehead_mesh_reduce_seconds_total), and its share of the global step

The acceptance criterion (at 2048:1024:32000, W = 2): the synchronous step adds at most 5 % to
a global step, printed as PASS/FAIL. The trainers and the server share this machine's cores, so
tokens/s does not scale with W here; the criterion compares coordination overhead, which does
not depend on that.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENT_PYTHON = ROOT / "client" / "python"
ACCEPTANCE_SHAPE = (2048, 1024, 32000)  # N per trainer, D, V
ACCEPTANCE_TRAINERS = 2
ACCEPTANCE_LIMIT = 0.05
ADAMW = dict(lr=1e-4, weight_decay=0.01)


def import_remotehead():
    try:
        import remotehead  # noqa: F401
    except ImportError:  # run from a checkout without PYTHONPATH: the package next door
        sys.path.insert(0, str(CLIENT_PYTHON))
    import remotehead
    return remotehead


def parse_shape(text: str):
    try:
        n, d, v = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N:D:V (e.g. 2048:1024:32000); got {text!r}")
    if min(n, d, v) <= 0:
        raise argparse.ArgumentTypeError(f"N, D and V must be positive; got {text!r}")
    return n, d, v


def parse_trainers(text: str):
    try:
        counts = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list of counts (e.g. 1,2); got {text!r}")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"trainer counts must be >= 1; got {text!r}")
    return counts


# ----- one trainer (its own process) -----

def trainer(args) -> None:
    import torch
    torch.set_num_threads(1)
    remotehead = import_remotehead()
    n, d, v = args.shape
    rank, world = args.rank, args.world
    fronts = args.target.split(",")
    client = remotehead.Client(fronts if len(fronts) > 1 else args.target, rank=rank)
    generator = torch.Generator().manual_seed(1000 + rank)
    hidden = torch.randn(n, d, generator=generator)
    targets = torch.randint(0, v, (n,), generator=generator)
    steps = []
    for step in range(args.warmup + args.steps):
        fb_start = time.time()
        result = client.forward_backward(
            args.head_id, hidden, targets, reduction="mean", accumulate=True,
            gradient_id=remotehead.GradientId(f"run/rank-{rank}", step, 0))
        fb_end = time.time()
        assert result.grad_hidden is not None and result.grad_hidden.shape == (n, d)
        call = time.time()
        info = client.optimizer_step(args.head_id, adamw=ADAMW, zero_gradients=True,
                                     synchronous=(step, rank, world))
        answer = time.time()
        steps.append(dict(step=step, timed=step >= args.warmup, fb_start=fb_start,
                          fb_end=fb_end, call=call, answer=answer, loss=result.loss,
                          fb_version=result.summary.weight_version,
                          version=info.weight_version))
    client.close()
    with open(args.out, "w") as f:
        json.dump(dict(rank=rank, world=world, steps=steps), f)


# ----- the parent -----

def median(xs):
    return statistics.median(xs) if xs else float("nan")


class SingleCallerStep:
    """The single-caller AdamW step (zero_gradients, no `synchronous`) on a head of the same
    shape with accumulated dW, timed in rounds: one before each trainer run and one after the
    last, so that each run is compared with the rounds on either side of it (a shared machine's
    load drifts)."""

    def __init__(self, client, remotehead, head_id, shape, seed):
        import torch
        n, d, v = shape
        self.client, self.remotehead, self.head_id = client, remotehead, head_id
        self.rows = min(n, 64)  # dW is V × D whatever N is: a small batch fills it
        generator = torch.Generator().manual_seed(7)
        self.hidden = torch.randn(self.rows, d, generator=generator)
        self.targets = torch.randint(0, v, (self.rows,), generator=generator)
        client.create_head(head_id, v, d, seed=seed)
        self.calls = 0
        self.rounds = []
        self.step()  # the first allocates AdamW's state: untimed

    def step(self) -> float:
        self.client.forward_backward(
            self.head_id, self.hidden, self.targets, reduction="mean", accumulate=True,
            gradient_id=self.remotehead.GradientId("single", self.calls, 0))
        self.calls += 1
        start = time.time()
        self.client.optimizer_step(self.head_id, adamw=ADAMW, zero_gradients=True)
        return time.time() - start

    def round(self, repeats: int) -> None:
        self.rounds.append([self.step() for _ in range(repeats)])

    def around(self, run: int) -> float:
        """The median of the rounds just before and just after trainer run `run`."""
        return median(self.rounds[run] + self.rounds[run + 1])

    def report(self) -> dict:
        self.client.drop_head(self.head_id)
        return dict(seconds=median([t for r in self.rounds for t in r]), rounds=self.rounds,
                    accumulate_rows=self.rows,
                    note="single caller, no synchronous, zero_gradients on, on a head with "
                         f"accumulated dW (a {self.rows}-row forward_backward before each "
                         "step, untimed); timed before each trainer run and after the last; "
                         "each run's ratios use the rounds on either side of it")


def mesh_counters(metrics_port) -> dict:
    """The leader's remotehead_mesh_* counters (none off a mesh)."""
    if metrics_port is None:
        return {}
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=5).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
            if line.startswith(("remotehead_mesh_reduced_bytes_total",
                                "remotehead_mesh_reduce_seconds_total"))}


def run_trainers(client, head_id, world, args, tmp, metrics_port=None) -> dict:
    n, d, v = args.shape
    info = client.create_head(head_id, v, d, seed=args.seed)
    counters_before = mesh_counters(metrics_port)
    version_before = info.weight_version
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(
               [str(CLIENT_PYTHON)] + ([os.environ["PYTHONPATH"]]
                                       if os.environ.get("PYTHONPATH") else []))}
    outs = [os.path.join(tmp, f"{head_id}-rank-{r}.json") for r in range(world)]
    processes = [subprocess.Popen(
        [sys.executable, __file__, "--trainer", f"--target={args.target}",
         f"--head-id={head_id}", f"--rank={r}", f"--world={world}", f"--out={outs[r]}",
         f"--shape={n}:{d}:{v}", f"--steps={args.steps}", f"--warmup={args.warmup}"],
        env=env) for r in range(world)]
    codes = [p.wait() for p in processes]
    if any(codes):
        raise SystemExit(f"W={world}: trainer exit codes {codes}")
    ranks = []
    for path in outs:
        with open(path) as f:
            ranks.append(json.load(f)["steps"])
    version_after = client.describe_head(head_id).weight_version
    counters_after = mesh_counters(metrics_port)
    client.drop_head(head_id)

    per_step = []
    for i in range(args.warmup + args.steps):
        s = [rank[i] for rank in ranks]
        per_step.append(dict(
            step=i, timed=s[0]["timed"],
            global_step=max(x["answer"] for x in s) - min(x["fb_start"] for x in s),
            sync_cost=max(x["answer"] for x in s) - max(x["call"] for x in s),
            wait=max(x["answer"] for x in s) - min(x["call"] for x in s),
            forward_backward=[x["fb_end"] - x["fb_start"] for x in s],
            versions=[x["version"] for x in s],
            losses=[x["loss"] for x in s]))
    timed = [p for p in per_step if p["timed"]]
    first = [rank[args.warmup] for rank in ranks]
    last = [rank[-1] for rank in ranks]
    wall = max(x["answer"] for x in last) - min(x["fb_start"] for x in first)
    mesh = {}
    if counters_after:
        total = args.warmup + args.steps
        delta = {k: counters_after[k] - counters_before.get(k, 0.0) for k in counters_after}
        mesh = dict(
            reduced_bytes_per_step=delta["remotehead_mesh_reduced_bytes_total"] / total,
            model_bytes_per_step=-(-v // args.ranks_per_replica) * d * 4,
            reduce_seconds_per_step=delta["remotehead_mesh_reduce_seconds_total"] / total)
    return dict(**mesh,
        trainers=world, head_id=head_id, rows_per_trainer=n,
        wall_seconds=wall, tokens_per_second=world * n * args.steps / wall,
        global_step_seconds=median([p["global_step"] for p in timed]),
        sync_cost_seconds=median([p["sync_cost"] for p in timed]),
        wait_seconds=median([p["wait"] for p in timed]),
        forward_backward_seconds=median([t for p in timed for t in p["forward_backward"]]),
        version_before=version_before, version_after=version_after,
        steps=per_step, raw=ranks)


def check(report, args) -> None:
    """--check: the run's numbers are sane (timings positive, the head's version advanced by
    one per global step and every rank got the same answer); timings not compared."""
    assert report["optimizer_step"]["seconds"] > 0, report["optimizer_step"]
    assert len(report["optimizer_step"]["rounds"]) == len(report["runs"]) + 1
    total = args.warmup + args.steps
    for run in report["runs"]:
        w = run["trainers"]
        for key in ("wall_seconds", "tokens_per_second", "global_step_seconds",
                    "sync_cost_seconds", "wait_seconds", "forward_backward_seconds",
                    "optimizer_step_seconds"):
            assert run[key] > 0, (w, key, run[key])
        assert run["version_after"] == run["version_before"] + total, (w, run["version_before"],
                                                                       run["version_after"])
        for p in run["steps"]:
            assert p["versions"] == [run["version_before"] + p["step"] + 1] * w, (w, p)
            assert p["sync_cost"] <= p["wait"] <= p["global_step"], (w, p)
        for rank in run["raw"]:
            for s in rank:
                assert s["fb_start"] <= s["fb_end"] <= s["call"] <= s["answer"], (w, s)
        assert run["added_fraction"] == run["added_fraction"], run  # not NaN
        if args.replicas > 1:  # every step summed rank 0's shard of dW once over the replicas
            assert run["reduced_bytes_per_step"] == run["model_bytes_per_step"], run
            assert run["reduce_seconds_per_step"] > 0, run
    print("data-parallel bench check: ok")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=parse_shape, default=parse_shape("2048:1024:32000"),
                        help="N:D:V — rows per trainer per step, hidden size, vocabulary "
                             "(default 2048:1024:32000)")
    parser.add_argument("--trainers", type=parse_trainers, default=[1, 2],
                        help="trainer counts W to run, comma-separated (default 1,2)")
    parser.add_argument("--steps", type=int, default=5, help="timed global steps (default 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed global steps first (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the head's init seed")
    parser.add_argument("--server-binary", default=os.environ.get(
        "REMOTEHEAD_SERVER_BINARY", str(ROOT / "build" / "server" / "remotehead-server")),
        help="default: $REMOTEHEAD_SERVER_BINARY, else build/server/remotehead-server")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra server flag, e.g. --server-arg=--torch_threads=2 "
                             "(repeatable)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="R replicas of the head on a mesh (default 1: one server)")
    parser.add_argument("--ranks-per-replica", type=int, default=1,
                        help="K server processes per replica (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write the numbers here")
    parser.add_argument("--check", action="store_true",
                        help="assert the numbers are sane (positive times, versions), for CI")
    # A trainer process (started by the parent).
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--head-id", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.trainer:
        return trainer(args)

    remotehead = import_remotehead()
    from remotehead.local_server import LocalHeadGroup, LocalServer

    n, d, v = args.shape
    size = args.replicas * args.ranks_per_replica
    if args.replicas < 1 or args.ranks_per_replica < 1:
        parser.error("--replicas and --ranks-per-replica must be >= 1")
    metrics_port = None
    if size > 1:
        server = LocalHeadGroup(args.server_binary, size=size, replicas=args.replicas,
                                args=["--device=cpu", "--metrics_address=127.0.0.1:0",
                                      *args.server_arg]).start()
        args.target = ",".join(server.fronts) if args.replicas > 1 else server.target
        if args.replicas > 1:
            metrics_port = server.ranks[0].metrics_port
    else:
        server = LocalServer(args.server_binary, ["--device=cpu", *args.server_arg]).start()
        args.target = server.target
    try:
        client = remotehead.Client(server.ranks[0].target if size > 1 else server.target)
        single = SingleCallerStep(client, remotehead, "dp-single", args.shape, args.seed)
        repeats = max(3, args.steps)
        runs = []
        with tempfile.TemporaryDirectory(prefix="remotehead-dp-bench-") as tmp:
            for w in args.trainers:
                single.round(repeats)
                runs.append(run_trainers(client, f"dp-w{w}", w, args, tmp, metrics_port))
        single.round(repeats)
        for i, run in enumerate(runs):
            run["optimizer_step_seconds"] = single.around(i)
        optimizer = single.report()
        client.close()
    finally:
        code = server.stop()
    codes = code if isinstance(code, list) else [code]
    if any(codes):
        logs = server.ranks if size > 1 else [server]
        raise SystemExit(f"the server(s) did not drain cleanly (exit {codes}):\n"
                         + "".join(line for s in logs for line in s.log))

    for run in runs:
        opt = run["optimizer_step_seconds"]
        run["sync_over_optimizer"] = run["sync_cost_seconds"] / opt
        run["added_fraction"] = (run["sync_cost_seconds"] - opt) / run["global_step_seconds"]
    cores = os.cpu_count()
    acceptance = dict(criterion=f"the synchronous step adds at most "
                                f"{ACCEPTANCE_LIMIT:.0%} to a global step of "
                                f"{ACCEPTANCE_TRAINERS} trainers at N=2048 per trainer, "
                                f"D=1024, V=32000 on one server")
    at = [r for r in runs if r["trainers"] == ACCEPTANCE_TRAINERS]
    if tuple(args.shape) == ACCEPTANCE_SHAPE and at:
        acceptance["added_fraction"] = at[0]["added_fraction"]
        acceptance["verdict"] = "PASS" if at[0]["added_fraction"] <= ACCEPTANCE_LIMIT else "FAIL"
    else:
        acceptance["verdict"] = "not evaluated"
        acceptance["reason"] = (f"needs --shape 2048:1024:32000 and W={ACCEPTANCE_TRAINERS} "
                                f"in --trainers")

    where = ("one server" if size == 1 else
             f"a mesh of {args.replicas} replica(s) x {args.ranks_per_replica} rank(s)")
    print(f"data-parallel trainers on {where} (CPU, {cores} cores): N={n} rows per trainer, "
          f"D={d}, V={v}, fp32, AdamW; {args.steps} timed global steps after {args.warmup} "
          f"warm-up")
    print(f"note: the {max(args.trainers)} trainer process(es) and the server share this "
          f"machine's {cores} cores (and the ranks' forward_backward share the server), so "
          f"tokens/s does not scale with W here; the synchronous step's overhead "
          f"is what is compared")
    print(f"optimizer step (single caller): {optimizer['seconds'] * 1e3:.1f} ms overall  "
          f"[{optimizer['note']}]")
    print()
    header = (f"{'W':>3} {'tokens/s':>10} {'step ms':>9} {'fwd+bwd ms':>11} {'sync ms':>9} "
              f"{'wait ms':>9} {'opt ms':>8} {'sync/opt':>9} {'added':>8}")
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r['trainers']:>3} {r['tokens_per_second']:>10.0f} "
              f"{r['global_step_seconds'] * 1e3:>9.1f} "
              f"{r['forward_backward_seconds'] * 1e3:>11.1f} "
              f"{r['sync_cost_seconds'] * 1e3:>9.1f} {r['wait_seconds'] * 1e3:>9.1f} "
              f"{r['optimizer_step_seconds'] * 1e3:>8.1f} {r['sync_over_optimizer']:>9.2f} {r['added_fraction']:>8.2%}")
    for r in runs:
        if "reduced_bytes_per_step" in r:
            print(f"W={r['trainers']}: dW summed over the replicas per step (rank 0): "
                  f"{r['reduced_bytes_per_step'] / 2**20:.2f} MiB (model ceil(V/K)*D*4 = "
                  f"{r['model_bytes_per_step'] / 2**20:.2f} MiB), "
                  f"{r['reduce_seconds_per_step'] * 1e3:.1f} ms = "
                  f"{r['reduce_seconds_per_step'] / r['global_step_seconds']:.1%} of the step")
    print()
    print("step: median global step (first start to last answer); fwd+bwd: median "
          "forward_backward of one rank; sync: last call to last answer; wait: first call to "
          "last answer; opt: the single-caller optimizer step, timed just before and after "
          "the run; sync/opt: sync over opt; added: (sync - opt) / step")
    line = f"acceptance: {acceptance['criterion']}: {acceptance['verdict']}"
    if "added_fraction" in acceptance:
        line += f" (adds {acceptance['added_fraction']:.2%})"
    else:
        line += f" ({acceptance['reason']})"
    print(line)

    report = dict(shape=dict(rows_per_trainer=n, hidden_size=d, vocab_size=v, dtype="float32"),
                  replicas=args.replicas, ranks_per_replica=args.ranks_per_replica,
                  steps=args.steps, warmup=args.warmup, cpu_cores=cores, device="cpu",
                  optimizer=dict(name="adamw", **ADAMW), optimizer_step=optimizer,
                  runs=runs, acceptance=acceptance,
                  note="trainers and server share the machine's cores: tokens/s does not "
                       "scale with W on a small machine")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.check:
        check(report, args)


if __name__ == "__main__":
    main()
