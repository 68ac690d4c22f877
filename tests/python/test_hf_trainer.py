"""transformers' Trainer (gradient accumulation 2, num_items_in_batch, AdamW with weight decay,
linear learning-rate decay) on a tiny Llama built from a config (fixed seeds, no download),
once with the model's own lm_head and once with the head offloaded to the real server:
the logged per-step losses and the final weights agree (fp32, relative 1e-4 of each tensor's
magnitude).

- gradients="server": the head is trained by server-side AdamW steps that RemoteHeadCallback
  issues with the Trainer's hyper-parameters and current learning rate. Trainer's clipping sees
  the local parameters only in this mode, so both runs train unclipped.
- gradients="local" with tied input embeddings: the embedding matrix is the head; its dW is
  pulled into the parameter's .grad at the end of each accumulation window, so Trainer's own
  gradient clipping (max_grad_norm=1, which is active here) and logged grad_norm match too.
"""

import copy

import pytest
import torch
import transformers

import numerics
import remotehead
import remotehead.hf

STEPS, ACCUMULATION, BATCH, SEQ, VOCAB = 8, 2, 2, 12, 257


def tiny_llama(tied: bool):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def dataset():
    generator = torch.Generator().manual_seed(2)
    rows = []
    for _ in range(STEPS * ACCUMULATION * BATCH):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        labels = ids.clone()
        # Prompts of varying length, not trained on: micro-batches differ in valid tokens, so
        # only a num_items_in_batch-normalised loss gives the local run's gradients.
        labels[: int(torch.randint(1, 6, (1,), generator=generator))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def train(model, tmp_path, max_grad_norm, callbacks=(), save_steps=None):
    saving = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(
        save_strategy="no")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=3e-3, weight_decay=0.01,
        lr_scheduler_type="linear", max_grad_norm=max_grad_norm, logging_steps=1,
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True, **saving)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   callbacks=list(callbacks))
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def close(actual, expected, rel=1e-4):
    return numerics.close(actual, expected, rel)


def assert_same_training(remote_logs, local_logs, remote, local, keys=("loss",)):
    assert len(remote_logs) == len(local_logs) == STEPS
    for step, (r, l) in enumerate(zip(remote_logs, local_logs)):
        for key in keys:
            assert abs(r[key] - l[key]) <= 1e-4 * abs(l[key]), f"step {step} {key}: {r} vs {l}"
    local_params = dict(local.named_parameters())
    for name, p in remote.named_parameters():
        assert close(p.detach(), local_params[name].detach()), name


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def test_trainer_with_a_server_trained_head_matches_a_local_run(client, tmp_path):
    local = tiny_llama(tied=False)
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, "trainer-server", keep_local_copy=True)
    local_logs = train(local, tmp_path / "local", max_grad_norm=0.0)
    remote_logs = train(remote, tmp_path / "remote", max_grad_norm=0.0,
                        callbacks=[remotehead.hf.RemoteHeadCallback(head)])
    # At the end of training the callback copied the server's head into the local lm_head.
    assert_same_training(remote_logs, local_logs, remote, local)
    info = client.describe_head("trainer-server")
    assert info.weight_version == STEPS
    weight, _ = client.export_weights("trainer-server")
    assert torch.equal(weight, remote.lm_head.weight.detach())
    client.drop_head("trainer-server")


def test_trainer_with_no_local_copy_matches_a_local_run_and_checkpoints_the_server_head(
        client, tmp_path):
    local = tiny_llama(tied=False)
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, "trainer-no-copy")
    assert not head.has_local_copy
    local_logs = train(local, tmp_path / "local", max_grad_norm=0.0)
    remote_logs = train(remote, tmp_path / "remote", max_grad_norm=0.0,
                        callbacks=[remotehead.hf.RemoteHeadCallback(head)], save_steps=STEPS // 2)
    assert len(remote_logs) == len(local_logs) == STEPS
    for step, (r, l) in enumerate(zip(remote_logs, local_logs)):
        assert abs(r["loss"] - l["loss"]) <= 1e-4 * abs(l["loss"]), f"step {step}: {r} vs {l}"
    local_params = dict(local.named_parameters())
    for name, p in remote.named_parameters():
        if name != "lm_head.weight":
            assert close(p.detach(), local_params[name].detach()), name
    weight, _ = client.export_weights("trainer-no-copy")
    assert close(weight, local.lm_head.weight.detach())
    # The last checkpoint holds the server's head as it was then (the end of training),
    # bit-exact, and the body; the trainer still holds no W.
    saved = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "remote" / f"checkpoint-{STEPS}")
    assert torch.equal(saved.lm_head.weight.detach(), weight)
    for name, p in saved.named_parameters():
        if name != "lm_head.weight":
            assert torch.equal(p.detach(), dict(remote.named_parameters())[name].detach()), name
    assert remote.lm_head.weight.untyped_storage().nbytes() == 4
    client.drop_head("trainer-no-copy")


def test_trainer_with_tied_embeddings_and_local_gradients_matches_a_local_run(client, tmp_path):
    local = tiny_llama(tied=True)
    remote = copy.deepcopy(local)
    assert remote.lm_head.weight is remote.model.embed_tokens.weight
    head = remotehead.hf.offload_lm_head(remote, client, "trainer-tied", gradients="local")
    local_logs = train(local, tmp_path / "local", max_grad_norm=1.0)
    remote_logs = train(remote, tmp_path / "remote", max_grad_norm=1.0)
    # The clip is active: the pre-clip norm exceeds max_grad_norm in the local run.
    assert max(log["grad_norm"] for log in local_logs) > 1.0
    assert_same_training(remote_logs, local_logs, remote, local, keys=("loss", "grad_norm"))
    assert remote.lm_head.weight is remote.model.embed_tokens.weight
    # The server holds the weights of the last push: those before the last optimizer step
    # (pushed before each step but the first).
    info = client.describe_head("trainer-tied")
    assert info.accumulated_micro_batches == 0
    assert info.weight_version == STEPS - 1
    head.push_weights()
    weight, _ = client.export_weights("trainer-tied")
    assert torch.equal(weight, remote.lm_head.weight.detach())
    client.drop_head("trainer-tied")
