"""TRL's GRPOTrainer and DistillationTrainer with their LM heads on a remotehead server.

DistillationTrainer (on-policy distillation, generalized JSD): one call moves both heads,

    from remotehead.trl import offload_distillation_heads
    trainer = DistillationTrainer(model=student, teacher_model=teacher,
                                  args=DistillationConfig(...), train_dataset=prompts,
                                  processing_class=tokenizer)
    offload_distillation_heads(trainer, remotehead.Client("head-server:50051"), "student")
    trainer.train()

(or `RemoteHeadDistillationTrainer(..., client=..., head_id="student")`): see
`offload_distillation_heads` below and docs/distillation.md.

GRPOTrainer:

    from remotehead.trl import RemoteHeadGRPOTrainer
    trainer = RemoteHeadGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                    train_dataset=data, processing_class=tokenizer,
                                    client=remotehead.Client("head-server:50051"),
                                    head_id="policy")
    trainer.train()

GRPOTrainer computes every per-token quantity through one hook, its fused LM head
(`model(..., labels=labels, fused_lm_head=True)`); this trainer routes that hook to the server:

- log-probs of the policy: a `Forward` ("token_logprobs") under no_grad (old policy), the
  two-phase path with gradients (dL/dlogp goes back to the server, which returns dX and
  accumulates dW); entropies: a `Forward` ("entropy"), without gradient;
- the reference model (beta > 0) is a second, frozen head on the server (`<head_id>-ref`,
  Forward only); with PEFT the reference is the policy with its adapters off, so the policy's
  head serves it;
- the policy loss, for every TRL loss type (grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo,
  vespo), both importance_sampling_levels, two-sided clipping (delta), the KL (plain or
  bias-corrected), the vLLM importance-sampling correction, the off-policy sequence mask and
  top_entropy_quantile < 1: one `ForwardBackward` of the server's policy loss ("grpo",
  "cispo", "sapo" or "vespo"), the loss type's normalisation being per-token weights and a
  normalizer (remotehead._grpo_loss; `fused_grpo_loss` is True). A sequence-level loss is
  row-coupled: the server computes the call's log-probs, then the loss, then dX and dW (two
  passes, still one call). The top-entropy mask is TRL's own get_high_entropy_mask on the
  server's entropies (its quantile spans every process's tokens, which no one call holds),
  sent as the aux policy_mask. A loss type or level this module does not know falls back to
  TRL's own loss code on the two-phase log-probs; `fused_grpo_fallback` then says why, as data
  ({"option", "value", "reason"}).
- `sampler_logprobs=True` (off by default: TRL scores tokens under the full softmax): the
  policy's log-probs (current and old, and so the importance ratios and the policy loss) are
  taken under the distribution the trainer samples from — the generation config's `top_k`,
  `top_p`, `min_p` after the temperature, in Hugging Face's order — renormalised over the kept
  set (the server's `token_logprobs` / policy-loss sampler params; docs/engine.md, "The
  sampler's distribution"). The fused loss takes them too. The reference's log-probs (its own
  model, or the policy's head with PEFT adapters off) and the entropies stay full-softmax: the
  KL is then to the sampler's distribution, finite, where the reference truncated by its own
  kept set would give −inf log-probs to tokens it would not draw.

The head is trained as `remotehead.hf.offload_lm_head` trains it: `gradients="server"` (server
AdamW at each optimizer step with the trainer's hyper-parameters and current learning rate; the
trainer keeps no copy of W: generation gets the last position's logits from the server and
checkpoints stream the head from it — with keep_local_copy=True the local lm_head generates and
is refreshed from the server before the next generation or save; `max_grad_norm` clips the local
parameters only) or `gradients="local"` (dW
pulled into the lm_head parameter, which the trainer's optimizer and clipping see); a head that
PEFT froze gets dX only. A tied model's input embedding (the policy's and the reference's) is
served by its head in server mode (remotehead.hf.tied). Refused: vLLM generation, an entropy
bonus (entropies have no gradient here), an MoE router loss, sync_ref_model, logit scales
other than temperature and softcap, adapters on the head.

Several processes (torchrun, accelerate launch; DDP): every rank runs this trainer with the
same client and head_id — rank 0 uploads, the others attach (`offload_lm_head`), each rank's dW
accumulates under its own trainer id and `optimizer_step` is the server's synchronous step
(one step with the ranks' summed dW × 1/W, as DDP averages the body's gradients). TRL's
per-rank loss needs nothing more: grpo, sapo, bnpo, dr_grpo and luspo normalise over the
rank's own micro-batch, dapo, cispo and vespo by the token count gathered over the generation
batch / num_processes (`_grpo_loss.weights` uses the same gathered count), and GRPOTrainer.compute_loss does not
multiply the loss by the number of processes (as Trainer's does under
average_tokens_across_devices), so the upstream gradient stays 1 (RemoteHeadCallback's
trainer_loss_scale is offload_lm_head's loss route only, not this one). The logged kl,
entropy, clip-ratio and VESPO metrics are reduced over the ranks as TRL's are.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import types
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from trl import DistillationTrainer, GRPOTrainer
from trl.trainer import distillation_trainer as _distillation
from trl.trainer.utils import FusedCausalLMOutput

from remotehead import _grpo_loss
from remotehead.autograd import RemoteHead
from remotehead.client import Client
from remotehead.hf import OffloadedHead, RemoteHeadCallback, accumulation_window_ends, \
    head_params, offload_lm_head

logger = logging.getLogger(__name__)

class _RemoteFusedLMHead:
    """Replaces TRL's fused LM head of one model by the server's head. With `fused_lm_head=True`
    the model runs its body and returns a FusedCausalLMOutput whose per-token fields (those in
    `outputs`) come from the server; `remotehead_loss` (a step spec whose per-token tensors are
    aligned to the last positions of the shifted labels) makes the loss one fused server pass.
    Without it the forward is TRL's, so generation uses the local lm_head."""

    def __init__(self, model, head: RemoteHead, params: dict, trl_forward):
        self.head = head
        self.params = params
        # The sampler's truncation for the log-prob functions (token_logprobs and the policy
        # losses); empty: the full softmax, TRL's. Never for entropies (TRL's are full-softmax).
        self.sampler: dict = {}
        self.outputs: Sequence[str] = ("log_probs", "entropy")

        # TRL's signature is kept: generate() validates its model kwargs against it.
        @functools.wraps(type(model).forward)
        def forward(model_self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                    num_items_in_batch=None, remotehead_loss=None, **kwargs):
            if not fused_lm_head:
                return trl_forward(*args, labels=labels, shift_labels=shift_labels,
                                   num_items_in_batch=num_items_in_batch, **kwargs)
            return self._fused(model_self, args, kwargs, labels, shift_labels,
                               num_items_in_batch, remotehead_loss)

        model.forward = types.MethodType(forward, model)

    def _per_token(self, rows, targets, function):
        params = self.params if function == "entropy" else {**self.params, **self.sampler}
        return self.head.client.forward(self.head.head_id, rows, targets, function=function,
                                        params=params).outputs.to(rows.device)

    def _fused(self, model, args, kwargs, labels, shift_labels, num_items_in_batch, loss_spec):
        kwargs["use_cache"] = False
        hidden = model.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        mask = labels != -100
        if not mask.any():
            # Nothing to score: a zero still connected to the body, as TRL's masked_scatter.
            zeros = hidden.sum(-1) * 0.0
            return FusedCausalLMOutput(loss=zeros.sum(), log_probs=zeros, entropy=zeros.detach(),
                                       label_mask=mask)
        # Only the scored rows travel, in fp32 (autocast may have made bf16) or a float64
        # model's float64 (the server computes in the head's dtype).
        rows, targets = hidden[mask], labels[mask]
        rows = rows if rows.dtype == torch.float64 else rows.float()

        def scatter(values):
            return values.new_zeros(mask.shape).masked_scatter(mask, values)

        def select(per_token):
            return F.pad(per_token, (mask.shape[1] - per_token.shape[1], 0))[mask]

        pull = accumulation_window_ends()
        loss = log_probs = entropy = None
        if loss_spec is not None:
            spec = dict(loss_spec, params={**self.params, **self.sampler,
                                           **loss_spec.get("params", {})})
            policy_mask = spec.pop("policy_mask_from_entropy", None)
            completion_length = spec.pop("completion_length", None)
            if spec.get("weights") is not None:
                spec["weights"] = select(spec["weights"])
            aux = dict(spec.get("aux", {}))
            if policy_mask is not None:  # TRL's entropy mask needs the entropies first
                entropy = scatter(self._per_token(rows, targets, "entropy"))
                aux["policy_mask"] = policy_mask(entropy[:, -completion_length:])
            spec["aux"] = {k: select(v) for k, v in aux.items()}
            loss = self.head.loss(rows, targets, pull_gradients=pull, **spec)
        if "log_probs" in self.outputs:
            if loss is None and torch.is_grad_enabled() and rows.requires_grad:
                log_probs = self.head.token_outputs(rows, targets, function="token_logprobs",
                                                    params={**self.params, **self.sampler},
                                                    pull_gradients=pull)
            else:
                log_probs = self._per_token(rows, targets, "token_logprobs")
            log_probs = scatter(log_probs)
        if "entropy" in self.outputs and entropy is None:
            entropy = scatter(self._per_token(rows, targets, "entropy"))
        if loss is None and log_probs is not None:
            # TRL's FusedCausalLMOutput.loss: the NLL, summed over valid tokens and normalised.
            count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
            loss = -log_probs.sum() / count
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy,
                                   label_mask=mask)


