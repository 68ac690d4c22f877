"""TRL's DistillationTrainer with both LM heads on the real server (remotehead.trl): a tiny Llama
student (hidden 32) and a tiny Llama teacher (hidden 48), vocabulary 257, built from configs with
fixed seeds (no download), the character tokenizer of test_trl_grpo.py.

- One micro-batch through DistillationTrainer._compute_loss (prompts left-padded, completions of
  different lengths), with TRL's local heads and with offloaded ones, for beta 0 / 0.5 / 1,
  temperature, logit scale and softcap on either model's config (TRL reads them from there),
  num_items_in_batch or none, train and eval mode: the loss, the entropy sum and the count
  (relative 1e-5), every body parameter's gradient and the student head's dW fetched from the
  server (1e-5 of each tensor's magnitude). The teacher head accumulates nothing.
- A short on-policy run (3 optimizer steps of 2 micro-batches, completions of up to 8 tokens
  sampled at temperature 0.9 from the student — through the server's logits for the offloaded
  run): the completions are TRL's own run's with local heads token for token, and the per-step
  losses and logged entropies equal its (relative 1e-4), as do the completions' lengths; the server's student head advanced by exactly
  3 versions and matches the local run's lm_head (1e-4), the teacher's is untouched, and the
  trainer holds no W of either head (each released to one element) at every generation and at
  the end. Both ways in: `offload_distillation_heads(trainer, ...)` and
  `RemoteHeadDistillationTrainer(..., client=...)`.
- Two processes under torchrun (tests/python/trl_distillation_job.py, gloo): the offloaded run
  equals TRL's DDP run with local heads — per-step losses and entropies to 1e-5, the same
  completions' lengths, the student's head to 1e-5 and the body to 1e-4, the head's version +1
  per optimizer step (one synchronous step for both ranks): TRL's num_items_in_batch / W and
  DDP's averaging need no scaling of the remote loss.
- vLLM generation is refused.
"""

import math
import pathlib

import datasets
import pytest
import torch
import transformers
from trl import DistillationConfig, DistillationTrainer

import numerics
import remotehead
import remotehead.hf
from remotehead.trl import RemoteHeadDistillationTrainer, offload_distillation_heads
from test_trl_grpo import COMPLETION, VOCAB, char_tokenizer, prompts_and_completions



def tiny_llama(hidden, seed, head_scale=1.0, **config_extra):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    for key, value in config_extra.items():
        setattr(config, key, value)  # what TRL reads: logit_scale, final_logit_softcapping
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # a teacher far from the student: losses and gradients that matter
        model.lm_head.weight.mul_(head_scale)
    return model


