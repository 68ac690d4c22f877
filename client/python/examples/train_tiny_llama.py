"""The main job: a tiny Llama trained with transformers' Trainer on a small corpus shipped with
the repository (corpus.txt: the license texts of Debian's /usr/share/common-licenses), twice
from the same initialisation and data order:

  local  — the model's own lm_head: Trainer builds the [tokens, vocab] logits every micro-batch;
  remote — the lm_head offloaded to a remotehead-server started here on the CPU; the trainer
           sends the last hidden states and gets dX back, the server accumulates dW and runs
           AdamW with the Trainer's settings (remotehead.hf.RemoteHeadCallback).

Each run is its own process, so its peak memory (ru_maxrss) is its own. Prints a side-by-side
table: loss, the trainer's peak memory, tokens/s. The vocabulary is a model's (65,536 by
default, --vocab), larger than what the BPE tokenizer learns from this small corpus: the unused
rows cost what they cost in any model, and the head's memory is what this compares.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-binary", default=str(HERE.parents[2] / "build" / "server" /
                                                  "remotehead-server"))
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=3, help="sequences per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    # Internal: one run in this process (the parent starts one process per variant).
    p.add_argument("--variant", choices=["local", "remote"], help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def corpus_token_windows(args):
    """Windows of seq tokens from the BPE-encoded corpus, in a fixed pseudo-random order."""
    import tokenizers
    import torch

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(
        [(HERE / "corpus.txt").read_text()],
        tokenizers.trainers.BpeTrainer(vocab_size=min(args.vocab, 4096), show_progress=False,
                                       special_tokens=["<unk>"]))
    ids = torch.tensor(tokenizer.encode((HERE / "corpus.txt").read_text()).ids)
    generator = torch.Generator().manual_seed(0)
    count = args.steps * args.accumulation * args.batch
    starts = torch.randint(0, len(ids) - args.seq, (count,), generator=generator)
    return [{"input_ids": ids[s:s + args.seq], "labels": ids[s:s + args.seq]} for s in starts]


def run_one(args) -> dict:
    """One training run in this process; returns its measurements."""
    import torch
    import transformers
    from tqdm import tqdm

    import remotehead
    import remotehead.hf

    data = corpus_token_windows(args)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    callbacks = []
    client = None
    if args.variant == "remote":
        client = remotehead.Client(args.target)
        head = remotehead.hf.offload_lm_head(model, client, "tiny-llama")
        callbacks.append(remotehead.hf.RemoteHeadCallback(head))

    losses = []

    class Progress(transformers.TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc=f"{args.variant:>6} head", unit="step",
                            file=sys.stderr, dynamic_ncols=True)

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
                self.bar.set_postfix(loss=f"{logs['loss']:.3f}")

        def on_step_end(self, targs, state, control, **kwargs):
            self.bar.update(1)

        def on_train_end(self, targs, state, control, **kwargs):
            self.bar.close()

    training_args = transformers.TrainingArguments(
        output_dir=f"/tmp/remotehead-main-job-{args.variant}", max_steps=args.steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulation,
        learning_rate=args.lr, weight_decay=0.01, max_grad_norm=0.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=data,
                                   callbacks=[*callbacks, Progress()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    before = rss_mib()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if client is not None:
        client.drop_head("tiny-llama")
        client.close()
    tokens = args.steps * args.accumulation * args.batch * args.seq
    return {"variant": args.variant, "losses": losses, "seconds": seconds,
            "tokens_per_second": tokens / seconds, "peak_mib": peak,
            "rss_before_training_mib": before}


def compare(args) -> dict:
    """Starts the server, runs both variants (one process each), stops the server."""
    from remotehead.local_server import LocalServer

    results = {}
    with LocalServer(args.server_binary) as server:
        print(f"remotehead-server started on {server.target}", flush=True)
        for variant in ("local", "remote"):
            child = [sys.executable, __file__, f"--variant={variant}", f"--target={server.target}",
                     *[f"--{k}={getattr(args, k)}" for k in
                       ("steps", "batch", "accumulation", "seq", "vocab", "hidden", "lr")]]
            out = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True).stdout
            results[variant] = json.loads(out.split("RESULT ", 1)[1])
        results["server_exit_code"] = server.stop()
    local, remote = results["local"], results["remote"]
    results["loss_deviation"] = max(abs(a - b) / abs(b)
                                    for a, b in zip(remote["losses"], local["losses"]))
    return results


def print_table(results) -> None:
    local, remote = results["local"], results["remote"]

    def mean(xs):
        return sum(xs) / len(xs)

    rows = [
        ("loss, first 10 steps (mean)", mean(local["losses"][:10]), mean(remote["losses"][:10]),
         "{:.4f}"),
        ("loss, last 10 steps (mean)", mean(local["losses"][-10:]), mean(remote["losses"][-10:]),
         "{:.4f}"),
        ("trainer peak memory (MiB)", local["peak_mib"], remote["peak_mib"], "{:.0f}"),
        ("  before training (MiB)", local["rss_before_training_mib"],
         remote["rss_before_training_mib"], "{:.0f}"),
        ("  growth in training (MiB)", local["peak_mib"] - local["rss_before_training_mib"],
         remote["peak_mib"] - remote["rss_before_training_mib"], "{:.0f}"),
        ("tokens/s", local["tokens_per_second"], remote["tokens_per_second"], "{:.0f}"),
    ]
    print()
    print(f"{'':32}{'local head':>14}{'remote head':>14}")
    for name, a, b, fmt in rows:
        print(f"{name:32}{fmt.format(a):>14}{fmt.format(b):>14}")
    saved = local["peak_mib"] - remote["peak_mib"]
    growth = local["peak_mib"] - local["rss_before_training_mib"]
    print(f"\nper-step losses: largest relative difference {results['loss_deviation']:.1e} "
          f"over {len(local['losses'])} steps")
    print(f"trainer peak memory saved by the remote head: {saved:.0f} MiB "
          f"({100 * saved / local['peak_mib']:.0f}% of the local-head run's peak, "
          f"{100 * saved / growth:.0f}% of its growth in training)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    tokens = args.batch * args.accumulation * args.seq
    print(f"main job: tiny Llama (2 layers, hidden {args.hidden}, vocab {args.vocab}), "
          f"{args.steps} steps of {tokens} tokens ({args.accumulation} micro-batches), CPU",
          flush=True)
    results = compare(args)
    print(f"remotehead-server stopped (exit code {results['server_exit_code']})")
    print_table(results)
    return 0 if results["server_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
