"""One TRL DistillationTrainer run of test_trl_distillation.py's data-parallel test, run by
torchrun (gloo, CPU): the tiny student and teacher Llamas, the character tokenizer and prompts of
test_trl_distillation.py; a few optimizer steps of gradient accumulation 2, on-policy
completions of up to 6 tokens, a fixed seed. With --server both heads are on the server
(offload_distillation_heads, the same call on every rank), without it plain DistillationTrainer
with the models' own heads. Rank 0 writes the logged losses and metrics, the student's head (from
the server, or the local lm_head), its version and the body's parameters to --out
(torch.save)."""

import argparse
import os
import pathlib

import torch
from trl import DistillationConfig, DistillationTrainer

import remotehead
from ddp_trainer_job import end_process_group, save_trainer_outcome
from remotehead.trl import offload_distillation_heads
from test_trl_distillation import make, prompts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="")
    parser.add_argument("--head-id", default="ddp-distill")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = pathlib.Path(args.out)
    config = DistillationConfig(
        output_dir=str(out.parent / f"{out.stem}-trainer"), use_cpu=True, bf16=False, seed=0,
        activation_checkpointing=False, report_to="none", save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_completion_length=6, max_steps=args.steps, beta=args.beta, temperature=0.9,
        # No clipping: the local run would clip the head with the body, the server's head is
        # not clipped. AdamW eps 1e-6: elements with a ~0 gradient are not normalised to ±lr.
        learning_rate=3e-3, adam_epsilon=1e-6, max_grad_norm=0.0, logging_steps=1,
        ddp_backend="gloo" if world > 1 else None)
    # 2 ranks × 2 prompts × 2 micro-batches a step: 24 prompts are 3 steps.
    trainer = make(DistillationTrainer, config, dataset=prompts(24))
    client = None
    if args.server:
        client = remotehead.Client(args.server)
        offload_distillation_heads(trainer, client, args.head_id)
    trainer.train()
    save_trainer_outcome(trainer, client, args, world)


if __name__ == "__main__":
    main()
    end_process_group()
