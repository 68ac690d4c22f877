"""The RL policy losses on a real server: each TRL loss type as one server call (the policy
function, ForwardBackward) against the two-phase path the trainer used before for everything but
grpo/bnpo/dr_grpo/dapo (a Forward of the log-probs that keeps X on the server, TRL's loss on
[N] log-probs in torch with autograd, a Backward of dL/dlogp), measured in the same run on the
same head and rows. Both compute the same loss, dX and dW (checked with --check); the table
prints their median times and the ratio.

    python tests/bench/rl_bench.py --server-binary build/server/remotehead-server \\
        --shape 4096:1024:32000 --repeats 3

A row-coupled variant (sequence-level ratios, vespo) costs one logits GEMM more than a
token-level one on the server — it computes the call's log-probs first — and saves the
two-phase path's round trip and its [N] transfers.
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "client" / "python"), str(ROOT / "tests" / "python")]

import remotehead  # noqa: E402
import references  # noqa: E402  (the policy losses written as TRL writes them)
from remotehead.local_server import LocalServer  # noqa: E402

SEQUENCE = 64  # tokens per completion

# (label, server function, params): TRL's loss types and levels.
VARIANTS = [
    ("dapo (token)", "grpo", {"epsilon_high": 0.28, "beta": 0.04}),
    ("grpo GSPO (sequence)", "grpo", {"sequence_level": 1.0, "beta": 0.04}),
    ("cispo", "cispo", {"epsilon_high": 5.0}),
    ("sapo", "sapo", {}),
    ("vespo", "vespo", {}),
    ("dapo + off-policy mask", "grpo", {"off_policy_mask": 1.0, "off_policy_threshold": 0.05}),
]


def resolved(function, given, listing):
    params = {p.name: p.default for p in listing[function].params if not p.common}
    params.update(given)
    return params


def inputs(n, d, v, weight, g):
    hidden = torch.randn(n, d, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None])[:, 0]
    sequences = torch.arange(n) // SEQUENCE
    aux = {"advantages": torch.randn(n // SEQUENCE + 1, generator=g)[sequences],
           "old_logprobs": logp + 0.2 * torch.randn(n, generator=g),
           "ref_logprobs": logp + 0.2 * torch.randn(n, generator=g),
           "sampling_logprobs": logp + 0.2 * torch.randn(n, generator=g),
           "sequence_ids": sequences}
    return hidden, targets, aux


def two_phase_loss(function, logp, aux, params, weights, normalizer):
    """TRL's loss on the log-probs (references.py's, as the trainer's fallback ran TRL's)."""
    coupled = (function == "vespo" or params.get("sequence_level") or
               params.get("off_policy_mask"))
    inputs64 = {k: v.double() for k, v in aux.items() if k != "sequence_ids"}
    if not coupled:
        y = references._policy_sequence(function, logp, inputs64, params)
    else:
        parts = []
        for s in range(int(aux["sequence_ids"].max()) + 1):
            rows = slice(s * SEQUENCE, (s + 1) * SEQUENCE)
            parts.append(references._policy_sequence(
                function, logp[rows], {k: v[rows] for k, v in inputs64.items()}, params))
        y = torch.cat(parts)
    return (y * weights).sum() / normalizer


def run_fused(client, head, hidden, targets, function, params, aux, weights, normalizer, step):
    result = client.forward_backward(head, hidden, targets, function=function, params=params,
                                     aux=aux, reduction="weighted_sum", weights=weights,
                                     normalizer=normalizer, gradient_id=("fused", step, 0))
    return result.loss, result.grad_hidden


def run_two_phase(client, head, hidden, targets, function, params, aux, weights, normalizer,
                  step):
    forward = client.forward(head, hidden, targets, function="token_logprobs",
                             reduction="none", retain_inputs_seconds=60.0)
    logp = forward.outputs.double().requires_grad_()
    loss = two_phase_loss(function, logp, aux, params, weights.double(), normalizer)
    loss.backward()
    options = remotehead.StepOptions(function="token_logprobs", reduction="none",
                                     gradient_id=("two-phase", step, 0),
                                     inputs_handle=forward.summary.inputs_handle)
    result = client.backward(head, hidden, targets, logp.grad.float(), options)
    return loss.item(), result.grad_hidden


def timed(fn, repeats, warmup):
    times, out = [], None
    for i in range(warmup + repeats):
        start = time.perf_counter()
        out = fn(i)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-binary", default=str(ROOT / "build/server/remotehead-server"))
    parser.add_argument("--shape", default="2048:512:32000", help="N:D:V")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--check", action="store_true",
                        help="fail unless both paths give the same loss and dX (1e-4)")
    args = parser.parse_args()
    n, d, v = (int(x) for x in args.shape.split(":"))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(v, d, generator=g) / d ** 0.5
    hidden, targets, aux = inputs(n, d, v, weight, g)
    weights = torch.ones(n)
    normalizer = float(n)
    server = LocalServer(args.server_binary).start()
    failures = []
    try:
        with remotehead.Client(server.target) as client:
            client.upload_head("rl", weight)
            listing = client.functions()
            print(f"RL policy losses, N={n} D={d} V={v}, {SEQUENCE} tokens per sequence, "
                  f"fp32 head, CPU server; median of {args.repeats}")
            print(f"{'variant':<26} {'one call (s)':>13} {'two-phase (s)':>14} {'ratio':>7}")
            for label, function, given in VARIANTS:
                params = resolved(function, given, listing)
                call_aux = {k: t for k, t in aux.items()
                            if k in listing[function].required_aux + listing[function].optional_aux}
                fused_time, (fused_loss, fused_dx) = timed(
                    lambda i: run_fused(client, "rl", hidden, targets, function, params,
                                        call_aux, weights, normalizer, i),
                    args.repeats, args.warmup)
                client.zero_gradients("rl")
                two_time, (two_loss, two_dx) = timed(
                    lambda i: run_two_phase(client, "rl", hidden, targets, function, params,
                                            call_aux, weights, normalizer, i),
                    args.repeats, args.warmup)
                client.zero_gradients("rl")
                print(f"{label:<26} {fused_time:>13.3f} {two_time:>14.3f} "
                      f"{two_time / fused_time:>6.2f}x")
                loss_error = abs(fused_loss - two_loss) / max(abs(two_loss), 1e-3)
                dx_error = ((fused_dx - two_dx).abs().max() /
                            two_dx.abs().max().clamp(min=1e-12)).item()
                if args.check and not (loss_error <= 1e-4 and dx_error <= 1e-4):
                    failures.append(f"{label}: loss off by {loss_error:.3g}, dX by {dx_error:.3g}")
    finally:
        server.stop()
    if failures:
        print("\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
