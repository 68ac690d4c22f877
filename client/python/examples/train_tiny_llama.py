"""The main job: a tiny Llama body with Llama-3's vocabulary (128,256) trained with transformers'
Trainer on a small corpus shipped with the repository (corpus.txt: the license texts of Debian's
/usr/share/common-licenses), three times from the same initialisation and data order:

  local      — the model's own lm_head (transformers' default): every micro-batch builds the
               [tokens, vocab] logits, their fp32 log-softmax and its gradient — gigabytes;
  torch LCE  — the same local head, its loss through PyTorch's chunked
               torch.nn.functional.linear_cross_entropy (LinearCrossEntropyOptions()): the
               alternative a user tries first;
  remote     — the lm_head offloaded to a remotehead-server started here on the CPU; the trainer
               sends the last hidden states and gets dX back, the server accumulates dW and runs
               AdamW with the Trainer's settings (remotehead.hf.RemoteHeadCallback).

Each run is its own process, so its peak memory (ru_maxrss) is its own; a thread samples the
process's resident memory every few milliseconds, and the picture (--plot) draws those samples
over the training steps with the three loss curves. Prints a side-by-side table: loss, the
largest per-step loss difference against the local run, the trainer's peak memory and its growth
in training, tokens/s; then the saving. The vocabulary is a model's, larger than what the BPE
tokenizer learns from this small corpus: the unused rows cost what they cost in any model, and
the head's memory is what this compares.

--tied: a tiny Gemma-3-like model instead (Gemma3ForCausalLM: tied input embedding and head,
embeddings scaled by sqrt(hidden), vocabulary 262,208): the local runs keep the one tied matrix
(its gradient and AdamW state too), the remote run's embedding and head are both served (the
trainer holds no [V, D] tensor at all); the table gains the bytes of [V, D] tensors each trainer
held at the end (parameters, gradients, optimizer state).

--trainers W (W > 1): the cluster. The local and remote runs again with W data-parallel trainer
processes (torchrun, gloo, CPU; --batch stays the global micro-batch, each rank takes 1/W of it,
so every W sees the same global batches and, with transformers' average_tokens_across_devices,
the same global-token mean loss). The local head's memory — W, its gradient, its AdamW state,
the logits — is paid once per trainer; the remote head's once, on the server. A second table
(cluster_memory.py) sums the trainers' peaks and adds the server's, for W = 1 and W; each remote
run gets a fresh server, so its VmHWM is that run's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent

# The runs, in the table's column order: (name, column heading, line style in the picture).
VARIANTS = (("local", "local lm_head", "-"),
            ("torch-lce", "torch LCE", "--"),
            ("remote", "remote head", ":"))
COLUMN = {name: heading for name, heading, _ in VARIANTS}
# The closing line's bar: the remote head's trainer peak against the local head's (the seed
# challenge's target).
PEAK_SHARE_TARGET = 0.5
LLAMA3_VOCAB, GEMMA3_VOCAB = 128256, 262208


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-binary", default=str(HERE.parents[2] / "build" / "server" /
                                                  "remotehead-server"))
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=None,
                   help="the vocabulary (default: Llama 3's 128,256; Gemma 3's 262,208 with "
                        "--tied)")
    p.add_argument("--tied", action="store_true",
                   help="a Gemma-3-like model: tied input embedding and head, scaled embeddings")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--plot", default="remotehead-main-job.png",
                   help="where the picture goes (PNG); empty: no picture")
    p.add_argument("--trainers", type=int, default=1,
                   help="W > 1: also run the local and remote heads with W data-parallel "
                        "trainers (torchrun) and print the memory of all trainers and the server "
                        "for W = 1 and W (--batch stays the global micro-batch)")
    # Internal: one run in this process (the parent starts one process per variant; under
    # torchrun each rank writes its result to --result-dir).
    p.add_argument("--variant", choices=list(COLUMN), help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vocab is None:
        args.vocab = GEMMA3_VOCAB if args.tied else LLAMA3_VOCAB
    if args.trainers < 1 or args.batch % args.trainers:
        p.error(f"--trainers: expected a divisor of --batch ({args.batch}); got {args.trainers}")
    return args


def status_mib(pid, field: str) -> float:
    """A memory field of /proc/PID/status ("VmRSS:" now, "VmHWM:" the peak), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


