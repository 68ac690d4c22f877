"""TRL's GRPOTrainer with the policy's LM head on the real server (remotehead.trl), on a tiny
Llama built from a config (vocab 257, hidden 32, 2 layers, fixed seeds, saved to a temporary
folder so TRL can load its reference model from it; no download) and a character-level
tokenizer built in memory.

- Parity for one batch: the inputs GRPOTrainer._compute_loss receives (left-padded prompts,
  completions of different lengths, advantages, old log-probs off the current policy so ratios
  clip (or none, on-policy), reference log-probs when beta > 0; temperature 0.7, epsilon 0.2 / 0.28, gradient
  accumulation 2, train mode) go through TRL's own _compute_loss with the local head and
  through RemoteHeadGRPOTrainer's. Compared, fp32: the loss (relative 1e-5; measured ≤ 2e-7),
  also in eval mode under no_grad; the per-token log-probs and entropies of the policy and the
  reference's log-probs from _get_per_token_logps_and_entropies (1e-5 of the largest
  magnitude); every parameter's gradient (1e-5 of each tensor's largest magnitude; measured
  ≤ 1.1e-6), the head's dW fetched from the server (or pulled into the tied parameter with
  gradients="local"); the global gradient norm (relative 1e-5); the logged kl / entropy /
  clip-ratio metrics (1e-5 absolute). grpo, bnpo, dr_grpo and dapo, with the plain KL or
  TRL's default bias-corrected one, are one fused server pass; sapo takes the two-phase path
  with TRL's own loss code.
- A short run (3 optimizer steps of 2 micro-batches, 4 completions of up to 8 tokens per
  prompt, a reward for early characters, beta > 0) completes: each generation samples from the
  server's current head, the server's head version advances by exactly 3 and its weights
  change, the frozen reference head is untouched, and the logged metrics are finite.
- With LoRA (peft_config) the head stays frozen on the server (no steps, nothing accumulated)
  and serves the reference (adapters off) too, while the adapters train.
- An entropy bonus (it would need the entropy's gradient) is refused.
- sampler_logprobs=True (GRPOConfig's top_k / top_p / min_p): the same parity against TRL
  whose policy head is the naive float64 one scoring each token under the renormalised
  truncated distribution (references.sampler_kept_mask: top-k, top-p, min-p in Hugging Face's
  order, after the temperature), the reference's log-probs and the entropies over the full
  softmax; the completions are drawn from that truncated distribution, token by token, as
  generate() draws them. The truncation is shown to matter (the full-softmax log-probs differ).
  With PEFT the reference (adapters off) stays full-softmax; a repetition penalty is refused.
"""

import math

import datasets
import peft
import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import FusedCausalLMOutput
from trl.trainer.utils import use_adapter as trl_use_adapter

import numerics
import references
import remotehead
from remotehead.trl import RemoteHeadGRPOTrainer

VOCAB = 257
BATCH, PROMPT, COMPLETION = 4, 5, 8


