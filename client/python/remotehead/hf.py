"""Hugging Face integration: a causal LM whose training loss goes through a remote head.

    model = AutoModelForCausalLM.from_config(config)
    head = remotehead.hf.offload_lm_head(model, client, "policy")
    loss = model(input_ids, labels=labels, num_items_in_batch=n).loss   # no [N, V] logits
    loss.backward()                                                     # body grads locally
    optimizer.step(); head.optimizer_step(adamw=dict(lr=..., weight_decay=...))

In training (labels given, gradients on) the model runs its body, and the shifted next-token
cross-entropy — mean over valid tokens, or sum / num_items_in_batch exactly like
transformers' ForCausalLMLoss — is computed on the server from the last hidden states. Without
labels (inference, generation) the model is unchanged and uses its local lm_head, which
`sync_lm_head()` refreshes from the server after server-side optimizer steps.
"""

from __future__ import annotations

import json
import os
import types
import warnings
from typing import Optional

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.modeling_outputs import CausalLMOutputWithPast

from remotehead.autograd import RemoteHead
from remotehead.client import Client, RemoteheadError


class OffloadedHead(RemoteHead):
    """The RemoteHead of an offloaded model, which also keeps its local lm_head in step."""

    def __init__(self, model, client: Client, head_id: str, **kwargs):
        super().__init__(client, head_id, **kwargs)
        self._model = model

    def sync_lm_head(self) -> None:
        """Copies the server's weights into the model's local lm_head (for generation)."""
        lm_head = self._model.get_output_embeddings()
        weight, _ = self.client.export_weights(self.head_id)
        with torch.no_grad():
            lm_head.weight.copy_(weight.to(lm_head.weight.dtype))

    def optimizer_step(self, sync: bool = False, **optimizer) -> None:
        super().optimizer_step(**optimizer)
        if sync:
            self.sync_lm_head()


def accumulation_window_ends() -> bool:
    """Whether this micro-batch is the last of its gradient-accumulation window: transformers'
    Trainer (through accelerate's GradientState) says so before each micro-batch; without a
    Trainer every micro-batch counts as the last (dW is then pulled after each backward)."""
    try:
        from accelerate.state import GradientState
    except ImportError:
        return True
    return GradientState().sync_gradients


def offload_lm_head(model, client: Client, head_id: str, *, trainable: bool = True,
                    gradients: str = "server", trainer: Optional[str] = None,
                    upload: bool = True) -> OffloadedHead:
    """Uploads the model's lm_head to the server as `head_id` and makes the model's training
    loss go through it.

    upload=False: the head is on the server already — e.g. a server started with --state_dir
        restored it after a restart; resuming the Trainer from a checkpoint then puts it back
        to the state saved with that checkpoint (RemoteHeadCallback).
    trainable=False: a frozen head (e.g. under LoRA): dX only, no dW.
    gradients="server": dW stays on the server, trained by server-side optimizer steps
        (`head.optimizer_step(...)`, or RemoteHeadCallback under Trainer); the local lm_head is
        frozen and only refreshed for generation (`sync_lm_head()`).
    gradients="local": the lm_head parameter stays the trainer's: its dW is pulled into
        lm_head.weight.grad at the end of each accumulation window (before gradient clipping)
        and the local optimizer updates it; the server is sent the new weights before the next
        step. Tied input embeddings need this mode.
    """
    if gradients not in ("server", "local"):
        raise ValueError(f'gradients: expected "server" or "local"; got {gradients!r}')
    lm_head = model.get_output_embeddings()
    tied = lm_head.weight is model.get_input_embeddings().weight
    if tied and trainable and gradients == "server":
        # The server would update the head while the input embeddings (the same tensor) stay.
        raise ValueError('gradients: expected "local" for a model with tied input embeddings '
                         '(the embedding matrix is the head and must stay one parameter); got '
                         '"server"')
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("lm_head.bias: expected none (causal LMs have no head bias); got one")
    if upload:
        client.upload_head(head_id, lm_head.weight.detach().float())
    local = trainable and gradients == "local"
    head = OffloadedHead(model, client, head_id, trainer=trainer, accumulate=trainable,
                         local_weight=lm_head.weight if local else None)
    if trainable and not local:
        # Trained on the server: keeps the local copy out of the local optimizer.
        lm_head.weight.requires_grad_(False)

    def loss(hidden, shifted, num_items_in_batch):
        pull = accumulation_window_ends()
        if num_items_in_batch is not None:
            return head.loss(hidden, shifted, reduction="sum",
                             normalizer=float(num_items_in_batch), pull_gradients=pull)
        return head.loss(hidden, shifted, reduction="mean", pull_gradients=pull)

    route_causal_lm_loss(model, loss)
    model._remotehead = head
    return head


