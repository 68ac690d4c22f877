"""The distillation main job (scripts/demo --distill): a tiny Llama teacher (hidden 64) distilled
into a tiny Llama student (hidden 32), both with Llama-3's vocabulary (128,256), three times
from the same initialisation and data, each run in a process of its own:

  local   — both lm_heads on the trainer, the loss from both models' full logits: the teacher's
            [tokens, vocab] logits and log-softmax (no_grad), the student's with their gradient
            — what a distillation loop (TRL's GKD generalized_jsd_loss) does by default;
  trl     — both lm_heads on the trainer, the loss through TRL's own chunked path
            (trl.trainer.distillation_trainer._chunked_divergence_loss, the DistillationTrainer's
            loss): no full logits, but both W (and the student's dW and AdamW state) here;
  remote  — both heads on a remotehead-server started here: the student's trained there
            (AdamW on the server), the teacher's uploaded frozen; neither W on the trainer; each
            step sends both last hidden states and gets the student's dX back.

The loss is TRL's generalized JSD (beta 0.5, temperature 1) over the completion positions, mean
over them. Prints the per-step losses' largest difference against the local run, the trainer's
peak memory (ru_maxrss) and its growth in training, tokens/s; exits 1 when a run's losses
differ from the local run's by more than 1e-4 (relative) or the remote run's peak is above
--peak-share (0.35) of the local run's.
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
RUNS = (("local", "local heads"), ("trl", "TRL chunked"), ("remote", "remote heads"))
BETA, PROMPT, LR = 0.5, 16, 1e-3
STUDENT_ID, TEACHER_ID = "distill-student", "distill-teacher"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-binary", default=str(HERE.parents[2] / "build" / "server" /
                                                  "remotehead-server"))
    p.add_argument("--vocab", type=int, default=128256, help="V of both models (Llama-3's)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    p.add_argument("--seq", type=int, default=2048, help="tokens per step (one sequence)")
    p.add_argument("--peak-share", type=float, default=0.35,
                   help="the bar: remote trainer peak / local trainer peak")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--one", choices=[name for name, _ in RUNS], help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def tiny_llama(vocab: int, hidden: int, seed: int):
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                      intermediate_size=2 * hidden, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def full_logits_jsd(student_logits, teacher_logits, mask):
    """TRL's generalized JSD from full logits (trl.experimental.gkd's generalized_jsd_loss):
    mixture log m = logsumexp(log p_s + log(1 − β), log p_t + log β); mean over the mask."""
    import math

    import torch
    log_ps = torch.log_softmax(student_logits.float(), -1)
    log_pt = torch.log_softmax(teacher_logits.float(), -1)
    log_m = torch.logsumexp(torch.stack([log_ps + math.log(1 - BETA),
                                         log_pt + math.log(BETA)]), 0)
    kl = torch.nn.functional.kl_div
    jsd = (BETA * kl(log_m, log_pt, reduction="none", log_target=True)
           + (1 - BETA) * kl(log_m, log_ps, reduction="none", log_target=True)).sum(-1)
    return jsd[mask].mean()


def run_one(args) -> dict:
    """One run in this process; its losses, peak memory and speed."""
    import torch

    import remotehead
    import remotehead.hf
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    student = tiny_llama(args.vocab, 32, seed=0)
    teacher = tiny_llama(args.vocab, 64, seed=1).eval()
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, args.seq, dtype=torch.bool)
    mask[:, :PROMPT] = False  # the prompt: no loss
    head = None
    if args.one == "remote":
        client = remotehead.Client(args.target)
        remotehead.hf.offload_lm_head(teacher, client, TEACHER_ID, frozen=True)
        head = remotehead.hf.offload_lm_head(student, client, STUDENT_ID)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    losses, start = [], time.perf_counter()
    for _ in range(args.steps):
        student_hidden = student.model(input_ids=ids).last_hidden_state
        with torch.no_grad():
            teacher_hidden = teacher.model(input_ids=ids).last_hidden_state
        if head is not None:
            loss = head.distill(student_hidden, teacher_hidden, mask=mask, teacher=TEACHER_ID,
                                function="distill_jsd", params={"beta": BETA})
        elif args.one == "trl":
            loss, _, _ = _chunked_divergence_loss(
                student_hidden, teacher_hidden, student.lm_head.weight, teacher.lm_head.weight,
                mask, BETA)
        else:
            with torch.no_grad():
                teacher_logits = teacher.lm_head(teacher_hidden)
            loss = full_logits_jsd(student.lm_head(student_hidden), teacher_logits, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if head is not None:
            head.optimizer_step(adamw=dict(lr=LR, weight_decay=0.0))
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held = sum(m.lm_head.weight.untyped_storage().nbytes() for m in (student, teacher))
    if head is not None:
        client.drop_head(STUDENT_ID)
        client.drop_head(TEACHER_ID)
    return {"losses": losses, "peak_mib": peak, "before_mib": before,
            "tokens_per_s": args.steps * int(mask.sum()) / seconds, "trainer_head_bytes": held}


def run_all(args) -> dict:
    from remotehead.local_server import LocalServer
    results = {}
    with LocalServer(args.server_binary) as server:
        for name, _ in RUNS:
            child = [sys.executable, __file__, "--one", name, "--target", server.target,
                     "--vocab", str(args.vocab), "--steps", str(args.steps),
                     "--seq", str(args.seq)]
            out = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
    reference = results["local"]["losses"]
    for run in results.values():
        run["loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12)
                               for a, b in zip(run["losses"], reference))
    return results


def print_table(args, results) -> bool:
    """The table and the verdict; True when every bar is met."""
    local_gib = args.seq * args.vocab * 4 / 2 ** 30
    print(f"distillation main job: tiny Llama teacher (hidden 64) -> student (hidden 32), "
          f"vocab {args.vocab:,}, {args.steps} steps of {args.seq:,} tokens; each model's local "
          f"logits: {local_gib:.2f} GiB (fp32); generalized JSD beta {BETA}; CPU\n")
    print(f"{'':32}" + "".join(f"{heading:>15}" for _, heading in RUNS))
    rows = [("loss, first step", lambda r: f"{r['losses'][0]:.6f}"),
            ("loss, last step", lambda r: f"{r['losses'][-1]:.6f}"),
            ("largest step loss diff (rel)", lambda r: f"{r['loss_diff']:.1e}"),
            ("trainer peak memory (MiB)", lambda r: f"{r['peak_mib']:.0f}"),
            ("  before training (MiB)", lambda r: f"{r['before_mib']:.0f}"),
            ("  growth in training (MiB)", lambda r: f"{r['peak_mib'] - r['before_mib']:.0f}"),
            ("lm_head bytes on the trainer", lambda r: f"{r['trainer_head_bytes']:,}"),
            ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}")]
    for label, cell in rows:
        print(f"{label:32}" + "".join(f"{cell(results[name]):>15}" for name, _ in RUNS))
    share = results["remote"]["peak_mib"] / results["local"]["peak_mib"]
    worst = max(r["loss_diff"] for r in results.values())
    ok_peak, ok_loss = share <= args.peak_share, worst <= 1e-4
    print(f"\nper-step losses against the local run: largest relative difference {worst:.1e} "
          f"(bar: 1e-4){'' if ok_loss else ' -- FAILED'}")
    print(f"the remote run's trainer peak is {share:.0%} of the local run's "
          f"({'meets' if ok_peak else 'FAILS'} the {args.peak_share:.0%} target); TRL's chunked "
          f"path: {results['trl']['peak_mib'] / results['local']['peak_mib']:.0%}")
    return ok_peak and ok_loss


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    results = run_all(args)
    ok = print_table(args, results)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
