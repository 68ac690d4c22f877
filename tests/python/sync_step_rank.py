"""One trainer rank of test_data_parallel.py's synchronous-step tests, as its own process: adds
its micro-batch's dW to head --head-id under its own identity (run/rank-R, step --step), then
asks for the synchronous SGD step (--step, rank R of --world) — or, with --die-before-step,
SIGKILLs itself first. With --wait-for PATH it starts (Python, torch, the client) and then waits
for PATH to exist before its micro-batch, so that a test can have it ready before another rank is
held at the step. Prints one JSON line: the answer's version, or the error's code and message."""

import argparse
import json
import os
import pathlib
import signal
import time

import torch

import remotehead

ROWS, VOCAB, HIDDEN = 24, 97, 16


def batch(rank: int):
    """Rank `rank`'s rows and targets (seeded by the rank: the test rebuilds them)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(ROWS, HIDDEN, generator=generator),
            torch.randint(0, VOCAB, (ROWS,), generator=generator))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--head-id", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--grad-scale", type=float, default=None)
    parser.add_argument("--die-before-step", action="store_true")
    parser.add_argument("--wait-for", default="")
    args = parser.parse_args()
    client = remotehead.Client(args.server)
    client.describe_head(args.head_id)  # connected and the head there before any wait
    deadline = time.monotonic() + 120
    while args.wait_for and not pathlib.Path(args.wait_for).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"--wait-for: {args.wait_for} did not appear within 120 s")
        time.sleep(0.01)
    hidden, targets = batch(args.rank)
    result = client.forward_backward(
        args.head_id, hidden, targets, reduction="sum", accumulate=True,
        gradient_id=remotehead.GradientId(f"run/rank-{args.rank}", args.step, 0))
    if args.die_before_step:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        info = client.optimizer_step(args.head_id, sgd=dict(lr=args.lr),
                                     grad_scale=args.grad_scale, zero_gradients=True,
                                     synchronous=(args.step, args.rank, args.world))
        print(json.dumps({"version": info.weight_version, "replayed": result.summary.replayed}))
    except remotehead.RemoteheadError as e:
        print(json.dumps({"code": e.code.name, "details": e.details}))


if __name__ == "__main__":
    main()
