"""A plain PyTorch DDP training loop with the LM head on a remotehead server — the same script
for 1 or W processes:

    torchrun --nproc_per_node 2 ddp_train.py --server 127.0.0.1:50051 --out run.json
    torchrun --nproc_per_node 2 ddp_train.py --out local.json      # the model's own lm_head

A tiny Llama built from a config (fixed seed, no download), rank r training on rows r, r + W,
… of a seeded synthetic dataset, with gradient accumulation: each micro-batch's loss is its
token sum / the valid tokens of the rank's accumulation window, DDP averages the body's
gradients over the ranks, and AdamW steps the body here. With --server the head is offloaded
(remotehead.hf.offload_lm_head: rank 0 uploads, every rank adds its own dW) and stepped by the
server's synchronous AdamW step (head.optimizer_step: one step for all ranks, dW averaged
over them as DDP averages). Rank 0 writes the per-step losses (averaged over the ranks) and the
trained head to --out (JSON; the head as a list) — what the tests compare with the local run.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import transformers

import remotehead
import remotehead.hf

VOCAB, HIDDEN, SEQ = 257, 32, 12
LR, WEIGHT_DECAY = 3e-3, 0.01
# AdamW's eps: 1e-6 rather than 1e-8, so that elements whose gradient is ~0 are not normalised
# to ±lr — there, fp32 summation order (one server's sum vs DDP's all-reduce) would show.
EPS = 1e-6


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def dataset(rows: int):
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    labels = ids.clone()
    for r in range(rows):  # prompts of varying length, not trained on
        labels[r, : int(torch.randint(1, 6, (1,), generator=generator))] = -100
    return ids, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="", help="remotehead server (empty: local head)")
    parser.add_argument("--head-id", default="ddp-example")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="rows per micro-batch and rank")
    parser.add_argument("--out", default="", help="rank 0 writes losses and the head here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama()
    client = head = None
    if args.server:
        client = remotehead.Client(args.server)
        head = remotehead.hf.offload_lm_head(model, client, args.head_id)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=WEIGHT_DECAY, eps=EPS)
    rows_per_step = args.accumulation * args.batch * world
    ids, labels = dataset(args.steps * rows_per_step)
    losses = []
    for step in range(args.steps):
        window = slice(step * rows_per_step, (step + 1) * rows_per_step)
        mine_ids, mine_labels = ids[window][rank::world], labels[window][rank::world]
        tokens = int((mine_labels[:, 1:] != -100).sum())  # what this rank's window predicts
        total = 0.0
        for micro in range(args.accumulation):
            part = slice(micro * args.batch, (micro + 1) * args.batch)
            last = micro == args.accumulation - 1
            # DDP all-reduces the body's gradients once, at the window's last backward.
            context = ddp.no_sync() if not last else torch.enable_grad()
            with context:
                loss = ddp(input_ids=mine_ids[part], labels=mine_labels[part],
                           num_items_in_batch=tokens).loss
                loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        if head is not None:
            head.optimizer_step(adamw=dict(lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS))
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if head is not None:
        weight, _ = client.export_weights(args.head_id)
        version = client.describe_head(args.head_id).weight_version
    else:
        weight, version = model.lm_head.weight.detach(), args.steps
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "losses": losses, "head_version": version,
                       "head": weight.tolist()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
