"""The model surgery of remotehead.hf: a causal LM whose lm_head is on the server.

offload_lm_head puts the model's head on the server and reroutes the model to it: its training
and evaluation loss (route_causal_lm_loss: the body only, the loss from the last hidden
states); its checkpoints wherever the server's head is the trained one
(OffloadedHead.checkpoint_from_server, remotehead.hf.checkpoint); and, where the trainer keeps
no copy of W, its lm_head module (logits from the server) and its state-dict loading
(OffloadedHead.release_local_copy, remotehead.hf.offloaded). The package's documentation says
what each mode keeps.
"""

from __future__ import annotations

import types
import warnings
from typing import Optional

import grpc
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from remotehead import cluster as cluster_lib
from remotehead.autograd import RemoteHead
from remotehead.client import Client, RemoteheadError
from remotehead._errors import rename_field
from remotehead._local_weight import head_weight
from remotehead.hf.offloaded import OffloadedHead
from remotehead.hf.tied import TiedOffloadedHead, serve_input_embedding
from remotehead.hf.trainer import accumulation_window_ends


def offload_lm_head(model, client: Client, head_id: str, *, trainable: bool = True,
                    gradients: str = "server", trainer: Optional[str] = None,
                    upload: bool = True, keep_local_copy: Optional[bool] = None,
                    frozen: bool = False) -> OffloadedHead:
    """Uploads the model's lm_head to the server as `head_id` and makes the model's training
    loss go through it.

    upload=False: the head is on the server already — e.g. a server started with --state_dir
        restored it after a restart; resuming the Trainer from a checkpoint then puts it back
        to the state saved with that checkpoint (RemoteHeadCallback).
    trainable=False: a frozen head (e.g. under LoRA): dX only, no dW.
    frozen=True: uploaded as a frozen head (HeadInfo.frozen: the server refuses dW and
        optimizer steps for it; the only kind a distillation step may name as its teacher);
        implies trainable=False.
    gradients="server": dW stays on the server, trained by server-side optimizer steps
        (`head.optimizer_step(...)`, or RemoteHeadCallback under Trainer). The trainer keeps no
        copy of W (see the module's documentation) unless keep_local_copy=True: then the local
        lm_head is frozen and only refreshed for generation (`sync_lm_head()`).
    gradients="local": the lm_head parameter stays the trainer's: its dW is pulled into
        lm_head.weight.grad at the end of each accumulation window (before gradient clipping)
        and the local optimizer updates it; the server is sent the new weights before the next
        step. With tied input embeddings the matrix then stays the trainer's embedding too.
    Tied input embeddings (lm_head.weight is the input embedding's) in server mode or frozen:
        the server serves the input embedding too (remotehead.hf.tied): the model's embedding
        module becomes a RemoteEmbedding of the same head, whose gradient the server adds into
        the same dW; the trainer holds no [V, D] tensor at all.
    keep_local_copy: None (default) releases the local W wherever the trainer does not own it:
        in server mode and for a frozen head; it is kept where it is the trainer's parameter
        (gradients="local", tied or not: keep_local_copy=False then warns that it stays). True
        keeps a frozen copy of the lm_head in every mode (a tied model's input embedding is
        still served).

    Data-parallel trainers (torchrun, accelerate launch: remotehead.cluster finds the rank and
    world size) make the same call on every rank: rank 0 uploads, the others wait for the head
    and check its shape; each rank adds its dW under its own identity and the optimizer steps
    are synchronous (see RemoteHead).
    """
    if gradients not in ("server", "local"):
        raise ValueError(f'gradients: expected "server" or "local"; got {gradients!r}')
    trainable = trainable and not frozen
    lm_head = model.get_output_embeddings()
    tied = lm_head.weight is model.get_input_embeddings().weight
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("lm_head.bias: expected none (causal LMs have no head bias); got one")
    cluster = cluster_lib.detect()
    _share_head(client, head_id, lm_head.weight, cluster, upload, frozen)
    local = trainable and gradients == "local"
    head_class = OffloadedHead
    if tied and not local:  # the input embedding is served by the same head
        head_class = TiedOffloadedHead
    head = head_class(model, client, head_id, trainer=trainer, accumulate=trainable,
                      local_weight=lm_head.weight if local else None, cluster=cluster)
    if trainable and not local:
        # Trained on the server: keeps the local copy out of the local optimizer.
        lm_head.weight.requires_grad_(False)
    if tied and local and keep_local_copy is False:
        warnings.warn("remotehead: lm_head is tied to the input embeddings: the local matrix is "
                      "the embedding and stays (keep_local_copy=False has no effect)")
    if tied and not local:
        serve_input_embedding(model, head)
    if not local:
        # The server's head is the trained one: a kept local copy is refreshed only for
        # generation, so checkpoints take the head from the server in every case; DDP must
        # neither broadcast nor reduce it.
        _keep_out_of_ddp(model, lm_head.weight)
        head.checkpoint_from_server()
        if not keep_local_copy:
            head.release_local_copy()

    # The architecture's final logit soft-capping (Gemma 2 and 3) in its loss, as its forward
    # applies it to the logits before transformers' loss.
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    cap = {"params": {"softcap": float(softcap)}} if softcap else {}

    def loss(hidden, shifted, num_items_in_batch):
        pull = accumulation_window_ends()
        if num_items_in_batch is not None:
            return head.loss(hidden, shifted, reduction="sum",
                             normalizer=float(num_items_in_batch), pull_gradients=pull,
                             upstream_scale=head.trainer_loss_scale, **cap)
        return head.loss(hidden, shifted, reduction="mean", pull_gradients=pull, **cap)

    route_causal_lm_loss(model, loss)
    model._remotehead = head
    return head


