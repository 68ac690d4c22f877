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
  sequence-parallel shard), and whether anything reached the server;
- "tied" (--tied=KIND,...: models of tied_models.py, e.g. llama,gemma3): "train" and
  "accelerate" as above for a tied model, offloaded by the same one call (its input embedding
  served by the head, the lm_head released) against the same FSDP2 run with the model's own
  tied matrix — losses, body, the server's tied weight against the local tied parameter, and
  what the served model holds (no [V, D] tensor, the embedding module, the state-dict keys).
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
import tied_models
from ddp_trainer_job import end_process_group
from test_hf_trainer import SEQ, VOCAB, tiny_llama
from test_packed_sequences import counted_tokens, packed_batch

LR, WEIGHT_DECAY, EPS = 3e-3, 0.01, 1e-6  # AdamW's eps 1e-6: see test_data_parallel.py


UNTIED = "untied"  # the tiny Llama of test_hf_trainer.py; any other kind: tied_models.tiny


def build(kind: str):
    """The model every rank builds (the same seed, so the same weights)."""
    return tiny_llama(tied=False) if kind == UNTIED else tied_models.tiny(kind)


def offload(model, client, head_id: str):
    """The one call a user makes, before sharding (as Trainer / accelerate would shard): for a
    tied model it serves the input embedding from the same head too."""
    return remotehead.hf.offload_lm_head(model, client, head_id)


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def accelerate_shard(model):
    """What accelerate (and so Trainer) runs for an FSDP2 config on GPUs — accelerate's own
    fsdp2_prepare_model with the plugin of docs/data-parallel.md's config (transformer-based
    wrap of the model's decoder layer class, reshard after forward, CPU-RAM-efficient loading:
    the model goes to the meta device and rank 0's weights are broadcast into the shards) —
    called here directly, since accelerate enables FSDP only for GPU-type setups."""
    import types

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[type(model.model.layers[0]).__name__],
        reshard_after_forward=True,
        cpu_ram_efficient_loading=True, state_dict_type="FULL_STATE_DICT")
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"),
        is_main_process=dist.get_rank() == 0, mixed_precision="no", parallelism_config=None,
        torch_device_mesh=None)
    return fsdp2_prepare_model(accelerator, model)


def whole(t):
    """A sharded parameter or gradient gathered whole (a collective: every rank calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def micro_batch(step: int, rank: int, kind: str = UNTIED):
    if kind != UNTIED:  # tied_models' vocabulary, padding ids among the inputs
        return tied_models.token_rows(2, SEQ, seed=100 * step + rank)
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


def train(model, steps: int, rank: int, kind: str, head=None):
    """The per-step losses, and the optimizer (its state, for what the trainer holds)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=WEIGHT_DECAY, eps=EPS)
    losses = []
    for step in range(steps):
        ids, labels = micro_batch(step, rank, kind)
        loss = model(input_ids=ids, labels=labels).loss  # the rank's mean; FSDP averages
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if head is not None:
            head.optimizer_step(adamw=dict(lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS))
        losses.append(loss.item())
    return losses, optimizer


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


def pair(client, head_id: str, kind: str, sharding):
    """The reference (its own lm_head) and the offloaded model, both sharded by `sharding`."""
    local = build(kind)
    # The names of the head's matrix in the reference: lm_head's, and the input embedding's
    # where it is tied (one parameter under both).
    embedding = next(n for n, m in local.named_modules() if m is local.get_input_embeddings())
    head_names = {"lm_head.weight"} | ({f"{embedding}.weight"} if kind != UNTIED else set())
    local = sharding(local)
    remote = build(kind)
    head = offload(remote, client, head_id)
    return local, sharding(remote), head, head_names


def compare_training(client, head_id: str, kind: str, sharding, steps: int, rank: int):
    """A few AdamW steps of both models; what the test compares, and the offloaded model."""
    local, remote, head, head_names = pair(client, head_id, kind, sharding)
    local_losses, _ = train(local, steps, rank, kind)
    sent = []  # the embedding gradients this rank's backward passes sent (gradient ids)
    send = client.embedding_gradient
    client.embedding_gradient = lambda *a, **k: sent.append(k["gradient_id"]) or send(*a, **k)
    try:
        remote_losses, optimizer = train(remote, steps, rank, kind, head)
    finally:
        del client.embedding_gradient  # the method again
    weight = remote.lm_head.weight
    embedding = remote.get_input_embeddings()
    return {
        "local_losses": gathered(local_losses), "remote_losses": gathered(remote_losses),
        "local_body": {n: whole(p) for n, p in local.named_parameters() if n not in head_names},
        "remote_body": {n: whole(p) for n, p in remote.named_parameters()},
        "local_head": whole(local.lm_head.weight),  # a tied model's: its one tied parameter
        "local_tied": local.lm_head.weight is local.get_input_embeddings().weight,
        "remote_head": client.export_weights(head.head_id)[0],
        "version": client.describe_head(head.head_id).weight_version,
        # What the sharded, offloaded model holds of the head.
        "head_bytes": weight.untyped_storage().nbytes(), "head_shape": tuple(weight.shape),
        "head_is_parameter": any(p is weight for p in remote.parameters()),
        "lm_head_wrapped": type(remote.lm_head).__name__.startswith("FSDP"),
        "embedding_served": isinstance(embedding, remotehead.RemoteEmbedding),
        "embedding_gradients": gathered([tuple(g) for g in sent]),
        "embedding_wrapped": type(embedding).__name__.startswith("FSDP"),
        "holds_no_matrix": (tied_models.holds_no_matrix(remote, optimizer)
                            if kind != UNTIED else None),
        "remote_state_keys": sorted(remote.state_dict()),
        "local_state_keys": sorted(local.state_dict()),
        "head_names": sorted(head_names)}, head


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--head-id", default="fsdp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tied", default="",
                        help="tied models of tied_models.py to run too, comma-separated "
                             "(e.g. llama,gemma3)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = remotehead.Client(args.server)
    results = {"world_size": world}

    # Packed sequences: loss and gradients of one micro-batch per rank.
    local, remote, head, _ = pair(client, f"{args.head_id}-packed", UNTIED, shard)
    local_loss, local_grads = packed_gradients(local, rank)
    remote_loss, remote_grads = packed_gradients(remote, rank)
    dist.barrier()  # every rank's dW is on the server
    results["packed"] = {"local_losses": gathered(local_loss),
                         "remote_losses": gathered(remote_loss),
                         "local_grads": local_grads, "remote_grads": remote_grads,
                         "server_dw": client.fetch_gradients(head.head_id)[0]}

    # A few AdamW steps: fully_shard by hand, then as accelerate shards for Trainer.
    results["train"], head = compare_training(client, f"{args.head_id}-train", UNTIED, shard,
                                              args.steps, rank)
    results["accelerate"], _ = compare_training(client, f"{args.head_id}-accelerate", UNTIED,
                                                accelerate_shard, args.steps, rank)

    results["dtensor"] = dtensor_answers(head, client, world)

    # Tied models: the embedding served by the same head, against their own tied matrix.
    results["tied"] = {}
    for kind in filter(None, args.tied.split(",")):
        results["tied"][kind] = {
            name: compare_training(client, f"{args.head_id}-tied-{kind}-{name}", kind, sharding,
                                   args.steps, rank)[0]
            for name, sharding in (("train", shard), ("accelerate", accelerate_shard))}
    if rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    end_process_group()
