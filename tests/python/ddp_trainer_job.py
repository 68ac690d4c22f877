"""One transformers Trainer run of test_data_parallel.py, run by torchrun (or plainly, for one
process): a tiny Llama from a config (fixed seeds, no download), gradient accumulation, AdamW
with weight decay and a linear schedule. With --server the head is offloaded exactly as for one
process — offload_lm_head + RemoteHeadCallback, the same call on every rank. Rank 0 writes the
logged losses, the head (from the server, or the local lm_head) and the body's parameters to
--out (torch.save)."""

import argparse
import os
import signal

import torch
import transformers

import remotehead
import remotehead.hf
from test_hf_trainer import SEQ, VOCAB, tiny_llama  # the one-process tests' tiny Llama


def dataset(rows, seed=2):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        labels = ids.clone()
        # Prompts of varying length: micro-batches and ranks differ in valid tokens.
        labels[: int(torch.randint(1, 6, (1,), generator=generator))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


class Killed(Exception):
    pass


class KillAt(transformers.TrainerCallback):
    """SIGKILL to a server process at the end of step `step` (by rank 0), then this run ends:
    a rank of the head's mesh lost mid-run."""

    def __init__(self, step, pid):
        self.step, self.pid = step, pid

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if state.is_world_process_zero:
                os.kill(self.pid, signal.SIGKILL)
            raise Killed(f"killed server process {self.pid} at step {self.step}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="",
                        help="a server's address, or a mesh's replica fronts, comma-separated")
    parser.add_argument("--head-id", default="ddp-trainer")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--average-tokens", type=int, default=1)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", default="", help="a checkpoint directory to resume from "
                        "(the head is on the server already: not uploaded)")
    parser.add_argument("--kill-at", default="", help="STEP:PID: rank 0 sends SIGKILL to PID "
                        "(a server process) at the end of that step, then stops this run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

    model = tiny_llama(tied=False)
    callbacks = []
    client = None
    if args.server:
        fronts = args.server.split(",")
        client = remotehead.Client(fronts if len(fronts) > 1 else args.server)
        head = remotehead.hf.offload_lm_head(model, client, args.head_id,
                                             upload=not args.resume)
        callbacks.append(remotehead.hf.RemoteHeadCallback(head))
    if args.kill_at:
        step, pid = (int(x) for x in args.kill_at.split(":"))
        callbacks.append(KillAt(step, pid))
    training = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, learning_rate=3e-3, weight_decay=0.01,
        lr_scheduler_type="linear", max_grad_norm=0.0, adam_epsilon=1e-6, logging_steps=1, report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True,
        **(dict(save_strategy="steps", save_steps=args.save_steps) if args.save_steps
           else dict(save_strategy="no")),
        average_tokens_across_devices=bool(args.average_tokens),
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset(args.rows),
                                   eval_dataset=dataset(12, seed=5), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume or None)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    # Evaluation: every rank its share of the rows, the losses gathered (a Forward each).
    eval_loss = trainer.evaluate()["eval_loss"]
    if client is not None:
        head_weight, _ = client.export_weights(args.head_id)
        version = client.describe_head(args.head_id).weight_version
    else:
        head_weight, version = model.lm_head.weight.detach().clone(), args.steps
    # What the trainer holds of the head after Trainer moved and DDP wrapped the model: with
    # the head offloaded, the released one-element storage.
    head_bytes = model.lm_head.weight.untyped_storage().nbytes()
    if trainer.is_world_process_zero():
        body = {n: p.detach().clone() for n, p in model.named_parameters()
                if n != "lm_head.weight"}
        torch.save({"losses": losses, "eval_loss": eval_loss, "head": head_weight,
                    "trainer_head_bytes": head_bytes,
                    "version": version, "body": body,
                    "world_size": int(os.environ.get("WORLD_SIZE", "1"))}, args.out)



def save_trainer_outcome(trainer, client, args, world: int) -> None:
    """What a TRL trainer job (trl_grpo_job.py, trl_distillation_job.py) hands its test, written
    by rank 0 to args.out: the logged losses, the head (the server's, or the local lm_head) and
    its version, the body's parameters and the world size."""
    logs = [log for log in trainer.state.log_history if "loss" in log]
    model = trainer.accelerator.unwrap_model(trainer.model)
    if client is not None:
        head_weight, _ = client.export_weights(args.head_id)
        version = client.describe_head(args.head_id).weight_version
    else:
        head_weight, version = model.lm_head.weight.detach().clone(), args.steps
    if trainer.is_world_process_zero():
        body = {n: p.detach().clone() for n, p in model.named_parameters()
                if n != "lm_head.weight"}
        torch.save({"losses": [log["loss"] for log in logs], "logs": logs,
                    "head": head_weight, "version": version, "body": body,
                    "world_size": world}, args.out)


def end_process_group():
    """Every rank done, then the process group torn down before the interpreter exits: a gloo
    group left to the interpreter's exit has aborted a rank ("terminate called without an
    active exception", SIGABRT) after a complete run."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()