def char_tokenizer():
    """One token per character: 3 special tokens and 254 characters, as many as the model's
    vocabulary, so every sampled id decodes."""
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    chars += [chr(0x100 + i) for i in range(VOCAB - 3 - len(chars))]
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The tiny Llama, untied and tied, saved once: TRL builds its reference model from it."""
    dirs = {}
    for tied in (False, True):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=tied)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp("tied" if tied else "untied")
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        dirs[tied] = str(path)
    return dirs


def load(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def reward_early_characters(completions, **kwargs):
    # Continuous, so every group of completions has non-zero advantages.
    return [-sum(map(ord, c)) / max(len(c), 1) / 0x200 for c in completions]


def prompts():
    return datasets.Dataset.from_dict({"prompt": ["abc", "bca", "cab", "aab", "bba", "ccb"]})


def config(tmp_path, **overrides):
    args = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, seed=0,
                activation_checkpointing=False, report_to="none", save_strategy="no",
                disable_tqdm=True, per_device_train_batch_size=2, num_generations=4,
                gradient_accumulation_steps=2, max_completion_length=COMPLETION)
    args.update(overrides)
    return GRPOConfig(**args)


def trainer(cls, path, args, tokenizer, dtype=torch.float32, **kwargs):
    return cls(model=load(path, dtype), reward_funcs=reward_early_characters, args=args,
               train_dataset=prompts(), processing_class=tokenizer, **kwargs)


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def prompts_and_completions(g: torch.Generator) -> dict:
    """A micro-batch of BATCH left-padded prompts and completions as TRL's trainers hand them to
    _compute_loss (GRPO's and the DistillationTrainer's): two completions end early with EOS and
    are padded after it."""
    prompt_ids = torch.randint(3, VOCAB, (BATCH, PROMPT), generator=g)
    prompt_mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    prompt_mask[1, :2] = prompt_mask[3, :1] = 0  # left padding
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(3, VOCAB, (BATCH, COMPLETION), generator=g)
    completion_mask = torch.ones(BATCH, COMPLETION, dtype=torch.long)
    for row, length in ((0, 3), (2, 6)):  # ended early with EOS, then padding
        completion_ids[row, length - 1], completion_ids[row, length:] = 1, 0
        completion_mask[row, length:] = 0
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask}


def sampled_completions(local: GRPOTrainer, inputs, sampler, g: torch.Generator):
    """Completions drawn token by token from the local policy's float64 logits / temperature
    truncated by `sampler` (references.sampler_kept_mask) and renormalised — what generate()
    with these top_k / top_p / min_p draws — so every scored token is in the kept set. Tokens
    past a completion's end stay padding."""
    ids = inputs["completion_ids"].clone()
    weight = local.model.lm_head.weight.detach().double()
    for t in range(COMPLETION):
        with torch.no_grad():
            hidden = local.model.base_model(
                input_ids=torch.cat([inputs["prompt_ids"], ids[:, :t]], 1),
                attention_mask=torch.cat([inputs["prompt_mask"],
                                          torch.ones(BATCH, t, dtype=torch.long)], 1),
                use_cache=False).last_hidden_state[:, -1]
        z = hidden.double() @ weight.t() / local.temperature
        keep = references.sampler_kept_mask(z, sampler)
        ids[:, t] = torch.multinomial(torch.softmax(z.masked_fill(~keep, -torch.inf), 1), 1,
                                      generator=g)[:, 0]
    ids[inputs["completion_mask"] == 0] = 0
    inputs["completion_ids"] = ids


def batch(local: GRPOTrainer, beta: float, on_policy: bool, dtype=torch.float32,
          vllm=False, sampler=None):
    """What GRPOTrainer._compute_loss receives for one micro-batch of 4 completions; with
    `vllm`, also the sampler's log-probs and vLLM's importance-sampling ratio: True, per token
    (B, T) (exactly 1 at the padding, as TRL makes it); "sequence", per completion (B, 1); with
    `sampler`, completions drawn under that truncation."""
    g = torch.Generator().manual_seed(3)
    inputs = prompts_and_completions(g)
    if sampler:
        sampled_completions(local, inputs, sampler, g)
    inputs.update(advantages=torch.randn(BATCH, generator=g).to(dtype),
                  num_items_in_batch=inputs["completion_mask"].sum())
    with torch.no_grad():
        logps, _, _ = local._get_per_token_logps_and_entropies(
            local.model, *joined(inputs), COMPLETION)
    # Off-policy, old log-probs off the current ones: ratios e^{±0.3} reach both clip bounds.
    # On-policy TRL leaves them out (the ratio is then exactly 1).
    noise = lambda scale: scale * torch.randn(logps.shape, generator=g).to(dtype)  # noqa: E731
    if not on_policy:
        inputs["old_per_token_logps"] = logps + noise(0.3)
    if beta:
        inputs["ref_per_token_logps"] = logps + noise(0.2)
    if vllm:
        inputs["sampling_per_token_logps"] = logps + noise(0.3)
        log_ratio = noise(0.2) * inputs["completion_mask"]
        if vllm == "sequence":
            # TRL's sequence_* modes (sequence_mask, its default): one ratio per completion,
            # (B, 1), exp of the completion's summed differences; sequence_mask's 0 for one
            # outside its bounds.
            ratio = torch.exp(log_ratio.sum(-1, keepdim=True))
            ratio[3] = 0.0
            inputs["importance_sampling_ratio"] = ratio
        else:
            inputs["importance_sampling_ratio"] = torch.exp(log_ratio)
    return inputs