class MemorySampler(threading.Thread):
    """Samples this process's resident memory every `interval` seconds until stopped; torch's
    kernels release the GIL, so the samples land inside forward and backward too."""

    def __init__(self, interval: float = 0.005):
        super().__init__(daemon=True)
        self.interval = interval
        self.samples = []  # (seconds since start, MiB)
        self._done = threading.Event()
        self._pagesize = os.sysconf("SC_PAGE_SIZE")
        self.start_time = time.perf_counter()

    def sample(self) -> float:
        """Takes one sample now and returns its time (seconds since start). The training loop
        also calls it at every step's start and at the end, so every step has samples at its
        bounds however the thread is scheduled on a busy machine."""
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
        t = time.perf_counter() - self.start_time
        self.samples.append((t, resident_pages * self._pagesize / 2**20))
        return t

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def samples_by_step(samples, step_starts, end):
    """Maps each (seconds, MiB) sample to a fractional training step: step i (0-based) runs from
    step_starts[i] to step_starts[i + 1] (the last to `end`). Samples before training are left
    out."""
    bounds = [*step_starts, end]
    out, i = [], 0
    for t, mib in sorted(samples):  # two threads append: sort by time
        if t < bounds[0] or t > bounds[-1]:
            continue
        while t > bounds[i + 1]:
            i += 1
        out.append((i + (t - bounds[i]) / (bounds[i + 1] - bounds[i]), mib))
    return out


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


def use_torch_linear_cross_entropy(model) -> None:
    """The model's training loss through PyTorch's chunked linear_cross_entropy on its own
    lm_head, reduced as transformers' ForCausalLMLoss (sum / num_items_in_batch, or the mean)."""
    import torch
    import torch.nn.functional as F

    import remotehead.hf

    weight = model.get_output_embeddings().weight
    options = torch.nn.LinearCrossEntropyOptions()

    def loss(hidden, shifted, num_items_in_batch):
        # linear_cross_entropy takes [N, H] and [N]: no [B, T, H] form.
        flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), shifted.reshape(-1)
        if num_items_in_batch is None:
            return F.linear_cross_entropy(flat_hidden, weight, flat_labels, ignore_index=-100,
                                          options=options)
        return F.linear_cross_entropy(flat_hidden, weight, flat_labels, reduction="sum",
                                      ignore_index=-100, options=options) / num_items_in_batch

    remotehead.hf.route_causal_lm_loss(model, loss)


def build_model(args, transformers):
    """The tiny model: a Llama with its own lm_head, or (--tied) a Gemma-3-like model whose
    scaled input embedding is its head."""
    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                 intermediate_size=2 * args.hidden, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=args.seq)
    if args.tied:
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **shape, head_dim=args.hidden // 4, tie_word_embeddings=True,
            sliding_window=args.seq))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape,
                                                                  tie_word_embeddings=False))


