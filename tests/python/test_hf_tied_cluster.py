"""Tied input embeddings served by the server (see test_hf_tied.py) with data-parallel trainers
and with TRL's GRPOTrainer, for the tiny tied Llama, Gemma-2-like and Gemma-3-like models of
tied_models.py, against the same runs with the model's own tied matrix.

- transformers' Trainer under torchrun with 2 ranks (gloo, CPU; tests/python/tied_trainer_job.py,
  one launch for the three models, local and served runs in the same processes): gradient
  accumulation 2, average_tokens_across_devices, AdamW with weight decay, 3 steps. Each rank's
  embedding gradients go under its own trainer identity and the synchronous step applies their
  sum once: per-step losses to 1e-5 relative, the tied matrix to 1e-5 of its magnitude, the
  body to 1e-4, head version = steps, and no [V, D] tensor on the trainers.
- TRL's GRPOTrainer (one process): for one micro-batch (left-padded prompts, completions of
  different lengths, off-policy old log-probs, beta > 0 so the tied reference model is a frozen
  served head too) the policy's and the reference's log-probs and entropies (1e-5), TRL's loss
  (1e-5 relative), every body gradient and the server's dW against the local tied matrix's
  gradient (1e-5 of each tensor's magnitude), the micro-batch counted once; then 2 optimizer
  steps of the whole trainer (generation included) against GRPOTrainer with the local tied
  head: losses to 1e-5, tied matrix to 1e-5, body to 1e-4, neither model holding the matrix.
"""

import pytest
import torch
from trl import GRPOTrainer

import numerics
import remotehead
from remotehead.trl import RemoteHeadGRPOTrainer
from test_data_parallel import HERE, torchrun
from test_trl_grpo import VOCAB, batch, char_tokenizer, config, per_token, trainer
from tied_models import KINDS, holds_no_matrix, tiny


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def test_trainer_under_torchrun_equals_the_local_tied_ddp_run(server_target, tmp_path):
    out = tmp_path / "tied.pt"
    torchrun(2, HERE / "tied_trainer_job.py", f"--server={server_target}", "--steps=3",
             f"--out={out}")
    results = torch.load(out)
    assert results["world_size"] == 2
    for kind in KINDS:
        local, served = results[kind]["local"], results[kind]["served"]
        assert len(served["losses"]) == len(local["losses"]) == 3
        for step, (a, b) in enumerate(zip(served["losses"], local["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"{kind} step {step}: served {a} vs local {b}"
        assert numerics.close(served["matrix"], local["matrix"], 1e-5), kind
        assert served["body"].keys() == local["body"].keys()
        for name, p in local["body"].items():
            assert numerics.close(served["body"][name], p, 1e-4), (kind, name)
        assert served["version"] == 3  # one synchronous step per global step
        assert served["holds_no_matrix"], kind


@pytest.fixture(scope="module")
def grpo_dirs(tmp_path_factory):
    """The tiny tied models at the character tokenizer's vocabulary, saved: TRL loads its
    reference model from the same directory."""
    dirs = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(f"tied-{kind}")
        tiny(kind, vocab=VOCAB).save_pretrained(path)
        dirs[kind] = str(path)
    return dirs


def embedding_name(model) -> str:
    return next(n for n, p in model.named_parameters() if p is model.lm_head.weight)


@pytest.mark.parametrize("kind", KINDS)
def test_grpo_compute_loss_log_probs_and_gradients_match_trl(client, grpo_dirs, tmp_path,
                                                             kind):
    tokenizer = char_tokenizer()
    args = config(tmp_path, temperature=0.7, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
                  beta=0.04)
    head_id = f"tied-grpo-{kind}"
    local = trainer(GRPOTrainer, grpo_dirs[kind], args, tokenizer)
    remote = trainer(RemoteHeadGRPOTrainer, grpo_dirs[kind], args, tokenizer, client=client,
                     head_id=head_id)
    assert remote.fused_grpo_loss and remote.remote_ref_head is not None
    for model in (remote.model, remote.ref_model):  # the policy's and the reference's
        assert isinstance(model.get_input_embeddings(), remotehead.RemoteEmbedding)
        assert holds_no_matrix(model)
    for t in (local, remote):
        t.model.train()
        t.current_gradient_accumulation_steps = 2
    inputs = batch(local, beta=0.04, on_policy=False)
    for (a, b) in zip(per_token(remote, remote.model, inputs), per_token(local, local.model,
                                                                        inputs)):
        assert numerics.close(a, b, 1e-5)
    remote_ref, _ = per_token(remote, remote.ref_model, inputs, entropy=False)
    local_ref, _ = per_token(local, local.ref_model, inputs, entropy=False)
    assert numerics.close(remote_ref, local_ref, 1e-5)

    local_loss = local._compute_loss(local.model, inputs)
    local_loss.backward()
    remote_loss = remote._compute_loss(remote.model, inputs)
    remote_loss.backward()
    assert abs(remote_loss.item() - local_loss.item()) <= 1e-5 * abs(local_loss.item())
    local_grads = {n: p.grad for n, p in local.model.named_parameters()}
    remote_grads = {n: p.grad for n, p in remote.model.named_parameters() if p.grad is not None}
    name = embedding_name(local.model)
    assert name not in remote_grads
    # The head's use (the fused GRPO pass) and the embedding's, in one dW, one micro-batch.
    remote_grads[name], _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 1
    assert remote_grads.keys() == local_grads.keys()
    for n, grad in local_grads.items():
        assert numerics.close(remote_grads[n], grad, 1e-5), n
    assert client.describe_head(f"{head_id}-ref").accumulated_micro_batches == 0
    client.drop_head(head_id)
    client.drop_head(f"{head_id}-ref")


def test_a_short_grpo_run_equals_trl_with_the_local_tied_head(client, grpo_dirs, tmp_path):
    kind, steps = "gemma3", 2
    args = config(tmp_path, max_steps=steps, beta=0.04, use_bias_correction_kl=False,
                  learning_rate=3e-3, logging_steps=1, adam_epsilon=1e-6, max_grad_norm=0.0)
    runs = {}
    for cls, extra in ((GRPOTrainer, {}),
                       (RemoteHeadGRPOTrainer, dict(client=client, head_id="tied-grpo-run"))):
        run = trainer(cls, grpo_dirs[kind], args, char_tokenizer(), **extra)
        run.train()
        model = run.model
        if extra:
            matrix, _ = client.export_weights("tied-grpo-run")
            assert client.describe_head("tied-grpo-run").weight_version == steps
            assert holds_no_matrix(model, run.optimizer) and holds_no_matrix(run.ref_model)
        else:
            matrix = model.lm_head.weight.detach().clone()
        runs[cls] = ([log["loss"] for log in run.state.log_history if "loss" in log], matrix,
                     {n: p.detach() for n, p in model.named_parameters()
                      if p is not model.lm_head.weight})
    (losses, matrix, body), (r_losses, r_matrix, r_body) = runs[GRPOTrainer], \
        runs[RemoteHeadGRPOTrainer]
    assert len(r_losses) == len(losses) == steps
    for step, (a, b) in enumerate(zip(r_losses, losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: served {a} vs local {b}"
    # AdamW's first steps divide each element's gradient by its own magnitude: where it is
    # near eps, the fp32 summation order of the server's dW shows (measured 6.8e-6).
    assert numerics.close(r_matrix, matrix, 2e-5)
    assert r_body.keys() == body.keys()
    for name, p in body.items():
        assert numerics.close(r_body[name], p, 1e-4), name
    client.drop_head("tied-grpo-run")
    client.drop_head("tied-grpo-run-ref")
