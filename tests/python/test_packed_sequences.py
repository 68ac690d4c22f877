"""Packed sequences (padding-free batches: transformers' DataCollatorWithFlattening) with the
head offloaded, against the same model with its own lm_head, in one process. (Two ranks: the
packed batches of tests/python/fsdp2_job.py, run by test_fsdp2.py.)

DataCollatorWithFlattening concatenates a micro-batch's sequences into one row, restarts
`position_ids` at 0 for each (the model's attention then keeps the sequences apart) and puts
-100 at each sequence's first label, so that the shifted labels stop one sequence's last
position predicting the next one's first token, and Trainer's count of the shifted labels
(num_items_in_batch) is the tokens both losses sum over.

- One packed micro-batch of 3 sequences of different lengths, with and without
  num_items_in_batch: loss to 1e-5 relative, the body's gradients to 1e-5 and the head's dW
  (FetchGradients) to 1e-5 of their magnitude, the server's valid-token count = the labels
  Trainer counts. The local packed loss itself equals the 3 sequences run separately (1e-5):
  the packing is real.
- A batch that brings its own `shift_labels` (as context-parallel shards and some padding-free
  collators do): transformers' loss takes them as they are, so does the offloaded head.
- Trainer with DataCollatorWithFlattening (3 steps, gradient accumulation 2): per-step losses
  1e-5, body 1e-4 and head 1e-5 of their magnitude after the steps.
"""

import copy

import pytest
import torch
import transformers

import numerics
import remotehead
import remotehead.hf
from test_hf_trainer import VOCAB, tiny_llama

LENGTHS = (7, 11, 5)


def packed_features(seed: int, lengths=LENGTHS):
    """Sequences of `lengths` tokens, a prompt of 1–3 tokens each not trained on (-100)."""
    generator = torch.Generator().manual_seed(seed)
    features = []
    for length in lengths:
        ids = torch.randint(0, VOCAB, (length,), generator=generator)
        labels = ids.clone()
        labels[: int(torch.randint(1, 4, (1,), generator=generator))] = -100
        features.append({"input_ids": ids, "labels": labels})
    return features


def packed_batch(seed: int, lengths=LENGTHS) -> dict:
    """One packed micro-batch: input_ids, labels and position_ids, each [1, sum(lengths)], and
    use_cache=False: transformers builds its packed-sequence mask from position_ids only when
    no cache is built (a plain loop must say so; Trainer sets model.config.use_cache to
    TrainingArguments.use_cache, False by default). With the config's use_cache=True the
    sequences attend to each other — the same in the local and the offloaded model."""
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(
        packed_features(seed, lengths))
    assert batch["input_ids"].shape == (1, sum(lengths))
    return {**batch, "use_cache": False}


def counted_tokens(batch) -> int:
    """What Trainer counts as num_items_in_batch for a causal LM: the shifted labels."""
    return int((batch["labels"][..., 1:] != -100).sum())


def body_gradients(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if n != "lm_head.weight" and p.grad is not None}


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def offloaded_pair(client, head_id):
    local = tiny_llama(tied=False)
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, head_id)
    return local, remote, head


def assert_same_gradients(client, head_id, local, remote):
    local_grads, remote_grads = body_gradients(local), body_gradients(remote)
    assert local_grads.keys() == remote_grads.keys() and len(local_grads) > 10
    for name, g in local_grads.items():
        assert numerics.close(remote_grads[name], g, 1e-5), name
    dw, _, _ = client.fetch_gradients(head_id)
    assert numerics.close(dw, local.lm_head.weight.grad, 1e-5)


@pytest.mark.parametrize("normalised", [True, False], ids=["num_items_in_batch", "mean"])
def test_a_packed_batch_gives_the_local_loss_and_gradients(client, normalised):
    head_id = f"packed-{'items' if normalised else 'mean'}"
    local, remote, head = offloaded_pair(client, head_id)
    batch = packed_batch(seed=3)
    assert batch["position_ids"][0].tolist() == [i for n in LENGTHS for i in range(n)]
    n = counted_tokens(batch)
    extra = {"num_items_in_batch": n} if normalised else {}
    local_loss = local(**batch, **extra).loss
    local_loss.backward()
    remote_loss = remote(**batch, **extra).loss
    remote_loss.backward()
    assert abs(remote_loss.item() - local_loss.item()) <= 1e-5 * abs(local_loss.item())
    # The server summed over the tokens Trainer counts, and the normaliser is that count.
    summary = head.last_result.summary
    assert summary.valid_tokens == n
    assert summary.denominator == pytest.approx(n)
    assert_same_gradients(client, head_id, local, remote)
    # The packing is real: the sequences one by one give the same sum over the same n tokens
    # (the mean is that sum / n too).
    with torch.no_grad():
        separate = sum(
            local(input_ids=f["input_ids"][None], labels=f["labels"][None],
                  num_items_in_batch=n).loss.item() for f in packed_features(seed=3))
    assert abs(local_loss.item() - separate) <= 1e-5 * separate
    client.drop_head(head_id)


def test_a_batch_with_its_own_shift_labels_gives_the_local_loss_and_gradients(client):
    head_id = "packed-shift-labels"
    local, remote, head = offloaded_pair(client, head_id)
    batch = packed_batch(seed=4)
    # Shifted by the collator, and then some masked that shifting `labels` would keep: a loss
    # that shifted `labels` itself would differ.
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:].clone()
    shift[0, ::4] = -100
    n = int((shift != -100).sum())
    assert n < counted_tokens(batch)
    local_loss = local(**batch, shift_labels=shift, num_items_in_batch=n).loss
    local_loss.backward()
    remote_loss = remote(**batch, shift_labels=shift, num_items_in_batch=n).loss
    remote_loss.backward()
    assert head.last_result.summary.valid_tokens == n
    assert abs(remote_loss.item() - local_loss.item()) <= 1e-5 * abs(local_loss.item())
    assert_same_gradients(client, head_id, local, remote)
    client.drop_head(head_id)


def train_packed(model, output_dir, callbacks=()):
    rows = [f for seed in range(12) for f in packed_features(seed, lengths=(6 + seed % 5,))]
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01,
        adam_epsilon=1e-6, max_grad_norm=0.0, logging_steps=1, report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=rows, callbacks=list(callbacks),
        data_collator=transformers.DataCollatorWithFlattening(return_tensors="pt"))
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_trainer_with_packed_batches_matches_a_local_run(client, tmp_path):
    local, remote, head = offloaded_pair(client, "packed-trainer")
    local_losses = train_packed(local, tmp_path / "local")
    remote_losses = train_packed(remote, tmp_path / "remote",
                                 callbacks=[remotehead.hf.RemoteHeadCallback(head)])
    assert len(remote_losses) == len(local_losses) == 3
    assert local.config.use_cache is False and remote.config.use_cache is False  # Trainer's
    for step, (r, l) in enumerate(zip(remote_losses, local_losses)):
        assert abs(r - l) <= 1e-5 * abs(l), f"step {step}: {r} vs {l}"
    local_params = dict(local.named_parameters())
    for name, p in remote.named_parameters():
        assert numerics.close(p.detach(), local_params[name].detach(), 1e-4), name
    weight, _ = client.export_weights("packed-trainer")
    assert numerics.close(weight, local.lm_head.weight.detach(), 1e-5)
    assert client.describe_head("packed-trainer").weight_version == 3
    client.drop_head("packed-trainer")
