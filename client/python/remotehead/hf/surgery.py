"""The model surgery of remotehead.hf: a causal LM whose lm_head is on the server.

offload_lm_head puts the model's head on the server and reroutes the model to it: its training
and evaluation loss (route_causal_lm_loss: the body only, the loss from the last hidden
states); its checkpoints wherever the server's head is the trained one
(OffloadedHead.checkpoint_from_server, remotehead.hf_checkpoint); and, where the trainer keeps
no copy of W, its lm_head module (logits from the server) and its state-dict loading
(OffloadedHead.release_local_copy). The package's documentation says what each mode keeps.
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
from remotehead.hf.trainer import accumulation_window_ends
from remotehead.hf_checkpoint import save_head_from_server


class OffloadedHead(RemoteHead):
    """The RemoteHead of an offloaded model: keeps the model's lm_head in step with the server
    (a local copy refreshed by sync_lm_head(), or no copy: logits and checkpoints from the
    server)."""

    def __init__(self, model, client: Client, head_id: str, **kwargs):
        super().__init__(client, head_id, **kwargs)
        self._model = model
        # Whether the model's lm_head holds W (a copy, the trainer's parameter, or tied
        # embeddings); False once release_local_copy() freed it.
        self.has_local_copy = True
        self._checkpoints_from_server = False
        # dL/dloss that transformers' Trainer brings to a loss normalised by num_items_in_batch:
        # W under average_tokens_across_devices with W processes (RemoteHeadCallback sets it),
        # else 1. A loss without num_items_in_batch is never scaled.
        self.trainer_loss_scale = 1.0

    @property
    def lm_head(self) -> torch.nn.Module:
        return self._model.get_output_embeddings()

    def sync_lm_head(self) -> None:
        """Copies the server's weights into the model's local lm_head (for local generation).
        Nothing to do without a local copy: the server's head is then the only one."""
        if not self.has_local_copy:
            return
        weight, _ = self.client.export_weights(self.head_id)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight.to(self.lm_head.weight.dtype))

    def optimizer_step(self, sync: bool = False, **optimizer) -> None:
        super().optimizer_step(**optimizer)
        if sync:
            self.sync_lm_head()

    def release_local_copy(self) -> None:
        """Frees the storage of the model's lm_head weight (the tensor object stays
        `lm_head.weight`, with its shape, dtype and device, backed by one element, but is no
        longer one of the module's parameters: _hold_released) and routes the lm_head module,
        the model's checkpoints and state-dict loading to the server."""
        if not self.has_local_copy:
            return
        lm_head = self.lm_head
        weight = lm_head.weight
        with torch.no_grad():
            weight.data = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(
                weight.shape)
        _hold_released(lm_head, self._model)
        self.has_local_copy = False
        lm_head.forward = self._server_logits
        lm_head._apply = _keeping_released(lm_head)
        lm_head._register_load_state_dict_pre_hook(self._load_weight_into_server)
        lm_head.register_load_state_dict_pre_hook(_released_entry_loaded)
        self.checkpoint_from_server()

    def checkpoint_from_server(self) -> None:
        """Makes the model's save_pretrained (and Trainer's checkpoints) write the server's head
        instead of the local parameter (remotehead.hf_checkpoint). Once per model."""
        if not self._checkpoints_from_server:
            save_head_from_server(self._model, self)
            self._checkpoints_from_server = True

    def logits(self, hidden: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The logits [..., V] of hidden [..., D] from the server, in `dtype` (default: the
        lm_head's). No gradient flows through them."""
        return self.client.logits(self.head_id, hidden,
                                  dtype=dtype or self.lm_head.weight.dtype)

    def _server_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and hidden.requires_grad:
            raise RuntimeError(
                "lm_head: the head is on the server (offload_lm_head released the local copy) and "
                "its logits carry no gradient; train through the loss (model(..., labels=...) or "
                "RemoteHead.loss / token_outputs), or offload with keep_local_copy=True")
        return self.logits(hidden)

    def _load_weight_into_server(self, state_dict, prefix, *args) -> None:
        """A state dict loaded into the model (Trainer's resume, load_state_dict) sets the
        server's head; the released local parameter stays released."""
        key = prefix + "weight"
        value = state_dict.get(key)
        weight = self.lm_head.weight
        if value is None or _is_released(value, weight):
            return
        if tuple(value.shape) != tuple(weight.shape):
            return  # load_state_dict reports the shape mismatch itself
        # The new version is the one the trainer holds now (checkpoints are pinned to it). Among
        # several ranks (each loads the checkpoint) rank 0 uploads and the others take its
        # version, so that their synchronous steps agree on it.
        frozen = self.info.frozen  # replace keeps the head's frozen flag
        self.info = cluster_lib.share(
            self.cluster,
            lambda: self.client.upload_head(self.head_id, head_weight(value), replace=True,
                                            frozen=frozen),
            lambda: self.client.describe_head(self.head_id))
        state_dict[key] = weight.detach()  # the same view: loading copies nothing


def _keeping_released(lm_head: torch.nn.Module):
    """The lm_head's Module._apply (what .to(), .cuda(), .half(), .to_empty() run) for a
    released weight, which Module._apply no longer converts (it is no parameter: _hold_released):
    the conversion is applied to its one element and the result expanded again, so that the
    weight follows the model's device and dtype. Converting the expanded tensor itself would
    allocate the whole [V, D] — measured: Trainer's model.to(device) under torchrun did, on every
    rank."""
    original = lm_head._apply

    def apply(fn, *args, **kwargs):
        result = original(fn, *args, **kwargs)
        weight = lm_head.weight
        with torch.no_grad():
            converted = fn(weight.data[(0,) * weight.dim()]).expand(weight.shape)
        if torch._has_compatible_shallow_copy_type(weight, converted):
            weight.data = converted  # the same object, as Module._apply keeps parameters
        else:
            replacement = torch.nn.Parameter(converted, requires_grad=False)
            replacement.__dict__.update(weight.__dict__)  # attributes set on it (remotehead.trl)
            lm_head.__dict__["weight"] = replacement
        return result

    return apply


def _hold_released(lm_head: torch.nn.Module, model) -> None:
    """Takes the released weight out of lm_head's parameters and keeps the same object as the
    plain attribute `lm_head.weight` (shape, dtype and device queries answer as before), so that
    nothing that walks, shards, moves or broadcasts the model's parameters or buffers sees it:
    FSDP2's fully_shard refuses a broadcast (zero-stride) parameter, and moving it (FSDP2 moves
    parameters and buffers to its device, DDP broadcasts them) would materialise [V, D].

    `state_dict()` still lists it under its name (the released tensor: the key transformers'
    checkpoint loading and Trainer's resume compare), except once the model is sharded by FSDP2
    (fully_shard on the root, as accelerate does): its state dicts are gathered by
    torch.distributed.checkpoint, which would copy a plain tensor whole, and accelerate's
    sharded loading expects every entry to be a DTensor."""
    weight = lm_head._parameters.pop("weight")
    lm_head.__dict__["weight"] = weight

    list_weight_in_state_dict(lm_head, model)


def list_weight_in_state_dict(module: torch.nn.Module, model) -> None:
    """Makes `module`'s state dict list its `weight` (no longer a parameter of it), except once
    `model` is sharded by FSDP2 (see _hold_released)."""
    def listed(module, state_dict, prefix, local_metadata):
        if not _fully_sharded(model):
            state_dict[prefix + "weight"] = module.weight.detach()

    module.register_state_dict_post_hook(listed)


def _released_entry_loaded(lm_head, state_dict, prefix, local_metadata, strict, missing_keys,
                           unexpected_keys, error_msgs) -> None:
    """Takes the head's entry out of a state dict being loaded into a released lm_head, after
    OffloadedHead._load_weight_into_server has sent it to the server (lm_head has no parameter
    to load it into: it would be an unexpected key); an entry of another shape is reported as
    load_state_dict reports a parameter's."""
    value = state_dict.pop(prefix + "weight", None)
    expected = tuple(lm_head.weight.shape)
    if value is not None and tuple(value.shape) != expected:
        error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                          f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                          f"{expected}.")


def _fully_sharded(model) -> bool:
    """Whether `model` is sharded by FSDP2 (torch.distributed.fsdp.fully_shard on it)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def _is_released(t: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `t` is the released lm_head weight itself (or a view of its one element)."""
    return t.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


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
        from remotehead.hf.tied import TiedOffloadedHead, serve_input_embedding
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
        # verified (hf_checkpoint), not here.
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