def joined(inputs):
    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))


def naive_float64_head(t: GRPOTrainer, sampler=None) -> None:
    """TRL's fused LM head of the policy and the reference replaced by the naive float64 one —
    full logits / temperature, log_softmax, the targets' log-probs and the entropies — so that
    TRL's _compute_loss runs in float64 end to end (TRL's own chunked kernel computes in fp32).
    `sampler` (top_k / top_p / min_p; `t.naive_sampler`, which a test may change): the policy's
    log-probs under the truncated distribution, renormalised over the kept set
    (references.sampler_kept_mask); the reference's log-probs and the entropies stay full."""
    t.naive_sampler = sampler
    for model in (t.model, t.ref_model):
        if model is None:
            continue
        original = model.forward

        def forward(*args, fused_lm_head=False, labels=None, shift_labels=None,
                    num_items_in_batch=None, model=model, original=original, **kwargs):
            if not fused_lm_head:
                return original(*args, labels=labels, shift_labels=shift_labels,
                                num_items_in_batch=num_items_in_batch, **kwargs)
            kwargs["use_cache"] = False
            hidden = model.base_model(*args, **kwargs).last_hidden_state[:, :-1]
            labels = labels[:, 1:]
            mask = labels != -100
            z = hidden @ model.lm_head.weight.t() / t.temperature
            log_p = torch.log_softmax(z, -1)
            entropy = -(log_p.exp() * log_p).sum(-1) * mask
            if t.naive_sampler and model is t.model:
                keep = references.sampler_kept_mask(z.flatten(0, 1), t.naive_sampler)
                log_p = torch.log_softmax(z.masked_fill(~keep.view(z.shape), -torch.inf), -1)
            # where, not × mask: outside the kept set an ignored position's stand-in target
            # has −inf, and −inf · 0 is NaN.
            logps = torch.where(mask, log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0],
                                0.0)
            count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
            return FusedCausalLMOutput(loss=-logps.sum() / count, log_probs=logps,
                                       entropy=entropy, label_mask=mask)

        model.forward = forward


def per_token(trainer_, model, inputs, entropy=True):
    """The completion tokens' log-probs (and entropies) as GRPOTrainer computes them."""
    with torch.no_grad():
        logps, entropies, _ = trainer_._get_per_token_logps_and_entropies(
            model, *joined(inputs), COMPLETION, compute_entropy=entropy)
    mask = inputs["completion_mask"].bool()
    return logps[mask], entropies[mask] if entropy else None