def vocab_matrix_bytes(trainer, args) -> int:
    """Bytes of the [V, D] tensors the trainer holds at the end of training: parameters,
    their gradients, the optimizer's state (each storage once)."""
    import torch

    seen, total = set(), 0
    tensors = [p for p in trainer.model.parameters()]
    tensors += [p.grad for p in tensors if p.grad is not None]
    if trainer.optimizer is not None:
        tensors += [v for state in trainer.optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
    for t in tensors:
        if tuple(t.shape) == (args.vocab, args.hidden):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def run_one(args) -> dict:
    """One training run in this process; returns its measurements."""
    import torch
    import transformers
    from tqdm import tqdm

    import remotehead
    import remotehead.hf

    # Under torchrun: this rank's share of the global micro-batch (--batch).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    data = corpus_token_windows(args)
    torch.manual_seed(0)
    model = build_model(args, transformers).float()
    callbacks = []
    client = None
    if args.variant == "remote":
        client = remotehead.Client(args.target)
        head = remotehead.hf.offload_lm_head(model, client, "tiny-llama")
        callbacks.append(remotehead.hf.RemoteHeadCallback(head))
    elif args.variant == "torch-lce":
        use_torch_linear_cross_entropy(model)

    losses, step_starts = [], []
    sampler = MemorySampler()

    class Progress(transformers.TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            desc = COLUMN[args.variant] + (f" x{world}" if world > 1 else "")
            self.bar = tqdm(total=state.max_steps, desc=f"{desc:>13}", unit="step",
                            file=sys.stderr, dynamic_ncols=True, disable=rank != 0)

        def on_step_begin(self, targs, state, control, **kwargs):
            step_starts.append(sampler.sample())

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
        per_device_train_batch_size=args.batch // world,
        gradient_accumulation_steps=args.accumulation, learning_rate=args.lr, weight_decay=0.01,
        max_grad_norm=0.0, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        seed=0, disable_tqdm=True, **({"ddp_backend": "gloo"} if world > 1 else {}))
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=data,
                                   callbacks=[*callbacks, Progress()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    before = status_mib("self", "VmRSS:")
    sampler.start()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    end = sampler.sample()
    sampler.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if client is not None:
        if world > 1:  # every rank is done with the head before rank 0 drops it
            torch.distributed.barrier()
        if rank == 0:
            client.drop_head("tiny-llama")
        client.close()
    tokens = args.steps * args.accumulation * args.batch * args.seq
    return {"variant": args.variant, "vd_bytes": vocab_matrix_bytes(trainer, args), "world_size": world, "rank": rank,
            "losses": losses, "seconds": seconds,
            "tokens_per_second": tokens / seconds, "peak_mib": peak,
            "rss_before_training_mib": before,
            "memory_by_step": samples_by_step(sampler.samples, step_starts, end)}


def run_variant(args, variant: str, target: str = "", world: int = 1) -> list:
    """One run of `variant` in its own process (world > 1: `world` trainer processes under
    torchrun); each process's result, by rank."""
    flags = [f"--variant={variant}", f"--target={target}",
             *[f"--{k}={getattr(args, k)}" for k in
               ("steps", "batch", "accumulation", "seq", "vocab", "hidden", "lr")],
             *(["--tied"] if args.tied else [])]
    if world == 1:
        child = [sys.executable, __file__, *flags]
        out = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True).stdout
        return [json.loads(out.split("RESULT ", 1)[1])]
    import cluster_memory
    return cluster_memory.torchrun_ranks(__file__, flags, world)


def relative_difference(losses, reference) -> float:
    """The largest per-step relative difference of `losses` against `reference`."""
    if len(losses) != len(reference):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def add_loss_deviations(results) -> dict:
    local = results["local"]["losses"]
    for variant in COLUMN:
        results[variant]["loss_deviation"] = relative_difference(results[variant]["losses"],
                                                                 local)
    results["loss_deviation"] = max(results[v]["loss_deviation"] for v in COLUMN)
    return results


def compare(args) -> dict:
    """Starts the server, runs the three variants (one process each), stops the server."""
    from remotehead.local_server import LocalServer

    results = {}
    with LocalServer(args.server_binary) as server:
        print(f"remotehead-server started on {server.target}", flush=True)
        for variant in COLUMN:
            results[variant] = run_variant(args, variant, server.target)[0]
        # The head's memory moved there: the server's own peak (W, its AdamW state, the
        # engine's chunks), for the record.
        results["server_peak_mib"] = status_mib(server.process.pid, "VmHWM:")
        results["server_exit_code"] = server.stop()
    return add_loss_deviations(results)


def compare_cluster(args) -> dict:
    """--trainers W: the three variants with one trainer (the first table and the picture), and
    the local and remote heads with W trainers; every remote run against a fresh server whose
    peak (VmHWM, read after the run) is that run's. results["runs"][(variant, W)]: the ranks'
    results; results["servers"][W]: (server peak MiB, exit code)."""
    from remotehead.local_server import LocalServer

    runs, servers = {}, {}
    for world in (1, args.trainers):
        for variant in ("local", "torch-lce") if world == 1 else ("local",):
            runs[variant, world] = run_variant(args, variant, world=world)
        with LocalServer(args.server_binary) as server:
            print(f"remotehead-server started on {server.target} (W = {world})", flush=True)
            started = status_mib(server.process.pid, "VmRSS:")
            runs["remote", world] = run_variant(args, "remote", server.target, world)
            peak = status_mib(server.process.pid, "VmHWM:")
            servers[world] = (peak, server.stop(), started)
        print(f"remotehead-server stopped (exit code {servers[world][1]})", flush=True)
    results = {variant: runs[variant, 1][0] for variant in COLUMN}
    results["server_peak_mib"] = servers[1][0]
    results["server_exit_code"] = next((s[1] for s in servers.values() if s[1]), 0)
    results["runs"], results["servers"] = runs, servers
    return add_loss_deviations(results)


def print_table(results) -> None:
    runs = [results[name] for name in COLUMN]

    def growth(run):
        return run["peak_mib"] - run["rss_before_training_mib"]

    rows = [
        ("loss, first step", lambda r: r["losses"][0], "{:.4f}"),
        ("loss, last step", lambda r: r["losses"][-1], "{:.4f}"),
        ("largest step loss diff (rel)", lambda r: r["loss_deviation"], "{:.1e}"),
        ("trainer peak memory (MiB)", lambda r: r["peak_mib"], "{:.0f}"),
        ("  before training (MiB)", lambda r: r["rss_before_training_mib"], "{:.0f}"),
        ("  growth in training (MiB)", growth, "{:.0f}"),
        ("tokens/s", lambda r: r["tokens_per_second"], "{:.0f}"),
        ("[V, D] tensors held (MiB)", lambda r: r["vd_bytes"] / 2**20, "{:.1f}"),
    ]
    print()
    print(f"{'':30}" + "".join(f"{heading:>16}" for heading in COLUMN.values()))
    for name, value, fmt in rows:
        print(f"{name:30}" + "".join(f"{fmt.format(value(run)):>16}" for run in runs))
    local, remote = results["local"], results["remote"]
    print(f"\nper-step losses against the local run over {len(local['losses'])} steps: largest "
          f"relative difference {results['loss_deviation']:.1e} (bar: 1e-4)")
    print(f"remotehead-server peak memory: {results['server_peak_mib']:.0f} MiB "
          f"(the head, its AdamW state and the engine's chunks now live there)")
    saved = local["peak_mib"] - remote["peak_mib"]
    share = remote["peak_mib"] / local["peak_mib"]
    print(f"trainer peak memory saved by the remote head: {saved:.0f} MiB, "
          f"{100 * saved / local['peak_mib']:.0f}% of the local-head run's peak "
          f"({100 * saved / growth(local):.0f}% of its growth in training); the remote run's "
          f"peak is {100 * share:.0f}% of the local run's "
          f"({'meets' if share <= PEAK_SHARE_TARGET else 'misses'} the "
          f"{100 * PEAK_SHARE_TARGET:.0f}% target)")


def plot(results, args, path: str) -> None:
    """The picture: sampled trainer memory over the training steps (top) and the per-step
    losses (bottom), the three runs on top of each other."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, loss) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 2]})
    tokens = args.batch * args.accumulation * args.seq
    model = "tiny Gemma-3-like, tied" if args.tied else "tiny Llama"
    fig.suptitle(f"{model}, vocab {args.vocab:,}, {args.steps} steps of {tokens:,} tokens "
                 f"({args.accumulation} micro-batches), CPU")
    colors = ("tab:red", "tab:orange", "tab:blue")
    for i, ((name, heading, style), color) in enumerate(zip(VARIANTS, colors)):
        run = results[name]
        steps, mib = zip(*run["memory_by_step"]) if run["memory_by_step"] else ((), ())
        memory.plot(steps, mib, style, color=color, linewidth=1.2,
                    label=f"{heading} (peak {run['peak_mib']:,.0f} MiB)")
        loss.plot(range(1, len(run["losses"]) + 1), run["losses"], style, color=color,
                  marker="o", markersize=7 - 2 * i,
                  label=heading)
    memory.set_ylabel("trainer resident memory (MiB)")
    # Head room above the highest sample for the legend.
    top = max(results[name]["peak_mib"] for name in COLUMN)
    memory.set_ylim(0, 1.3 * top)
    memory.legend(loc="upper right")
    memory.grid(alpha=0.3)
    memory.set_title("sampled every 5 ms", fontsize=9)
    loss.set_ylabel("training loss")
    loss.set_xlabel("training steps done")
    loss.legend(loc="upper right")
    loss.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variant:
        result = run_one(args)
        if args.result_dir:
            path = pathlib.Path(args.result_dir) / f"rank{result['rank']}.json"
            path.write_text(json.dumps(result))
        else:
            print("RESULT " + json.dumps(result), flush=True)
        # Under torchrun Trainer made a process group: every rank done, then it is torn down
        # before the interpreter exits (docs/data-parallel.md, "Ending the processes").
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    tokens = args.batch * args.seq
    model = "tiny Gemma-3-like model, tied and scaled embeddings" if args.tied else "tiny Llama"
    print(f"main job: {model} (2 layers, hidden {args.hidden}, vocab {args.vocab:,}), "
          f"{args.steps} steps of {args.accumulation} micro-batches x {tokens:,} tokens; "
          f"local logits: {tokens * args.vocab * 4 / 2**30:.2f} GiB per micro-batch (fp32); CPU",
          flush=True)
    if args.trainers > 1:
        import cluster_memory
        results = compare_cluster(args)
        cluster = cluster_memory.summarize(results["runs"], results["servers"], args,
                                           relative_difference)
    else:
        results = compare(args)
        print(f"remotehead-server stopped (exit code {results['server_exit_code']})")
    print_table(results)
    agree = results["loss_deviation"] <= 1e-4
    if args.trainers > 1:
        agree = cluster_memory.print_table(cluster) and agree
    if args.plot:
        plot(results, args, args.plot)
        print(f"picture: {args.plot}")
    if not agree:
        print("FAILED: the per-step losses differ by more than 1e-4 (relative)", file=sys.stderr)
    return 0 if results["server_exit_code"] == 0 and agree else 1


if __name__ == "__main__":
    sys.exit(main())
