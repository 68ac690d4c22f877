"""The FSDP2 checks of test_fsdp2.py in one torchrun launch (gloo, CPU): the tiny Llama of
test_hf_trainer.py built from a config with a fixed seed on every rank, each decoder layer and
then the root wrapped by torch.distributed.fsdp.fully_shard — once with the model's own lm_head
(the reference) and once with the head offloaded by remotehead.hf.offload_lm_head, which holds
nothing of W on the trainer. Rank 0 writes what the test compares to --out (torch.save):

- "packed": one packed micro-batch per rank (DataCollatorWithFlattening, each rank its own
  sequences, normalised by the rank's num_items_in_batch): both runs' losses, the body's
  gradients after FSDP's reduce-scatter (gathered whole), the reference's lm_head gradient
  (FSDP's average over the ranks) and the server's dW (the ranks' sum);
- "train": a few AdamW steps (each rank its own micro-batch, prompts not trained on; the
  offloaded head stepped by the server's synchronous AdamW with the same hyper-parameters):
  every rank's per-step losses, the body's parameters (gathered whole), the head, and what the
  offloaded, sharded model holds of the head (bytes, parameters, state-dict keys);
- "accelerate": the same with both models sharded by accelerate's own FSDP2 preparation
  (accelerate_shard: what Trainer runs on GPUs);
- "dtensor": what RemoteHead.loss / token_outputs answer hidden states that are a DTensor (a
  sequence-parallel shard), and whether anything reached the server.

--tied is the place of the tied-embedding variant (not implemented yet).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import remotehead
import remotehead.hf
from ddp_trainer_job import end_process_group
from test_hf_trainer import SEQ, VOCAB, tiny_llama
from test_packed_sequences import counted_tokens, packed_batch

LR, WEIGHT_DECAY, EPS = 3e-3, 0.01, 1e-6  # AdamW's eps 1e-6: see test_data_parallel.py


def build(tied: bool):
    """The model every rank builds (the same seed, so the same weights)."""
    if tied:
        raise NotImplementedError("--tied: the tied-embedding variant is not implemented yet")
    return tiny_llama(tied=False)


def offload(model, client, head_id: str, tied: bool):
    """The one call a user makes, before sharding (as Trainer / accelerate would shard)."""
    if tied:
        raise NotImplementedError("--tied: the tied-embedding variant is not implemented yet")
    return remotehead.hf.offload_lm_head(model, client, head_id)


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def accelerate_shard(model):
    """What accelerate (and so Trainer) runs for an FSDP2 config on GPUs — accelerate's own
    fsdp2_prepare_model with the plugin of docs/data-parallel.md's config (transformer-based
    wrap of LlamaDecoderLayer, reshard after forward, CPU-RAM-efficient loading: the model goes
    to the meta device and rank 0's weights are broadcast into the shards) — called here
    directly, since accelerate enables FSDP only for GPU-type setups."""
    import types

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        cpu_ram_efficient_loading=True, state_dict_type="FULL_STATE_DICT")
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"),
        is_main_process=dist.get_rank() == 0, mixed_precision="no", parallelism_config=None,
        torch_device_mesh=None)
    return fsdp2_prepare_model(accelerator, model)


def whole(t):
    """A sharded parameter or gradient gathered whole (a collective: every rank calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def micro_batch(step: int, rank: int):
    generator = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = ids.clone()
    for row in range(2):  # prompts of varying length: the ranks differ in valid tokens
        labels[row, : int(torch.randint(1, 6, (1,), generator=generator))] = -100
    return ids, labels


def packed_gradients(model, rank: int):
    """One packed micro-batch, backward; the loss and the gradients gathered whole."""
    batch = packed_batch(seed=20 + rank, lengths=(5 + rank, 9, 7 - rank))
    loss = model(**batch, num_items_in_batch=counted_tokens(batch)).loss
    loss.backward()
    grads = {n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def train(model, steps: int, rank: int, head=None):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=WEIGHT_DECAY, eps=EPS)
    losses = []
    for step in range(steps):
        ids, labels = micro_batch(step, rank)
        loss = model(input_ids=ids, labels=labels).loss  # the rank's mean; FSDP averages
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if head is not None:
            head.optimizer_step(adamw=dict(lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS))
        losses.append(loss.item())
    return losses


def gathered(value):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def dtensor_answers(head, client, world: int) -> dict:
    """RemoteHead given a DTensor (a sequence-parallel shard of [2, SEQ, D] hidden states)."""
    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, SEQ, 32, generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    sharded = distribute_tensor(hidden, mesh, [Shard(1)]).requires_grad_(True)
    before = client.describe_head(head.head_id).accumulated_micro_batches
    answers = {}
    for name, call in (("loss", lambda: head.loss(sharded, labels)),
                       ("token_outputs", lambda: head.token_outputs(sharded, labels))):
        try:
            call()
            answers[name] = "accepted"
        except remotehead.InvalidArgumentError as e:
            answers[name] = str(e)
    dist.barrier()
    after = client.describe_head(head.head_id).accumulated_micro_batches
    # What the message says to do: the gathered rows, a plain tensor (a Forward: no gradient).
    with torch.no_grad():
        answers["full_tensor_loss"] = head.loss(sharded.full_tensor(), labels).item()
        answers["plain_loss"] = head.loss(hidden, labels).item()
    answers["accumulated_before_after"] = (before, after)
    return answers


def pair(client, head_id: str, tied: bool, sharding):
    """The reference (its own lm_head) and the offloaded model, both sharded by `sharding`."""
    local = sharding(build(tied))
    remote = build(tied)
    head = offload(remote, client, head_id, tied)
    return local, sharding(remote), head


def compare_training(client, head_id: str, tied: bool, sharding, steps: int, rank: int):
    """A few AdamW steps of both models; what the test compares, and the offloaded model."""
    local, remote, head = pair(client, head_id, tied, sharding)
    local_losses = train(local, steps, rank)
    remote_losses = train(remote, steps, rank, head)
    weight = remote.lm_head.weight
    return {
        "local_losses": gathered(local_losses), "remote_losses": gathered(remote_losses),
        "local_body": {n: whole(p) for n, p in local.named_parameters()
                       if n != "lm_head.weight"},
        "remote_body": {n: whole(p) for n, p in remote.named_parameters()},
        "local_head": whole(local.lm_head.weight),
        "remote_head": client.export_weights(head.head_id)[0],
        "version": client.describe_head(head.head_id).weight_version,
        # What the sharded, offloaded model holds of the head.
        "head_bytes": weight.untyped_storage().nbytes(), "head_shape": tuple(weight.shape),
        "head_is_parameter": any(p is weight for p in remote.parameters()),
        "lm_head_wrapped": type(remote.lm_head).__name__.startswith("FSDP"),
        "remote_state_keys": sorted(remote.state_dict()),
        "local_state_keys": sorted(local.state_dict())}, head


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--head-id", default="fsdp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tied", action="store_true",
                        help="the tied-embedding variant (not implemented yet)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = remotehead.Client(args.server)
    results = {"world_size": world}

    # Packed sequences: loss and gradients of one micro-batch per rank.
    local, remote, head = pair(client, f"{args.head_id}-packed", args.tied, shard)
    local_loss, local_grads = packed_gradients(local, rank)
    remote_loss, remote_grads = packed_gradients(remote, rank)
    dist.barrier()  # every rank's dW is on the server
    results["packed"] = {"local_losses": gathered(local_loss),
                         "remote_losses": gathered(remote_loss),
                         "local_grads": local_grads, "remote_grads": remote_grads,
                         "server_dw": client.fetch_gradients(head.head_id)[0]}

    # A few AdamW steps: fully_shard by hand, then as accelerate shards for Trainer.
    results["train"], head = compare_training(client, f"{args.head_id}-train", args.tied, shard,
                                              args.steps, rank)
    results["accelerate"], _ = compare_training(client, f"{args.head_id}-accelerate",
                                                args.tied, accelerate_shard, args.steps, rank)

    results["dtensor"] = dtensor_answers(head, client, world)
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    end_process_group()
