"""The main job's cluster table (train_tiny_llama.py --trainers W): the same training with 1 and
W data-parallel trainer processes, each process's peak memory summed, the server's added.

With the model's own lm_head every trainer holds the head — the [V, D] weight, its gradient,
AdamW's two moments and the micro-batch's [tokens, V] logits (with their log-softmax and its
gradient): W trainers pay it W times (the logits split over the ranks, the rest repeated). With
the remote head no trainer holds it: one remotehead-server does, once, for all of them.

Trainer peaks: ru_maxrss of each trainer process (for W > 1 torchrun's worker processes;
torchrun's own launcher process, which trains nothing, is not counted). Server peak: VmHWM of a
fresh remotehead-server per remote run, read at the end of that run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

# Bars for the per-step losses (relative): the remote head against the local head at the same W
# (the main job's bar), and W trainers against one trainer with the same global batch.
REMOTE_VS_LOCAL_BAR = 1e-4
WORLD_VS_ONE_BAR = 1e-4


def torchrun_ranks(script: str, flags, world: int) -> list:
    """Runs `script` with `flags` as `world` processes under torchrun (gloo rendezvous on a
    free loopback port); each rank writes its result to a temporary folder. The results by
    rank."""
    from remotehead.local_server import free_port

    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m",
                                                          "torch.distributed.run"]
    env = dict(os.environ)
    # The machine's cores shared among the ranks (torchrun would set 1 and warn).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    with tempfile.TemporaryDirectory(prefix="remotehead-main-job-") as out:
        command = [*launcher, f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}", script, *flags, f"--result-dir={out}"]
        # torchrun's and the ranks' output to stderr: stdout holds the tables alone.
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, text=True)
        sys.stderr.write(done.stdout)
        done.check_returncode()
        return [json.loads((pathlib.Path(out) / f"rank{rank}.json").read_text())
                for rank in range(world)]


def summarize(runs, servers, args, relative_difference) -> dict:
    """The cluster table's rows from compare_cluster's runs[(variant, W)] (results by rank) and
    servers[W] = (peak MiB, exit code, RSS at start MiB)."""
    rows = []
    for world in sorted(servers):
        local, remote = runs["local", world], runs["remote", world]
        for ranks in (local, remote):  # the logged loss is the ranks' mean: the same on each
            assert all(r["losses"] == ranks[0]["losses"] for r in ranks), "ranks' losses differ"
        row = {"world": world, "batch_per_rank": args.batch // world,
               "local_peaks": [r["peak_mib"] for r in local],
               "remote_peaks": [r["peak_mib"] for r in remote],
               "server_peak": servers[world][0],
               "remote_vs_local": relative_difference(remote[0]["losses"], local[0]["losses"])}
        if world != 1:
            row["vs_one"] = (
                relative_difference(local[0]["losses"], runs["local", 1][0]["losses"]),
                relative_difference(remote[0]["losses"], runs["remote", 1][0]["losses"]))
        # What training added to each process: its peak less its RSS before training (the
        # server's: less its RSS when it started listening).
        row["local_growth"] = sum(r["peak_mib"] - r["rss_before_training_mib"] for r in local)
        row["remote_growth"] = sum(r["peak_mib"] - r["rss_before_training_mib"] for r in remote)
        row["server_growth"] = servers[world][0] - servers[world][2]
        row["local_total"] = sum(row["local_peaks"])
        row["remote_trainers"] = sum(row["remote_peaks"])
        row["remote_total"] = row["remote_trainers"] + row["server_peak"]
        rows.append(row)
    return {"rows": rows, "batch": args.batch, "accumulation": args.accumulation,
            "seq": args.seq, "steps": args.steps}


def _peaks(peaks) -> str:
    """'2,900' for one process, '1,450+1,460=2,910' for several."""
    if len(peaks) == 1:
        return f"{peaks[0]:,.0f}"
    return "+".join(f"{p:,.0f}" for p in peaks) + f"={sum(peaks):,.0f}"


def print_table(cluster) -> bool:
    """Prints the cluster table; whether the losses agree within the bars."""
    rows = cluster["rows"]
    print(f"\ncluster: W data-parallel trainers (torchrun, gloo, CPU), the same global batch for "
          f"every W: {cluster['steps']} steps of {cluster['accumulation']} micro-batches x "
          f"{cluster['batch']} sequences x {cluster['seq']} tokens; memory in MiB")
    widths = (3, 7, 24, 24, 8, 8, 10, 18)
    headings = (("", "", "local lm_head", "remote head", "", "", "loss diff", "loss diff (rel)"),
                ("W", "seq/rank", "trainers", "trainers", "server", "total", "remote vs",
                 "vs W=1"),
                ("", "", "(peaks, sum)", "(peaks, sum)", "peak", "", "local", "local, remote"))
    for line in headings:
        print("  ".join(f"{h:>{w}}" for h, w in zip(line, widths)))
    for row in rows:
        vs_one = ("-" if "vs_one" not in row else
                  "{:.1e}, {:.1e}".format(*row["vs_one"]))
        cells = (str(row["world"]), str(row["batch_per_rank"]), _peaks(row["local_peaks"]),
                 _peaks(row["remote_peaks"]), f"{row['server_peak']:,.0f}",
                 f"{row['remote_total']:,.0f}", f"{row['remote_vs_local']:.1e}", vs_one)
        print("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    one, many = rows[0], rows[-1]
    w = many["world"]
    print(f"total over all trainers and the server, W = 1 -> {w}: local head "
          f"{one['local_total']:,.0f} -> {many['local_total']:,.0f} MiB; remote head "
          f"{one['remote_total']:,.0f} -> {many['remote_total']:,.0f} MiB (trainers "
          f"{one['remote_trainers']:,.0f} -> {many['remote_trainers']:,.0f}, server "
          f"{one['server_peak']:,.0f} -> {many['server_peak']:,.0f})")
    for row in rows:
        saved = row["local_total"] - row["remote_total"]
        print(f"  W = {row['world']}: the remote head saves {saved:,.0f} MiB of the cluster's "
              f"{row['local_total']:,.0f} MiB ({100 * saved / row['local_total']:.0f}%); per "
              f"trainer, local minus remote peak: "
              + ", ".join(f"{a - b:,.0f}" for a, b in zip(row["local_peaks"],
                                                         row["remote_peaks"])) + " MiB")
    print("growth in training (each process's peak less its memory before training), summed: "
          + "; ".join(f"W = {row['world']}: local {row['local_growth']:,.0f}, remote "
                      f"{row['remote_growth']:,.0f} + server {row['server_growth']:,.0f} MiB"
                      for row in rows))
    remote_vs_local = max(row["remote_vs_local"] for row in rows)
    vs_one = max(max(row["vs_one"]) for row in rows[1:])
    print(f"per-step losses, largest relative difference: remote vs local at the same W "
          f"{remote_vs_local:.1e} (bar {REMOTE_VS_LOCAL_BAR:.0e}); W = {w} vs W = 1 {vs_one:.1e} "
          f"(bar {WORLD_VS_ONE_BAR:.0e})")
    print("trainer peaks: each trainer process's ru_maxrss (torchrun's launcher not counted); "
          "server peak: VmHWM of a fresh remotehead-server per remote run, read after the run")
    return remote_vs_local <= REMOTE_VS_LOCAL_BAR and vs_one <= WORLD_VS_ONE_BAR