def route_causal_lm_loss(model, loss) -> None:
    """Makes a causal LM's training forward (labels given, gradients on) run only its body and
    return `loss(hidden, shifted_labels, num_items_in_batch)` — no [N, V] logits are built
    here. `shifted_labels` are the labels shifted left and padded with -100, so that hidden
    state n predicts token n + 1, as transformers' ForCausalLMLoss; `loss` reduces over the
    valid tokens: sum / num_items_in_batch when that is given (the Trainer's gradient
    accumulation), else the mean. Without labels (inference, generation) the model is unchanged.
    Used by offload_lm_head, and by anything else that replaces the head's loss (the main job's
    torch.nn.functional.linear_cross_entropy column)."""
    original_forward = model.forward

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None,
                **kwargs):
        if labels is None or not torch.is_grad_enabled():
            return original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                    labels=labels, **kwargs)
        outputs = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     **kwargs)
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        return CausalLMOutputWithPast(
            loss=loss(outputs.last_hidden_state, shifted, num_items_in_batch), logits=None,
            past_key_values=outputs.past_key_values)

    model.forward = types.MethodType(forward, model)


class RemoteHeadCallback(TrainerCallback):
    """Makes transformers' Trainer step a server-trained head (gradients="server") with the
    Trainer's own AdamW settings and its current learning rate, after each local optimizer
    step:  Trainer(..., callbacks=[RemoteHeadCallback(head)]).

    Trainer's gradient clipping (max_grad_norm) sees only the local parameters in this mode;
    offload with gradients="local" to clip the head's gradient together with the body's."""

    # Written into each trainer checkpoint directory: the head's saved state that goes with it.
    STATE_FILE = "remotehead_state.json"

    def __init__(self, head: RemoteHead, save_state: Optional[bool] = None):
        """save_state: with each trainer checkpoint, save the head's training state on the
        server (its --state_dir) and record its id in the checkpoint, so that
        resume_from_checkpoint puts the head back to the same version with the same optimizer
        state — after a server crash too. Default: when the head is trained on the server and
        the server keeps states (--state_dir; without one a warning says the head's state is
        not saved)."""
        self.head = head
        self.save_state = self._server_trained() if save_state is None else save_state
        self._required = save_state is True

    def _server_trained(self) -> bool:
        return self.head.accumulate and self.head.local_weight is None

    def on_save(self, args, state, control, **kwargs):
        if not self.save_state or not state.is_world_process_zero:
            return
        try:
            info = self.head.save_state()
        except RemoteheadError as e:
            if self._required or "--state_dir" not in e.details:
                raise
            warnings.warn(f"remotehead: the head's training state is not saved with the "
                          f"checkpoints: {e.details}")
            self.save_state = False
            return
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        with open(os.path.join(checkpoint, self.STATE_FILE), "w") as f:
            json.dump({"head_id": self.head.head_id, "state_id": info.state_id,
                       "weight_version": info.weight_version,
                       "global_step": state.global_step}, f)

    def on_train_begin(self, args, state, control, **kwargs):
        # Resuming (Trainer has loaded the checkpoint's TrainerState): the head goes back to the
        # state saved with that checkpoint, whatever the server holds now.
        if not self.save_state or state.global_step == 0:
            return
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = os.path.join(checkpoint, self.STATE_FILE)
        if not os.path.isfile(path):
            if not self._required:
                warnings.warn(f"remotehead: {path} is missing: the head is not put back to the "
                              f"state of step {state.global_step} (the server was started "
                              "without --state_dir when the checkpoint was written?)")
                return
            raise FileNotFoundError(
                f"{path}: expected the remote head's state saved with the checkpoint of step "
                f"{state.global_step} (RemoteHeadCallback writes it); got none — the head "
                "cannot be put back to that step")
        with open(path) as f:
            saved = json.load(f)
        info = self.head.restore_state(saved["state_id"], step=state.global_step)
        if info.weight_version != saved["weight_version"]:
            raise RuntimeError(f"{path}: expected the head at version {saved['weight_version']} "
                               f"after restoring; got {info.weight_version}")

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._server_trained():
            self.head.optimizer_step(adamw=dict(
                lr=optimizer.param_groups[0]["lr"], beta1=args.adam_beta1,
                beta2=args.adam_beta2, eps=args.adam_epsilon, weight_decay=args.weight_decay))

    def on_train_end(self, args, state, control, **kwargs):
        if self._server_trained():
            self.head.sync_lm_head()  # generation after training uses the trained head
