"""The sizing table of docs/meshes.md, computed from the cost model (one home for its numbers:
tests/python/test_mesh.py checks that the doc shows what this prints).

Per global step, a trainer (one data-parallel rank of the body) with N tokens costs its replica
6·N·D·V FLOP (the fused head: logits, dX, dW), and costs itself about 6·N·P FLOP for a body of P
parameters. A replica of K GPUs keeps up with T trainers while T·6NDV / (K·F) <= 6NP / F_t, so
with the same GPUs (F = F_t):

    trainers per replica  T = K · P / (D · V)        (independent of N)

The wire: each trainer sends X and receives dX, N·D·2 bytes each way in bf16, so a replica's
front moves T·N·D·2 bytes each way per step. The mesh sums dW once per step: every rank
reduces and then broadcasts (V/K)·D·4 bytes (fp32) with its shard peers.

R = ceil(W / T) replicas serve W trainers. The times below assume GPUs that sustain F =
700 TFLOP/s of dense bf16 GEMMs (an H100 SXM's achieved rate, not measured here: no GPU was
lent to this project's sessions yet; scripts/bench-gpu measures it) and 400 Gb/s links.
"""

import argparse
import math

F = 700e12          # FLOP/s per GPU, dense bf16, achieved (assumed)
LINK = 400e9 / 8    # bytes/s per link (400 Gb/s)

# name, D, V, body parameters P (without the head), tokens per trainer and step N
MODELS = [
    ("Llama-3.1-8B", 4096, 128256, 6.98e9, 16384),
    ("Qwen2.5-7B", 3584, 152064, 6.53e9, 16384),
    ("Gemma-2-9B", 3584, 256000, 8.32e9, 16384),
    ("Llama-3.1-70B", 8192, 128256, 68.98e9, 16384),
]


def row(name, d, v, p, n, k, world):
    per_replica = k * p / (d * v)
    replicas = math.ceil(world / max(1, math.floor(per_replica)))
    served = math.ceil(world / replicas)  # the trainers of the busiest replica
    body_ms = 6 * n * p / F * 1e3
    head_ms = served * 6 * n * d * v / (k * F) * 1e3
    wire_ms = served * n * d * 2 / LINK * 1e3
    reduce_ms = (2 * (v / k) * d * 4 / LINK * 1e3) if replicas > 1 else 0.0
    return (f"| {name} | {d} | {v} | {k} | {per_replica:.1f} | {replicas} | {served} | "
            f"{body_ms:.0f} | {head_ms:.0f} | {wire_ms:.0f} | {reduce_ms:.0f} |")


def table(world: int = 64) -> str:
    lines = [f"W = {world} trainers, N = {MODELS[0][4]} tokens per trainer and step, "
             f"{F / 1e12:.0f} TFLOP/s per GPU, {LINK * 8 / 1e9:.0f} Gb/s links:",
             "",
             "| model | D | V | K | trainers per replica | R | trainers on a replica "
             "| trainer step ms | head ms | wire ms | dW sum ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, d, v, p, n in MODELS:
        for k in (1, 8):
            lines.append(row(name, d, v, p, n, k, world))
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=64, help="trainers W (default 64)")
    print(table(parser.parse_args().world))
