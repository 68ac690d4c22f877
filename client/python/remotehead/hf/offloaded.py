"""The offloaded head of remotehead.hf: OffloadedHead, a RemoteHead that a model's lm_head calls
(remotehead.hf.surgery puts it there), with what keeps a trainer's local copy of W out of the way
once it is released — the lm_head's parameter held as a plain attribute, listed in state dicts,
converted without materialising [V, D] — and its checkpoints taken from the server
(remotehead.hf.checkpoint). Its own module so that the surgery and the tied embedding
(remotehead.hf.tied) both build on it without importing each other.
"""

from __future__ import annotations

from typing import Optional

import torch

from remotehead import cluster as cluster_lib
from remotehead.autograd import RemoteHead
from remotehead.client import Client
from remotehead._local_weight import head_weight
from remotehead.hf.checkpoint import save_head_from_server


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
        instead of the local parameter (remotehead.hf.checkpoint). Once per model."""
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