# Every loss type is one server call ("fused"); fp32 cases hold 1e-5, the float64 ones
# ("float64": the model and the server's head in float64) hold 1e-9 — exact but for the order of
# float64 sums. vllm: TRL's vLLM importance-sampling correction on (use_vllm and
# vllm_importance_sampling_correction set after construction: the loss code reads only these),
# with the sampler's log-probs for the off-policy mask; vllm="sequence": the ratio of TRL's
# sequence_* modes, one per completion (B, 1) — every loss type (TRL's __init__ refuses it with
# vespo and use_vllm, but its _compute_loss reads it: Σ log r over (B, 1) counts r once).
F64 = dict(dtype=torch.float64)
CASES = {
    "dapo-fused": dict(loss_type="dapo", beta=0.0),
    "dapo-on_policy-fused": dict(loss_type="dapo", beta=0.0),
    "dapo-beta-fused": dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False),
    "grpo-fused": dict(loss_type="grpo", beta=0.0),
    "grpo-beta-fused": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    "bnpo-beta-fused": dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=False),
    "dr_grpo-fused": dict(loss_type="dr_grpo", beta=0.0),
    "dapo-beta-bias_corrected_kl-fused": dict(loss_type="dapo", beta=0.04),
    "grpo-beta-bias_corrected_kl-fused": dict(loss_type="grpo", beta=0.04),
    "sapo-fused": dict(loss_type="sapo", beta=0.0),
    "dapo-beta-tied-local_gradients-fused": dict(loss_type="dapo", beta=0.04,
                                                 use_bias_correction_kl=False),
    # Every loss type, float64, with the bias-corrected KL (TRL's default).
    **{f"{t}-beta-float64-fused": dict(loss_type=t, beta=0.04, **F64)
       for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")},
    "cispo-eps5-float64-fused": dict(loss_type="cispo", beta=0.0, epsilon_high=1.1, **F64),
    "grpo-sequence-float64-fused": dict(loss_type="grpo", beta=0.04,
                                        importance_sampling_level="sequence", **F64),
    "luspo-sequence-float64-fused": dict(loss_type="luspo", beta=0.0,
                                         importance_sampling_level="sequence", **F64),
    "sapo-sequence-float64-fused": dict(loss_type="sapo", beta=0.04,
                                        importance_sampling_level="sequence", **F64),
    "dapo-delta-float64-fused": dict(loss_type="dapo", beta=0.0, delta=1.1, **F64),
    "dapo-vllm-off_policy_mask-float64-fused": dict(loss_type="dapo", beta=0.04, vllm=True,
                                                    off_policy_mask_threshold=0.02, **F64),
    "grpo-vllm-float64-fused": dict(loss_type="grpo", beta=0.04, vllm=True, **F64),
    "vespo-vllm-float64-fused": dict(loss_type="vespo", beta=0.0, vllm=True, **F64),
    # Every loss type with the per-completion (B, 1) ratio.
    **{f"{t}-beta-vllm_sequence-float64-fused": dict(loss_type=t, beta=0.04, vllm="sequence",
                                                     **F64)
       for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")},
    "vespo-sequence-vllm_sequence-float64-fused": dict(
        loss_type="vespo", beta=0.0, importance_sampling_level="sequence", vllm="sequence",
        **F64),
    "bnpo-top_entropy-float64-fused": dict(loss_type="bnpo", beta=0.04,
                                           top_entropy_quantile=0.5, **F64),
    "grpo-sequence-top_entropy-vllm-float64-fused": dict(
        loss_type="grpo", beta=0.04, importance_sampling_level="sequence",
        top_entropy_quantile=0.6, vllm=True, off_policy_mask_threshold=0.02, **F64),
    # sampler_logprobs=True: the policy's log-probs under GRPOConfig's truncation.
    "grpo-beta-sampler-float64-fused": dict(loss_type="grpo", beta=0.04, top_k=40, top_p=0.9,
                                            min_p=0.05, sampler=True, **F64),
    "dapo-top_p-sampler-float64-fused": dict(loss_type="dapo", beta=0.0, top_p=0.8,
                                             sampler=True, **F64),
    "vespo-beta-min_p-sampler-float64-fused": dict(loss_type="vespo", beta=0.04, min_p=0.8,
                                                   sampler=True, **F64),
}
SAMPLER_KEYS = ("top_k", "top_p", "min_p")


@pytest.mark.parametrize("case", CASES)
def test_compute_loss_log_probs_and_gradients_match_trl(client, model_dirs, tmp_path, case):
    tokenizer = char_tokenizer()
    options = dict(CASES[case])
    dtype, vllm = options.pop("dtype", torch.float32), options.pop("vllm", False)
    sampler = ({k: options[k] for k in SAMPLER_KEYS if k in options}
               if options.pop("sampler", False) else None)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    beta, tied = options["beta"], "tied" in case
    options.setdefault("epsilon_high", 0.28)
    args = config(tmp_path, temperature=0.7, epsilon=0.2, **options)
    head_id = f"grpo-{case}"
    local = trainer(GRPOTrainer, model_dirs[tied], args, tokenizer, dtype)
    if dtype == torch.float64:
        naive_float64_head(local, sampler)
    remote = trainer(RemoteHeadGRPOTrainer, model_dirs[tied], args, tokenizer, dtype,
                     client=client, head_id=head_id, gradients="local" if tied else "server",
                     sampler_logprobs=sampler is not None)
    if sampler:
        assert remote.sampler_params == {"top_k": float(sampler.get("top_k", 0)),
                                         "top_p": float(sampler.get("top_p", 1.0)),
                                         "min_p": float(sampler.get("min_p", 0.0)),
                                         "min_p_first": 0.0}
    else:
        assert remote.sampler_params == {}
    assert remote.fused_grpo_loss == case.endswith("fused")
    assert remote.fused_grpo_fallback is None
    assert (remote.remote_ref_head is not None) == (beta != 0)
    for t in (local, remote):
        t.model.train()
        t.current_gradient_accumulation_steps = 2  # as Trainer sets it during training
        if vllm:
            t.use_vllm = t.vllm_importance_sampling_correction = True
    inputs = batch(local, beta, on_policy="on_policy" in case, dtype=dtype, vllm=vllm,
                   sampler=sampler)

    local_logps, local_entropy = per_token(local, local.model, inputs)
    remote_logps, remote_entropy = per_token(remote, remote.model, inputs)
    assert numerics.close(remote_logps, local_logps, tol)
    if sampler:  # every drawn token is kept, and the truncation changes its log-prob
        assert remote_logps.isfinite().all()
        local.naive_sampler = None
        full_logps, _ = per_token(local, local.model, inputs, entropy=False)
        local.naive_sampler = sampler
        assert (remote_logps - full_logps).min() > 1e-3
    assert numerics.close(remote_entropy, local_entropy, tol)
    if beta:
        local_ref, _ = per_token(local, local.ref_model, inputs, entropy=False)
        remote_ref, _ = per_token(remote, remote.ref_model, inputs, entropy=False)
        assert numerics.close(remote_ref, local_ref, tol)
    for t in (local, remote):
        t._metrics["train"].clear()

    local_loss = local._compute_loss(local.model, inputs)
    local_loss.backward()
    remote_loss = remote._compute_loss(remote.model, inputs)
    remote_loss.backward()
    assert abs(remote_loss.item() - local_loss.item()) <= tol * abs(local_loss.item())
    if remote.fused_grpo_loss:  # the loss came from the server's fused pass
        assert remote.remote_head.last_result.loss == pytest.approx(remote_loss.item(),
                                                                    rel=min(tol, 1e-6))

    local_grads = {n: p.grad for n, p in local.model.named_parameters()}
    remote_grads = {n: p.grad for n, p in remote.model.named_parameters() if p.grad is not None}
    if not tied:  # dW stayed on the server
        assert "lm_head.weight" not in remote_grads
        remote_grads["lm_head.weight"], _, info = client.fetch_gradients(head_id)
        assert info.accumulated_micro_batches == 1
    assert remote_grads.keys() == local_grads.keys()
    for name, grad in local_grads.items():
        # A float64 head accumulates dW in float64 (core::AccumulationDtype): the head's dW holds
        # the same 1e-9 as every other gradient.
        assert numerics.close(remote_grads[name], grad, tol), name
    norm = torch.cat([g.flatten() for g in local_grads.values()]).norm().item()
    remote_norm = torch.cat([g.flatten() for g in remote_grads.values()]).norm().item()
    assert abs(remote_norm - norm) <= tol * norm

    # Evaluation (eval mode, no gradients): TRL's unscaled loss; nothing accumulates.
    for t in (local, remote):
        t.model.eval()
    with torch.no_grad():
        local_eval = local._compute_loss(local.model, inputs).item()
        remote_eval = remote._compute_loss(remote.model, inputs).item()
    assert abs(remote_eval - local_eval) <= tol * abs(local_eval)
    if not tied:
        assert client.describe_head(head_id).accumulated_micro_batches == 1

    local_metrics, remote_metrics = local._metrics["train"], remote._metrics["train"]
    assert remote_metrics.keys() == local_metrics.keys()
    if "clip_ratio/region_mean" in local_metrics:  # off-policy, the clipped objectives clip
        assert (local_metrics["clip_ratio/region_mean"][0] > 0) == ("on_policy" not in case)
    for key, values in local_metrics.items():
        # Relative, with values below 1 (ratios, small KLs) held to 1e-5 absolute.
        assert numerics.close(remote_metrics[key], values, tol, floor=1.0), key

    client.drop_head(head_id)
    if beta:
        client.drop_head(f"{head_id}-ref")


def test_a_short_grpo_run_trains_the_remote_head(client, model_dirs, tmp_path):
    steps = 3
    args = config(tmp_path, max_steps=steps, beta=0.04, use_bias_correction_kl=False,
                  learning_rate=1e-2, logging_steps=1)
    grpo = trainer(RemoteHeadGRPOTrainer, model_dirs[False], args, char_tokenizer(),
                   client=client, head_id="grpo-run")
    assert grpo.fused_grpo_loss
    before = client.describe_head("grpo-run").weight_version
    initial, _ = client.export_weights("grpo-run")
    ref_initial, _ = client.export_weights("grpo-run-ref")
    # Each generation (one per optimizer step here) samples from the server's current head:
    # the trainer holds no copy of W, and the logits of every decode step come from the server.
    generate, released_at_generation = grpo.model.generate, []
    logits, logits_rows = client.logits, []

    def logits_and_count(head_id, hidden, **kwargs):
        logits_rows.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return logits(head_id, hidden, **kwargs)

    def generate_and_check(*args, **kwargs):
        weight = grpo.model.lm_head.weight
        released_at_generation.append(weight.untyped_storage().nbytes() == weight.element_size())
        return generate(*args, **kwargs)

    client.logits = logits_and_count
    grpo.model.generate = generate_and_check
    grpo.train()
    assert released_at_generation == [True] * steps
    # One row per sequence of a generation batch (its last position), never [B, T] rows.
    assert logits_rows and max(logits_rows) <= args.generation_batch_size

    info = client.describe_head("grpo-run")
    assert info.weight_version == before + steps
    assert info.accumulated_micro_batches == 0
    weight, _ = client.export_weights("grpo-run")
    assert not torch.allclose(weight, initial)
    assert not grpo.remote_head.has_local_copy
    ref_weight, _ = client.export_weights("grpo-run-ref")
    assert torch.equal(ref_weight, ref_initial)
    assert client.describe_head("grpo-run-ref").accumulated_micro_batches == 0

    logs = [log for log in grpo.state.log_history if "loss" in log]
    assert len(logs) == steps
    for log in logs:
        for key in ("loss", "reward", "entropy", "kl", "grad_norm", "clip_ratio/region_mean"):
            assert math.isfinite(log[key]), (key, log)
    client.drop_head("grpo-run")
    client.drop_head("grpo-run-ref")


def test_a_lora_grpo_run_keeps_the_frozen_head_on_the_server(client, model_dirs, tmp_path):
    # The reference is the policy with its adapters off: the same frozen server head serves it.
    args = config(tmp_path, max_steps=2, beta=0.04, use_bias_correction_kl=False,
                  learning_rate=1e-2, logging_steps=1)
    torch.manual_seed(1)  # the adapters' initialisation
    grpo = trainer(RemoteHeadGRPOTrainer, model_dirs[False], args, char_tokenizer(),
                   client=client, head_id="grpo-lora",
                   peft_config=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                               target_modules=["q_proj", "v_proj"]))
    assert grpo.remote_ref_head is None and not grpo.remote_head.accumulate
    initial, _ = client.export_weights("grpo-lora")
    adapters = {n: p.detach().clone() for n, p in grpo.model.named_parameters()
                if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    grpo.train()

    info = client.describe_head("grpo-lora")
    assert info.weight_version == 0 and info.accumulated_micro_batches == 0
    weight, _ = client.export_weights("grpo-lora")
    assert torch.equal(weight, initial)
    trained = dict(grpo.model.named_parameters())
    assert any(not torch.equal(trained[n].detach(), p) for n, p in adapters.items())
    logs = [log for log in grpo.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log[k]) for log in logs
                                  for k in ("loss", "kl", "entropy"))
    client.drop_head("grpo-lora")


