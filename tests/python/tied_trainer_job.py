"""The torchrun job of test_hf_tied_cluster.py: for each tiny tied model (tied_models.py), one
transformers Trainer run with the model's own tied matrix (DDP) and one with the head and the
input embedding served (offload_lm_head + RemoteHeadCallback, the same call on every rank), in
the same processes one after the other: gradient accumulation 2, average_tokens_across_devices,
AdamW with weight decay and a linear schedule, no clipping (the server's head is not in the
local norm). Rank 0 writes each run's logged losses, the tied matrix (the server's, or the local
one), the body's parameters and what the trainer held of the matrix to --out (torch.save)."""

import argparse
import os

import torch
import transformers

import remotehead
import remotehead.hf
from ddp_trainer_job import end_process_group
from tied_models import KINDS, holds_no_matrix, tiny, token_rows


def dataset(rows: int = 48):
    ids, labels = token_rows(rows, 10, seed=2)
    return [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]


def run(kind: str, server: str, output_dir: str, steps: int) -> dict:
    model = tiny(kind)
    callbacks, client = [], None
    head_id = f"tied-ddp-{kind}"
    if server:
        client = remotehead.Client(server)
        head = remotehead.hf.offload_lm_head(model, client, head_id)
        callbacks.append(remotehead.hf.RemoteHeadCallback(head))
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01,
        lr_scheduler_type="linear", max_grad_norm=0.0, adam_epsilon=1e-6, logging_steps=1,
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no",
        average_tokens_across_devices=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   callbacks=callbacks)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    if client is not None:
        matrix, _ = client.export_weights(head_id)
        version = client.describe_head(head_id).weight_version
        held = holds_no_matrix(model, trainer.optimizer)
        client.close()
    else:
        matrix, version, held = model.lm_head.weight.detach().clone(), steps, None
    body = {n: p.detach().clone() for n, p in model.named_parameters()
            if p is not model.lm_head.weight}
    return {"losses": losses, "matrix": matrix, "version": version, "body": body,
            "holds_no_matrix": held}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    for kind in args.kinds.split(","):
        results[kind] = {
            "local": run(kind, "", f"{args.out}-{kind}-local", args.steps),
            "served": run(kind, args.server, f"{args.out}-{kind}-served", args.steps)}
    if int(os.environ.get("RANK", "0")) == 0:
        results["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
    end_process_group()
