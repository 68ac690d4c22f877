"""A data-parallel trainer whose LM head lives on remotehead: what job.yaml runs on every node
under torchrun (one process per node here; --nproc_per_node for one per GPU).

    torchrun --nnodes 2 --node_rank N --master_addr ... train.py --server remotehead:50051 \
        --ca /etc/remotehead/tls/ca.crt --token-file /etc/remotehead/token/token

A small body (embedding, linear, tanh) under DDP learns a fixed next-token rule on synthetic
data (no download); each rank draws its own batches. The head [vocab, hidden] is on the server:
rank 0 creates it from a seed (replacing one left by an earlier attempt of the Job: the body
starts afresh too), every rank sends its hidden states and labels through RemoteHead (one
ForwardBackward per micro-batch: the loss and dX come back, dW accumulates on the server) and
asks for the server's synchronous AdamW step, applied once for all ranks with dW averaged over
them as DDP averages the body's gradients. Rank 0 prints each step's loss averaged over the
ranks, and the last line "trained: first loss A, last loss B, head version V".
"""

import argparse
import os

import torch
import torch.distributed as dist

import remotehead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="HOST:PORT of the front")
    parser.add_argument("--ca", help="PEM CA of the server's certificate (TLS)")
    parser.add_argument("--token-file", help="file holding the bearer token (needs --ca)")
    parser.add_argument("--head-id", default="k8s-example")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ca = open(args.ca, "rb").read() if args.ca else None
    token = open(args.token_file).read().strip() if args.token_file else None
    client = remotehead.Client(args.server, root_certificates=ca, token=token)
    if rank == 0:
        try:
            client.create_head(args.head_id, args.vocab, args.hidden, seed=0)
        except remotehead.HeadExistsError:
            client.drop_head(args.head_id)
            client.create_head(args.head_id, args.vocab, args.hidden, seed=0)
    dist.barrier()  # the head exists before any rank uses it

    torch.manual_seed(0)  # the same body on every rank
    body = torch.nn.Sequential(torch.nn.Embedding(args.vocab, args.hidden),
                               torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh())
    ddp = torch.nn.parallel.DistributedDataParallel(body)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    head = remotehead.RemoteHead(client, args.head_id)
    generator = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for step in range(args.steps):
        inputs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        labels = (inputs * 7 + 3) % args.vocab  # the rule to learn
        loss = head.loss(ddp(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        head.optimizer_step(adamw=dict(lr=args.lr))
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        print(f"trained: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}, head version "
              f"{head.info.weight_version}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    client.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