def test_an_entropy_bonus_is_refused(client, model_dirs, tmp_path):
    with pytest.raises(ValueError, match="entropy_coef: expected 0"):
        trainer(RemoteHeadGRPOTrainer, model_dirs[False], config(tmp_path, entropy_coef=0.01),
                char_tokenizer(), client=client, head_id="grpo-refused")


def test_sampler_logprobs_keep_a_lora_reference_full_softmax(client, model_dirs, tmp_path):
    # With PEFT the policy's head serves the reference (adapters off): the policy's log-probs
    # are the truncated distribution's, the reference's the full softmax's. Fresh adapters
    # (lora_B = 0) change no hidden state, so one float64 reference serves both.
    sampler = {"top_k": 40, "top_p": 0.9}
    args = config(tmp_path, beta=0.04, temperature=0.7, **sampler)
    grpo = trainer(RemoteHeadGRPOTrainer, model_dirs[False], args, char_tokenizer(),
                   client=client, head_id="grpo-lora-sampler", sampler_logprobs=True,
                   peft_config=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                               target_modules=["q_proj", "v_proj"]))
    inputs = prompts_and_completions(torch.Generator().manual_seed(5))
    input_ids, attention_mask = joined(inputs)
    weight, _ = client.export_weights("grpo-lora-sampler")
    with torch.no_grad():
        hidden = grpo.model.get_base_model().model(
            input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    z = (hidden[:, PROMPT - 1:-1].double() @ weight.double().t() / 0.7).flatten(0, 1)
    targets = inputs["completion_ids"].flatten()
    mask = inputs["completion_mask"].flatten().bool()
    keep = references.sampler_kept_mask(z, sampler)
    truncated = torch.log_softmax(z.masked_fill(~keep, -torch.inf), 1)
    truncated = truncated.gather(1, targets[:, None])[:, 0][mask]
    full = torch.log_softmax(z, 1).gather(1, targets[:, None])[:, 0][mask]

    policy, _ = per_token(grpo, grpo.model, inputs, entropy=False)
    with trl_use_adapter(grpo.accelerator.unwrap_model(grpo.model), None):
        reference, _ = per_token(grpo, grpo.model, inputs, entropy=False)
    assert numerics.close(policy, truncated, 1e-5)  # −inf where a random token is not kept
    assert (~policy.isfinite()).any() and policy.isfinite().any()
    assert numerics.close(reference, full, 1e-5)
    client.drop_head("grpo-lora-sampler")


def test_sampler_logprobs_refuse_a_logits_processor_the_server_does_not_apply(
        client, model_dirs, tmp_path):
    args = config(tmp_path, top_k=40, repetition_penalty=1.1)
    with pytest.raises(ValueError) as error:
        trainer(RemoteHeadGRPOTrainer, model_dirs[False], args, char_tokenizer(), client=client,
                head_id="grpo-refused", sampler_logprobs=True)
    assert str(error.value) == ("repetition_penalty: expected 1.0 with sampler_logprobs=True "
                                "(the server scores tokens under top_k / top_p / min_p only); "
                                "got 1.1")