def _peft_reference_active(model) -> bool:
    """Whether `model` is a PEFT model computing TRL's reference: adapters disabled
    (`disable_adapter()`) or the adapter named "ref" active (TRL's use_adapter)."""
    if not is_peft_model(model):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    if getattr(model, "active_adapter", None) == "ref":
        return True
    return any(layer.disable_adapters for layer in model.modules()
               if isinstance(layer, BaseTunerLayer))


def _install(model, client: Client, head_id: str, temperature: float,
             **offload) -> _RemoteFusedLMHead:
    """Uploads `model`'s lm_head as `head_id` (offload_lm_head: its checks, its head, its
    freezing of a server-trained local copy) and routes TRL's fused LM head to it."""
    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, torch.nn.Linear):
        raise ValueError(f"lm_head: expected a torch.nn.Linear (adapters on the head are not "
                         f"supported); got {type(lm_head).__name__}")
    params = head_params(model, temperature)
    trl_forward = model.forward  # TRL's fused-head forward, which also serves generation
    head = offload_lm_head(model, client, head_id, **offload)
    # offload_lm_head's cross-entropy forward is replaced: GRPO needs TRL's per-token hook.
    return _RemoteFusedLMHead(model, head, params, trl_forward)


class RemoteHeadGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose policy LM head is `head_id` on the server behind `client`.

    gradients: "server" (default) or "local", as in `remotehead.hf.offload_lm_head`; a head
    that PEFT froze is frozen on the server too (dX only). keep_local_copy: as in
    offload_lm_head (default: no local W in server mode, for the policy and the reference). `remote_head` is the policy's
    OffloadedHead, `remote_ref_head` the reference's (or None), `fused_grpo_loss` whether the
    policy loss is one fused server pass. sampler_logprobs: the policy's log-probs under the
    generation's top-k / top-p / min-p distribution (see the module's docstring; off: the
    full softmax, as TRL); `sampler_params` is what the server is sent ({} when off).
    """

    def __init__(self, *args, client: Client, head_id: str = "policy",
                 gradients: str = "server", keep_local_copy: Optional[bool] = None,
                 sampler_logprobs: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self.sampler_params = self._sampler_params() if sampler_logprobs else {}
        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        trainable = policy.get_output_embeddings().weight.requires_grad
        self._policy_route = _install(policy, client, head_id, self.temperature,
                                      trainable=trainable, gradients=gradients,
                                      keep_local_copy=keep_local_copy)
        self.remote_head: OffloadedHead = self._policy_route.head
        self._policy_route.sampler = self.sampler_params
        self._routes = [self._policy_route]
        self.remote_ref_head: Optional[OffloadedHead] = None
        if self.ref_model is not None:
            ref = _install(self.accelerator.unwrap_model(self.ref_model), client,
                           f"{head_id}-ref", self.temperature, trainable=False)
            self._routes.append(ref)
            self.remote_ref_head = ref.head
        self._synced_step = self.remote_head.step
        self.fused_grpo_fallback = _grpo_loss.fallback_reason(self)
        self.fused_grpo_loss = self.fused_grpo_fallback is None
        logger.info("remotehead: GRPO policy loss %s", "in one server call" if
                    self.fused_grpo_loss else
                    f"two-phase with TRL's loss code ({self.fused_grpo_fallback})")
        self.add_callback(RemoteHeadCallback(self.remote_head))

    def _refuse_unsupported(self) -> None:
        args = self.args
        if self.use_vllm:
            raise ValueError("use_vllm: expected False (vLLM generates with weights the server "
                             "does not update); got True")
        if self._entropy_bonus_enabled:
            raise ValueError(f"entropy_coef: expected 0 and use_adaptive_entropy False (entropies "
                             f"come from the server without gradient); got {self.entropy_coef}")
        if self.aux_loss_enabled:
            raise ValueError("router_aux_loss_coef: expected 0 (the MoE load-balancing loss is "
                             "not computed with the remote head); got "
                             f"{self.router_aux_loss_coef}")
        if args.sync_ref_model and self.ref_model is not None:
            raise ValueError("sync_ref_model: expected False (the reference head on the server "
                             "is frozen); got True")

    def _sampler_params(self) -> dict:
        """The server's sampler params for the truncation the trainer generates with (HF's
        generate: the generation config TRL built from GRPOConfig and its generation_kwargs).
        A logits processor the server does not reproduce is refused: the log-probs would not be
        those of the distribution the tokens were drawn from."""
        config = self.generation_config
        for name, off in (("repetition_penalty", 1.0), ("typical_p", 1.0),
                          ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0)):
            value = getattr(config, name, None)
            if value is not None and value != off:
                raise ValueError(f"{name}: expected {off} with sampler_logprobs=True (the server "
                                 f"scores tokens under top_k / top_p / min_p only); got {value}")
        # HF's order: top-k, top-p, min-p (min_p_first 0); None and 0 / 1.0 are off.
        return {"top_k": float(config.top_k or 0),
                "top_p": float(config.top_p if config.top_p is not None else 1.0),
                "min_p": float(config.min_p or 0.0), "min_p_first": 0.0}

    @contextlib.contextmanager
    def _requesting(self, outputs: Sequence[str]):
        """The per-token fields the server computes for the next fused-head calls."""
        previous = [route.outputs for route in self._routes]
        for route in self._routes:
            route.outputs = outputs
        try:
            yield
        finally:
            for route, before in zip(self._routes, previous):
                route.outputs = before

    def _get_per_token_logps_and_entropies(self, model, *args, compute_entropy=False,
                                           **kwargs):
        # Entropies cost a server pass: only when TRL uses them.
        outputs = ("log_probs", "entropy") if compute_entropy else ("log_probs",)
        route = self._policy_route
        # With PEFT the reference is the policy with its adapters off (or the "ref" adapter),
        # served by the policy's head: its log-probs stay full-softmax, as the reference
        # model's do.
        reference = _peft_reference_active(self.accelerator.unwrap_model(model))
        sampler = {} if reference else self.sampler_params
        previous, route.sampler = route.sampler, sampler
        try:
            with self._requesting(outputs):
                return super()._get_per_token_logps_and_entropies(
                    model, *args, compute_entropy=compute_entropy, **kwargs)
        finally:
            route.sampler = previous

    def _refresh_lm_head(self) -> None:
        """A local copy of the lm_head generates and is saved: after server-side steps, fetch
        it (without one, generation and saving ask the server)."""
        head = self.remote_head
        if (head.has_local_copy and head.accumulate and head.local_weight is None
                and head.step != self._synced_step):
            head.sync_lm_head()
            self._synced_step = head.step

    def _generate(self, prompts):
        self._refresh_lm_head()
        return super()._generate(prompts)

    def save_model(self, *args, **kwargs):
        self._refresh_lm_head()
        return super().save_model(*args, **kwargs)

    def _compute_loss(self, model, inputs):
        if not self.fused_grpo_loss:
            return super()._compute_loss(model, inputs)
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        # Only the tokens TRL's loss counts are scored (the others have weight 0 there).
        labels = torch.cat([torch.full_like(prompt_ids, -100),
                            completion_ids.masked_fill(mask == 0, -100)], dim=1)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        mode = "train" if self.model.training else "eval"
        weights, normalizer = _grpo_loss.weights(self, mask, inputs, mode)
        spec = dict(function=_grpo_loss.LOSS_FUNCTIONS[self.loss_type], reduction="weighted_sum",
                    weights=weights, normalizer=normalizer,
                    aux=_grpo_loss.aux(self, inputs, mask, advantages),
                    params=_grpo_loss.params(self, inputs),
                    completion_length=completion_ids.size(1),
                    policy_mask_from_entropy=_grpo_loss.entropy_mask(self, mask))
        # The entropy metric needs a Forward; the ratio metrics need this policy's log-probs
        # only off-policy (on-policy every ratio is exactly 1).
        off_policy = inputs.get("old_per_token_logps") is not None
        outputs = ("entropy", "log_probs") if off_policy else ("entropy",)
        with self._requesting(outputs), self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                        fused_lm_head=True, remotehead_loss=spec)
        kl_sum = None
        if self.beta != 0.0 and mask.any():
            kl_sum = self.remote_head.last_result.summary.extras["kl"]
        _grpo_loss.log_metrics(self, mode, out, completion_ids.size(1), mask, advantages, inputs,
                               kl_sum)
        return out.loss


# ----- DistillationTrainer -----

# The attribute that marks an offloaded lm_head weight for TRL's divergence loss: the student's
# carries its _DistillationRoute, the teacher's its OffloadedHead.
_ROUTE = "_remotehead_distillation"
_TEACHER = "_remotehead_teacher"


class _DistillationRoute:
    """TRL's `_chunked_divergence_loss` computed by the server: the student's head (this route's)
    against the frozen teacher head, same arguments, same results (loss, the student's entropy
    summed over the valid tokens, their count)."""

    def __init__(self, student: OffloadedHead, teacher: OffloadedHead):
        self.student, self.teacher = student, teacher

    def __call__(self, a) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if getattr(a["teacher_lm_head_weight"], _TEACHER, None) is not self.teacher:
            raise ValueError("teacher lm_head: expected the teacher whose head "
                             "offload_distillation_heads put on the server with this student's; "
                             "got another")
        for side in ("student", "teacher"):
            if a[f"{side}_lm_head_bias"] is not None:  # offload_lm_head refuses a bias already
                raise ValueError(f"{side}_lm_head_bias: expected none; got one")
        beta = float(a["beta"])
        if beta == 0.0:
            function, params = "distill_kl", {}
        elif beta == 1.0:
            function, params = "distill_reverse_kl", {}
        else:
            function, params = "distill_jsd", {"beta": beta}
        # TRL's transform on each side: z · logit_scale, softcap (None: off), / temperature.
        params.update(temperature=float(a["temperature"]),
                      logit_scale=float(a["student_logit_scale"]),
                      softcap=float(a["student_final_logit_softcapping"] or 0.0),
                      teacher_logit_scale=float(a["teacher_logit_scale"]),
                      teacher_softcap=float(a["teacher_final_logit_softcapping"] or 0.0))
        student_hidden, teacher_hidden = a["student_hidden_states"], a["teacher_hidden_states"]
        valid = a["completion_mask"].reshape(-1) != 0
        n_valid = valid.sum()
        # Only the valid positions travel (TRL projects only those too, where it can).
        rows = student_hidden.reshape(-1, student_hidden.shape[-1])[valid]
        teacher_rows = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[valid]
        if rows.shape[0] == 0:
            # Nothing to compare: a zero still connected to the student, as TRL's 0 / clamp(1).
            zero = student_hidden.sum() * 0.0
            return zero, zero.detach(), n_valid
        num_items = a["num_items_in_batch"]
        spec = (dict(reduction="mean") if num_items is None
                else dict(reduction="sum", normalizer=float(num_items)))
        loss = self.student.loss(rows, None, teacher_hidden=teacher_rows, function=function,
                                 params=params, teacher=self.teacher.head_id,
                                 pull_gradients=accumulation_window_ends(), **spec)
        entropy = self.student.last_result.summary.extras.get("entropy", 0.0)
        return loss, torch.tensor(entropy, dtype=loss.dtype, device=loss.device), n_valid


def _install_divergence_route() -> None:
    """Replaces TRL's module-level `_chunked_divergence_loss` (which DistillationTrainer's
    _compute_loss calls) by one that sends the call to the server when the student's lm_head
    weight is an offloaded one, and to TRL's own function otherwise (a trainer with local heads
    in the same process is unchanged). Once per process."""
    original = _distillation._chunked_divergence_loss
    if getattr(original, _ROUTE, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def chunked_divergence_loss(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        route = getattr(bound.arguments["student_lm_head_weight"], _ROUTE, None)
        if route is None:
            return original(*args, **kwargs)
        return route(bound.arguments)

    setattr(chunked_divergence_loss, _ROUTE, True)
    _distillation._chunked_divergence_loss = chunked_divergence_loss


def offload_distillation_heads(trainer: DistillationTrainer, client: Client,
                               head_id: str = "student", teacher_head_id: Optional[str] = None,
                               *, gradients: str = "server",
                               keep_local_copy: Optional[bool] = None
                               ) -> Tuple[OffloadedHead, OffloadedHead]:
    """Moves a TRL DistillationTrainer's two LM heads to the server behind `client`: the
    student's as `head_id` (trained there), the teacher's as `teacher_head_id` (default
    "<head_id>-teacher"), uploaded frozen. Returns (student head, teacher head); also
    `trainer.remote_head` and `trainer.remote_teacher_head`.

    Afterwards the trainer's distillation loss (TRL's `_chunked_divergence_loss`: beta's forward
    KL / JSD / reverse KL, temperature, each model's logit scale and softcap, num_items_in_batch
    or the mean, the logged entropy) is one ForwardBackward of the server's "distill_kl",
    "distill_jsd" or "distill_reverse_kl" over the valid completion positions: both hidden
    states go up, dX comes back for the student's, dW accumulates on the student's head only.

    gradients / keep_local_copy: as in `remotehead.hf.offload_lm_head`. In server mode (the
    default) the student's head takes a server-side AdamW step after each of the trainer's
    optimizer steps, with its hyper-parameters and current learning rate (RemoteHeadCallback),
    and neither model keeps a copy of its W: the teacher's is released too (it is frozen on the
    server), the student's on-policy generation gets each step's last-position logits from the
    server, and checkpoints stream the head from it. Tied input embeddings keep their matrix
    (the student then needs gradients="local").

    Several processes (torchrun, accelerate launch): every rank makes the same call; rank 0
    uploads, every rank adds its own dW, and the optimizer steps are synchronous (DDP's
    averaging). TRL's loss needs no scaling: its num_items_in_batch is the global count / the
    number of processes, and DistillationTrainer.compute_loss does not multiply the loss.

    Refused: vLLM generation (it would generate with weights the server does not update), a
    trainer without a local teacher model, heads with a bias, adapters on the head.
    """
    if trainer.use_vllm:
        raise ValueError("use_vllm: expected False (vLLM generates with weights the server does "
                         "not update); got True")
    if trainer.teacher_model is None:
        raise ValueError("teacher_model: expected the teacher model whose head goes to the "
                         "server; got None")
    student = trainer.model.get_base_model() if is_peft_model(trainer.model) else trainer.model
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    for name, model in (("student", student), ("teacher", teacher)):
        lm_head = model.get_output_embeddings()
        if not isinstance(lm_head, torch.nn.Linear):
            raise ValueError(f"{name} lm_head: expected a torch.nn.Linear (adapters on the head "
                             f"are not supported); got {type(lm_head).__name__}")
    trainable = student.get_output_embeddings().weight.requires_grad
    student_head = offload_lm_head(student, client, head_id, trainable=trainable,
                                   gradients=gradients, keep_local_copy=keep_local_copy)
    teacher_head = offload_lm_head(teacher, client, teacher_head_id or f"{head_id}-teacher",
                                   frozen=True)
    setattr(student.get_output_embeddings().weight, _ROUTE,
            _DistillationRoute(student_head, teacher_head))
    setattr(teacher.get_output_embeddings().weight, _TEACHER, teacher_head)
    _install_divergence_route()
    trainer.add_callback(RemoteHeadCallback(student_head))
    trainer.remote_head, trainer.remote_teacher_head = student_head, teacher_head
    return student_head, teacher_head


class RemoteHeadDistillationTrainer(DistillationTrainer):
    """DistillationTrainer whose student and teacher LM heads are `head_id` and
    `teacher_head_id` on the server behind `client` (offload_distillation_heads, at the end of
    the constructor). `remote_head` / `remote_teacher_head` are their OffloadedHeads."""

    def __init__(self, *args, client: Client, head_id: str = "student",
                 teacher_head_id: Optional[str] = None, gradients: str = "server",
                 keep_local_copy: Optional[bool] = None, **kwargs):
        super().__init__(*args, **kwargs)
        offload_distillation_heads(self, client, head_id, teacher_head_id, gradients=gradients,
                                   keep_local_copy=keep_local_copy)
