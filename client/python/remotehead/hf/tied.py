"""Tied input embeddings served by the server (offload_lm_head on a model whose lm_head is its
input embedding: Gemma 2 and 3, small Llama 3.2 and Qwen models).

The embedding matrix is the head: it goes to the server once, and the model's input embedding
module is replaced by a RemoteEmbedding bound to the same head (ServedEmbedding): each forward
reads its ids' rows from the server's W and its backward adds their gradient into the head's dW
(remotehead.embedding), under the gradient id of the micro-batch's head step — one parameter,
one accumulator, one optimizer step. The trainer holds no [V, D] tensor (no weight, gradient or
optimizer state; with keep_local_copy=True a frozen copy for local generation, as untied).

The model keeps its semantics: Gemma's scale (the embedding module's `embed_scale`, cast to the
body's dtype as Gemma's embedding does), padding_idx (its rows get no gradient), the body's
dtype (rows come in it and follow model.to()). Its checkpoints are one tensor under the input
embedding's name, as transformers writes a tied model (TiedOffloadedHead.tied_names, read by
remotehead.hf.checkpoint); loading a state dict into the model (Trainer's resume) uploads it,
once even where both names are given; tie_weights() is a no-op (there is no local matrix to tie)
and resize_token_embeddings() is refused.
"""

from __future__ import annotations

import types
import weakref
from typing import Optional, Tuple

import torch

from remotehead.embedding import RemoteEmbedding
from remotehead.hf.offloaded import OffloadedHead, list_weight_in_state_dict


class TiedOffloadedHead(OffloadedHead):
    """The OffloadedHead of a model whose input embedding is its head (serve_input_embedding
    sets `tied_names`: the state-dict names of the one tensor, the one checkpoints write first)."""

    tied_names: Tuple[str, ...] = ()
    _loaded: Optional[weakref.ref] = None

    def _load_weight_into_server(self, state_dict, prefix, *args) -> None:
        """As OffloadedHead's, once per tensor: a state dict of a local tied model holds the
        matrix under both names (views of one storage); the second is not uploaded again."""
        value = state_dict.get(prefix + "weight")
        previous = self._loaded() if self._loaded is not None else None
        if value is not None and previous is not None and _same_view(value, previous):
            return
        super()._load_weight_into_server(state_dict, prefix, *args)
        if value is not None:
            self._loaded = weakref.ref(value)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype)


class ServedEmbedding(RemoteEmbedding):
    """A Hugging Face model's input embedding served by its offloaded head: `weight` is the
    lm_head's (released: one element, broadcast to [V, D]; a frozen copy with keep_local_copy),
    so that code asking the input embedding for its shape, dtype or device gets the answers of
    the tied model."""

    @property
    def weight(self) -> torch.Tensor:
        return self.head.lm_head.weight


def serve_input_embedding(model, head: TiedOffloadedHead) -> ServedEmbedding:
    """Replaces `model`'s input embedding (the lm_head's weight) by a ServedEmbedding of `head`;
    see the module's documentation. The caller releases the lm_head afterwards."""
    original = model.get_input_embeddings()
    if not isinstance(original, torch.nn.Embedding):
        raise ValueError(f"input embeddings: expected a torch.nn.Embedding (or a subclass, such "
                         f"as Gemma's scaled embedding); got {type(original).__name__}")
    for attribute, plain in (("max_norm", None), ("scale_grad_by_freq", False),
                             ("sparse", False)):
        if getattr(original, attribute) != plain:
            raise ValueError(f"input embeddings: expected {attribute}={plain} (not served by "
                             f"the head); got {getattr(original, attribute)}")
    weight = original.weight
    scale = getattr(original, "embed_scale", None)
    if scale is not None and not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale)
    served = ServedEmbedding(head, padding_idx=original.padding_idx, embed_scale=scale,
                             dtype=weight.dtype, device=weight.device)
    if (served.num_embeddings, served.embedding_dim) != tuple(weight.shape):
        raise ValueError(f"head {head.head_id!r}: expected the input embedding's shape "
                         f"{tuple(weight.shape)}; got ({served.num_embeddings}, "
                         f"{served.embedding_dim})")
    name = next(n for n, m in model.named_modules() if m is original)
    lm_name = next(n for n, m in model.named_modules() if m is head.lm_head)
    model.set_input_embeddings(served)
    head.tied_names = (f"{name}.weight", f"{lm_name}.weight")

    # The tensor under the input embedding's name too, as a tied model lists it (the key
    # checkpoints and Trainer's resume compare); not once FSDP2 shards the model.
    list_weight_in_state_dict(served, model)
    served._register_load_state_dict_pre_hook(head._load_weight_into_server)
    served.register_load_state_dict_pre_hook(_entry_loaded)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights = types.MethodType(_no_local_matrix_to_tie, base)
    base.resize_token_embeddings = types.MethodType(_refuse_resize, base)
    return served


def _entry_loaded(module, state_dict, prefix, local_metadata, strict, missing_keys,
                  unexpected_keys, error_msgs) -> None:
    """Takes the embedding's entry out of a state dict being loaded (the server has it now; the
    module has no parameter to load it into); another shape is reported as for a parameter."""
    value = state_dict.pop(prefix + "weight", None)
    expected = (module.num_embeddings, module.embedding_dim)
    if value is not None and tuple(value.shape) != expected:
        error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                          f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                          f"{expected}.")


def _no_local_matrix_to_tie(self, *args, **kwargs) -> None:
    """tie_weights of a model whose tied matrix is on the server: nothing to tie here (the
    input embedding and the lm_head are served by the same head)."""


def _refuse_resize(self, *args, **kwargs):
    raise NotImplementedError("resize_token_embeddings: the tied embedding matrix is on the "
                              "server (offload_lm_head); resize the model before offloading it")
