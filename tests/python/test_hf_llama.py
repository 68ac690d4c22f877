"""A tiny Llama (built from a config, fixed seed, no download) fine-tuned for 20 steps with
gradient accumulation 2 in a plain PyTorch loop, once with its own lm_head and once with the
head offloaded to the real server: per-step losses and final weights agree (fp32, relative
1e-4 of each tensor's magnitude).

- full fine-tuning, head trained by server-side AdamW: body and head weights;
- peft LoRA (r=4 on q/v projections) with the head frozen on the server (dX only): the
  adapters, and the server's head is left untouched with nothing accumulated;
- a bad label is named where the caller put it (labels[b, t], or a batch's own
  shift_labels[b, t]), not among the rows sent.
"""

import copy

import peft
import pytest
import torch
import transformers

import numerics
import remotehead
import remotehead.hf

STEPS, ACCUMULATION, BATCH, SEQ = 20, 2, 2, 12
LR = 3e-3


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def batches(steps=STEPS):
    # Two fixed batches, seen in turn: something the model can learn in 20 steps.
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, 257, (2, ACCUMULATION, BATCH, SEQ), generator=generator)
    for step in range(steps):
        ids = data[step % 2]
        labels = ids.clone()
        labels[:, :, :3] = -100  # a prompt whose tokens are not trained on
        yield ids, labels


def train(model, head=None, body_only=False, steps=STEPS):
    # An offloaded, server-trained lm_head is frozen locally, so it is not in this list.
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses = []
    for ids, labels in batches(steps):
        # As transformers' Trainer: the valid (shifted) tokens of the whole accumulated batch.
        num_items = int((labels[..., 1:] != -100).sum())
        step_loss = 0.0
        for micro in range(ACCUMULATION):
            out = model(input_ids=ids[micro], labels=labels[micro], num_items_in_batch=num_items)
            out.loss.backward()
            step_loss += out.loss.item()
        optimizer.step()
        optimizer.zero_grad()
        if head is not None and not body_only:
            head.optimizer_step(adamw=dict(lr=LR, weight_decay=0.0))
        elif head is not None:
            head.next_step()
        losses.append(step_loss)
    return losses


def close(actual, expected, rel=1e-4):
    return numerics.close(actual, expected, rel)


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def test_full_fine_tuning_matches_a_local_run(client):
    local = tiny_llama()
    remote = copy.deepcopy(local)
    # A local copy kept for local generation (test_hf_no_local_copy.py covers the default).
    head = remotehead.hf.offload_lm_head(remote, client, "llama-full", keep_local_copy=True)
    local_losses = train(local)
    remote_losses = train(remote, head)
    for step, (a, b) in enumerate(zip(remote_losses, local_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: remote {a} vs local {b}"
    assert remote_losses[-1] < remote_losses[0]
    local_params = dict(local.named_parameters())
    for name, p in remote.named_parameters():
        if not name.startswith("lm_head"):
            assert close(p.detach(), local_params[name].detach()), name
    weight, _ = client.export_weights("llama-full")
    assert close(weight, local.lm_head.weight.detach())
    # Generation uses the local lm_head, refreshed from the server.
    head.sync_lm_head()
    assert torch.equal(remote.lm_head.weight.detach(), weight)
    client.drop_head("llama-full")


def lora(model):
    torch.manual_seed(1)  # the adapters' initialisation
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))


def test_lora_with_a_frozen_head_matches_a_local_run(client):
    base = tiny_llama()
    local = lora(copy.deepcopy(base))
    remote = lora(copy.deepcopy(base))
    # On the PEFT model, as a user has it: peft froze the head and the base weights.
    head = remotehead.hf.offload_lm_head(remote, client, "llama-lora", trainable=False)
    before, _ = client.export_weights("llama-lora")
    initial = {n: p.detach().clone() for n, p in remote.named_parameters()}
    local_losses = train(local)
    remote_losses = train(remote, head, body_only=True)
    for step, (a, b) in enumerate(zip(remote_losses, local_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: remote {a} vs local {b}"
    local_params = dict(local.named_parameters())
    adapters = [(n, p) for n, p in remote.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, _ in adapters)
    for name, p in adapters:
        assert close(p.detach(), local_params[name].detach()), name
        assert not torch.equal(p.detach(), initial[name]), name  # it trained
    after, _ = client.export_weights("llama-lora")
    assert torch.equal(after, before)
    _, _, info = client.fetch_gradients("llama-lora")
    assert info.accumulated_micro_batches == 0
    client.drop_head("llama-lora")


def test_a_bad_label_is_named_where_the_caller_put_it(client):
    # labels[1, 6] is what shifted position [1, 5] predicts; the rows of the prompt (-100) stay
    # here, so the server sees the bad row elsewhere: the error names the caller's labels.
    model = tiny_llama()
    remotehead.hf.offload_lm_head(model, client, "llama-bad-label")
    ids, labels = next(iter(batches(1)))
    ids, labels = ids[0], labels[0].clone()
    labels[1, 6] = 300
    message = ("labels[1, 6]: expected a token id in [0, 257) or ignore_index (-100); got 300")
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        model(input_ids=ids, labels=labels)
    assert refused.value.details == message
    assert refused.value.metadata["field"] == "labels[1, 6]"
    # A batch's own shift_labels are named as given.
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        model(input_ids=ids, labels=labels, shift_labels=shifted)
    assert refused.value.details == message.replace("labels[1, 6]", "shift_labels[1, 5]")
    assert refused.value.metadata["field"] == "shift_labels[1, 5]"
    client.drop_head("llama-bad-label")