def _keep_out_of_ddp(model, weight: torch.nn.Parameter) -> None:
    """Lists the head's parameter in the model's DDP ignore list (what
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model sets): the server, not
    the trainers, holds it, and DDP would otherwise broadcast it from rank 0 when it wraps the
    model — a copy into the released one-element storage, which fails."""
    names = [name for name, p in model.named_parameters(remove_duplicate=False) if p is weight]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = ignored + [n for n in names if n not in ignored]


def _share_head(client: Client, head_id: str, weight: torch.Tensor, cluster, upload: bool,
                frozen: bool = False):
    """Puts the model's head on the server once: rank 0 uploads it (with upload=True); every
    other rank waits until it is there and checks that it is the model's shape (the uploaded
    head, so the ranks train one model)."""

    def present() -> bool:
        try:
            client.describe_head(head_id)
            return True
        except RemoteheadError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise

    def check():
        info = client.describe_head(head_id)
        expected = tuple(weight.shape)
        if (info.vocab_size, info.hidden_size) != expected:
            raise ValueError(f"head {head_id!r}: expected the model's lm_head shape {expected} on "
                             f"the server; got ({info.vocab_size}, {info.hidden_size})")
        return info

    def on_main():
        if upload:
            return client.upload_head(head_id, head_weight(weight), frozen=frozen)
        # As for one process: a head of another shape is refused when a checkpoint is
        # verified (hf/checkpoint.py), not here.
        return client.describe_head(head_id)

    cluster_lib.share(cluster, on_main, check, wait_until=present)


def _labels_error(error: RemoteheadError, given_shifted: bool) -> RemoteheadError:
    """An error naming a row of the loss's targets ("targets[b, t]": the client names the
    shifted labels' [b, t]) as the model's caller gave it: labels[b, t + 1] (the label the
    shifted position predicts), or shift_labels[b, t] when the batch gave its own."""
    field = error.metadata.get("field", "")
    if not (field.startswith("targets[") and field.endswith("]")):
        return error
    position = field[len("targets["):-1].split(", ")
    if not all(p.isdigit() for p in position):
        return error
    if given_shifted:
        return rename_field(error, f"shift_labels[{', '.join(position)}]")
    position[-1] = str(int(position[-1]) + 1)
    return rename_field(error, f"labels[{', '.join(position)}]")


def route_causal_lm_loss(model, loss) -> None:
    """Makes a causal LM's forward with labels run only its body and
    return `loss(hidden, shifted_labels, num_items_in_batch)` — no [N, V] logits are built
    here. `shifted_labels` are the labels shifted left and padded with -100, so that hidden
    state n predicts token n + 1, as transformers' ForCausalLMLoss (which, like this, takes a
    batch's `shift_labels` as they are when given; packed batches of DataCollatorWithFlattening
    need nothing more: their -100 at each sequence's first token stops one sequence's last
    position predicting the next one's first token); `loss` reduces over the
    valid tokens: sum / num_items_in_batch when that is given (the Trainer's gradient
    accumulation), else the mean. With labels and no gradients (evaluation) it is called too
    (no logits either). Without labels (inference, generation) the model is unchanged.
    Used by offload_lm_head, and by anything else that replaces the head's loss (the main job's
    torch.nn.functional.linear_cross_entropy column)."""
    original_forward = model.forward

    # logits_to_keep is named so that generate() sees the model support it (and asks for the
    # last position's logits only); it goes to the model's own forward, which slices the hidden
    # states before its lm_head.
    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None,
                logits_to_keep=0, **kwargs):
        if labels is None:
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                kwargs["logits_to_keep"] = logits_to_keep
            return original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                    **kwargs)
        # A collator's own shifted labels (transformers' ForCausalLMLoss takes them as they are:
        # context-parallel shards, some padding-free collators) win over shifting here.
        shifted = kwargs.pop("shift_labels", None)
        given_shifted = shifted is not None
        outputs = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     **kwargs)
        if shifted is None:
            shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        try:
            value = loss(outputs.last_hidden_state, shifted, num_items_in_batch)
        except RemoteheadError as e:
            raise _labels_error(e, given_shifted) from None
        return CausalLMOutputWithPast(loss=value, logits=None,
                                      past_key_values=outputs.past_key_values)

    model.forward = types.MethodType(forward, model)
