"""A tiny Llama (built from a config, fixed seed, no download) fine-tuned for 20 steps with
gradient accumulation 2, once with its own lm_head and once with the head offloaded to the
real server (server-side AdamW): per-step losses, the final body weights and the final head
weights agree (fp32, relative 1e-4 of each tensor's magnitude). A frozen offloaded head (as
under LoRA) trains the body alone and leaves the server's head untouched.
"""

import copy

import pytest
import torch
import transformers

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


def batches():
    # Two fixed batches, seen in turn: something the model can learn in 20 steps.
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, 257, (2, ACCUMULATION, BATCH, SEQ), generator=generator)
    for step in range(STEPS):
        ids = data[step % 2]
        labels = ids.clone()
        labels[:, :, :3] = -100  # a prompt whose tokens are not trained on
        yield ids, labels


def train(model, head=None, body_only=False):
    params = [p for n, p in model.named_parameters()
              if not (head is not None and n.startswith("lm_head"))]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses = []
    for ids, labels in batches():
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
    return (actual - expected).abs().max().item() <= rel * expected.abs().max().item()


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def test_full_fine_tuning_matches_a_local_run(client):
    local = tiny_llama()
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, "llama-full")
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


def test_frozen_head_trains_the_body_only(client):
    local = tiny_llama()
    local.lm_head.weight.requires_grad_(False)
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, "llama-frozen", trainable=False)
    before, _ = client.export_weights("llama-frozen")
    local_losses = train(local)
    remote_losses = train(remote, head, body_only=True)
    for a, b in zip(remote_losses, local_losses):
        assert abs(a - b) <= 1e-4 * abs(b)
    after, _ = client.export_weights("llama-frozen")
    assert torch.equal(after, before)
    _, _, info = client.fetch_gradients("llama-frozen")
    assert info.accumulated_micro_batches == 0
    client.drop_head("llama-frozen")


def test_tied_embeddings_are_refused_with_a_clear_error(client):
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings: expected False"):
        remotehead.hf.offload_lm_head(model, client, "llama-tied")