def prompts(count=6):
    words = ["abc", "bca", "cab", "aab", "bba", "ccb", "acb", "bac"]
    return datasets.Dataset.from_dict(
        {"prompt": [words[i % 8] + "abc"[i // 8 % 3] * (i // 8) for i in range(count)]})


def config(tmp_path, **overrides):
    args = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, seed=0, report_to="none",
                save_strategy="no", disable_tqdm=True, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, max_completion_length=COMPLETION,
                activation_checkpointing=False, learning_rate=1e-3, logging_steps=1,
                temperature=0.9, beta=0.5)
    args.update(overrides)
    return DistillationConfig(**args)


def make(cls, args, student_extra=None, teacher_extra=None, dataset=None, **kwargs):
    return cls(model=tiny_llama(32, 0, **(student_extra or {})),
               teacher_model=tiny_llama(48, 1, head_scale=40.0, **(teacher_extra or {})),
               args=args,
               train_dataset=dataset if dataset is not None else prompts(),
               processing_class=char_tokenizer(), **kwargs)


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def batch():
    """What DistillationTrainer._compute_loss receives for one micro-batch."""
    return prompts_and_completions(torch.Generator().manual_seed(3))


CASES = {
    "forward-kl": dict(beta=0.0),
    "jsd-num_items": dict(beta=0.5, num_items=40.0),
    "reverse-kl-temperature": dict(beta=1.0, temperature=0.7),
    "jsd-scales-softcaps": dict(beta=0.3, temperature=1.2,
                                student_extra=dict(logit_scale=1.5, final_logit_softcapping=4.0),
                                teacher_extra=dict(logit_scale=0.8,
                                                   final_logit_softcapping=3.0)),
}


@pytest.mark.parametrize("case", CASES)
def test_compute_loss_and_gradients_match_trl(client, tmp_path, case):
    spec = dict(CASES[case])
    extras = dict(student_extra=spec.pop("student_extra", None),
                  teacher_extra=spec.pop("teacher_extra", None))
    num_items = spec.pop("num_items", None)
    args = config(tmp_path, **spec)
    head_id = f"distill-{case}"
    local = make(DistillationTrainer, args, **extras)
    remote = make(DistillationTrainer, args, **extras)
    student_head, teacher_head = offload_distillation_heads(remote, client, head_id)
    assert teacher_head.head_id == f"{head_id}-teacher" and not teacher_head.accumulate
    assert client.describe_head(teacher_head.head_id).frozen
    inputs = batch()
    n = None if num_items is None else torch.tensor(num_items)
    for t in (local, remote):
        t.model.train()
    local_loss, local_entropy, local_count = local._compute_loss(local.model, inputs, n)
    local_loss.backward()
    remote_loss, remote_entropy, remote_count = remote._compute_loss(remote.model, inputs, n)
    remote_loss.backward()
    assert int(remote_count) == int(local_count) == int(inputs["completion_mask"].sum())
    assert numerics.close(remote_loss.item(), local_loss.item(), 1e-5)
    assert numerics.close(remote_entropy.item(), local_entropy.item(), 1e-5)
    function = {0.0: "distill_kl", 1.0: "distill_reverse_kl"}.get(args.beta, "distill_jsd")
    assert student_head.last_result is not None
    assert student_head.last_result.loss == pytest.approx(remote_loss.item(), rel=1e-6)

    local_grads = {k: p.grad for k, p in local.model.named_parameters()}
    remote_grads = {k: p.grad for k, p in remote.model.named_parameters() if p.grad is not None}
    assert "lm_head.weight" not in remote_grads  # dW stayed on the server
    remote_grads["lm_head.weight"], _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 1
    assert remote_grads.keys() == local_grads.keys()
    for name, grad in local_grads.items():
        assert numerics.close(remote_grads[name], grad, 1e-5), name
    assert client.describe_head(teacher_head.head_id).accumulated_micro_batches == 0
    assert head_id in client.describe_head(teacher_head.head_id).teacher_of

    # Evaluation: no gradients, TRL's mean; a Forward on the server, nothing accumulated.
    for t in (local, remote):
        t.model.eval()
    with torch.no_grad():
        local_eval = local._compute_loss(local.model, inputs, None)
        remote_eval = remote._compute_loss(remote.model, inputs, None)
    assert numerics.close(remote_eval[0].item(), local_eval[0].item(), 1e-5)
    assert numerics.close(remote_eval[1].item(), local_eval[1].item(), 1e-5)
    assert client.describe_head(head_id).accumulated_micro_batches == 1
    assert function in client.functions()
    client.drop_head(head_id)
    client.drop_head(teacher_head.head_id)


def released(model):
    weight = model.get_output_embeddings().weight
    return weight.untyped_storage().nbytes() == weight.element_size()


@pytest.mark.parametrize("way", ["function", "subclass"])
def test_a_short_on_policy_run_equals_trls_with_local_heads(client, tmp_path, way):
    steps = 3
    args = config(tmp_path, max_steps=steps)
    # Each trainer seeds the RNGs at the end of its constructor: built and trained in turn, both
    # runs draw their completions from the same random stream.
    local = make(DistillationTrainer, args)
    local_generate, local_sequences = local.model.generate, []

    def recording_generate(*a, **kw):
        local_sequences.append(local_generate(*a, **kw))
        return local_sequences[-1]

    local.model.generate = recording_generate
    local.train()
    head_id = f"distill-run-{way}"
    if way == "function":
        remote = make(DistillationTrainer, args)
        offload_distillation_heads(remote, client, head_id, teacher_head_id="run-teacher")
    else:
        remote = make(RemoteHeadDistillationTrainer, args, client=client, head_id=head_id,
                      teacher_head_id="run-teacher")
    teacher_id = remote.remote_teacher_head.head_id
    assert teacher_id == "run-teacher"
    initial_teacher, _ = client.export_weights(teacher_id)
    student_model = remote.model
    teacher_model = remote.accelerator.unwrap_model(remote.teacher_model)
    assert released(student_model) and released(teacher_model)

    # Every generation samples from logits the server computed; no W is held when it runs.
    generate, at_generation, sequences = student_model.generate, [], []
    logits, logits_calls = client.logits, []

    def counting_logits(head, hidden, **kwargs):
        logits_calls.append(head)
        return logits(head, hidden, **kwargs)

    def checking_generate(*a, **kw):
        at_generation.append(released(student_model) and released(teacher_model))
        sequences.append(generate(*a, **kw))
        return sequences[-1]

    client.logits = counting_logits
    student_model.generate = checking_generate
    remote.train()
    assert at_generation == [True] * steps
    # The same prompts and completions: sampled from the server's logits as from the local ones.
    assert len(sequences) == len(local_sequences) == steps
    for a, b in zip(sequences, local_sequences):
        assert torch.equal(a, b)
    assert logits_calls and set(logits_calls) == {head_id}

    local_logs = [log for log in local.state.log_history if "loss" in log]
    remote_logs = [log for log in remote.state.log_history if "loss" in log]
    assert len(local_logs) == len(remote_logs) == steps
    for step, (a, b) in enumerate(zip(remote_logs, local_logs)):
        for key in ("loss", "entropy"):
            assert math.isfinite(a[key]) and abs(a[key] - b[key]) <= 1e-4 * abs(b[key]), \
                (step, key, a[key], b[key])
        for key in ("completions/mean_length", "completions/max_length", "num_tokens"):
            assert a[key] == b[key], (step, key)

    info = client.describe_head(head_id)
    assert info.weight_version == steps and info.accumulated_micro_batches == 0
    weight, _ = client.export_weights(head_id)
    assert numerics.close(weight, local.model.lm_head.weight.detach(), 1e-4)
    teacher_info = client.describe_head(teacher_id)
    assert teacher_info.frozen and teacher_info.weight_version == 0
    assert teacher_info.teacher_of == (head_id,)
    teacher_weight, _ = client.export_weights(teacher_id)
    assert torch.equal(teacher_weight, initial_teacher)
    assert released(student_model) and released(teacher_model)
    local_body = dict(local.model.named_parameters())
    for name, p in student_model.named_parameters():
        if name != "lm_head.weight":
            assert numerics.close(p.detach(), local_body[name].detach(), 1e-4), name
    client.drop_head(head_id)
    client.drop_head(teacher_id)


def test_two_processes_equal_trls_ddp_run_with_local_heads(server_target, tmp_path):
    from test_data_parallel import torchrun
    here = pathlib.Path(__file__).resolve().parent
    torchrun(2, here / "trl_distillation_job.py", f"--server={server_target}",
             "--head-id=ddp-distill", f"--out={tmp_path / 'remote.pt'}")
    torchrun(2, here / "trl_distillation_job.py", f"--out={tmp_path / 'local.pt'}")
    remote, local = torch.load(tmp_path / "remote.pt"), torch.load(tmp_path / "local.pt")
    assert remote["world_size"] == local["world_size"] == 2
    assert remote["version"] == 3  # one synchronous step per optimizer step, not one per rank
    assert len(remote["logs"]) == len(local["logs"]) == 3
    for step, (r, l) in enumerate(zip(remote["logs"], local["logs"])):
        for key in ("loss", "entropy"):
            assert abs(r[key] - l[key]) <= 1e-5 * abs(l[key]), (step, key, r[key], l[key])
        for key in ("completions/mean_length", "completions/max_length", "num_tokens"):
            assert r[key] == l[key], (step, key)
    assert numerics.close(remote["head"], local["head"], 1e-5)
    for name, p in local["body"].items():
        assert numerics.close(remote["body"][name], p, 1e-4), name
    with remotehead.Client(server_target) as c:
        assert c.describe_head("ddp-distill-teacher").weight_version == 0
        c.drop_head("ddp-distill")
        c.drop_head("ddp-distill-teacher")


def test_a_state_dict_loaded_into_the_teacher_keeps_its_head_frozen(client):
    """Trainer's resume loads a state dict into the offloaded teacher: the server's head takes
    the new W (replace, which keeps the frozen flag) and stays frozen; the trainer's copy stays
    released."""
    teacher = tiny_llama(48, 1)
    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    head = remotehead.hf.offload_lm_head(teacher, client, "reload-teacher", frozen=True)
    assert not head.accumulate and released(teacher)
    teacher.load_state_dict(state)
    info = client.describe_head("reload-teacher")
    assert info.frozen and info.weight_version == 1 and head.info.weight_version == 1
    weight, _ = client.export_weights("reload-teacher")
    assert torch.equal(weight, state["lm_head.weight"])
    assert released(teacher)
    client.drop_head("reload-teacher")


def test_vllm_generation_is_refused(client, tmp_path):
    trainer = make(DistillationTrainer, config(tmp_path))
    trainer.use_vllm = True  # as DistillationConfig(use_vllm=True) sets it (needs vLLM)
    with pytest.raises(ValueError, match="use_vllm: expected False"):
        offload_distillation_heads(trainer, client, "distill-vllm")
