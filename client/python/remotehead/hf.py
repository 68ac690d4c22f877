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

import types
from typing import Optional

import torch

from remotehead.autograd import RemoteHead
from remotehead.client import Client


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


def offload_lm_head(model, client: Client, head_id: str, *, trainable: bool = True,
                    trainer: Optional[str] = None) -> OffloadedHead:
    """Uploads the model's lm_head to the server as `head_id` and makes the model's training
    loss go through it. trainable=False: a frozen head (e.g. LoRA): dX only, no dW."""
    lm_head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False):
        # The server would update the head while the input embeddings (the same tensor) stay.
        raise ValueError("model.config.tie_word_embeddings: expected False (tied input "
                         "embeddings are not supported yet); got True")
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("lm_head.bias: expected none (causal LMs have no head bias); got one")
    client.upload_head(head_id, lm_head.weight.detach().float())
    head = OffloadedHead(model, client, head_id, trainer=trainer, accumulate=trainable)
    original_forward = model.forward

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None,
                **kwargs):
        if labels is None or not torch.is_grad_enabled():
            return original_forward(input_ids=input_ids, attention_mask=attention_mask,
                                    labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     **kwargs)
        hidden = outputs.last_hidden_state
        # Tokens < n predict n, as ForCausalLMLoss: labels padded with -100 and shifted left.
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        if num_items_in_batch is not None:
            loss = head.loss(hidden, shifted, reduction="sum", normalizer=float(num_items_in_batch))
        else:
            loss = head.loss(hidden, shifted, reduction="mean")
        return CausalLMOutputWithPast(loss=loss, logits=None,
                                      past_key_values=outputs.past_key_values)

    model.forward = types.MethodType(forward, model)
    model._remotehead = head
    return head
