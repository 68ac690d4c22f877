"""Hugging Face integration: a causal LM whose head lives on a remotehead server.

    model = AutoModelForCausalLM.from_config(config)
    head = remotehead.hf.offload_lm_head(model, client, "policy")
    loss = model(input_ids, labels=labels, num_items_in_batch=n).loss   # no [N, V] logits
    loss.backward()                                                     # body grads locally
    optimizer.step(); head.optimizer_step(adamw=dict(lr=..., weight_decay=...))
    model.generate(input_ids, max_new_tokens=32)        # logits of the last position only
    model.save_pretrained(path)                         # the head streamed from the server

In training (labels given, gradients on) the model runs its body, and the shifted next-token
cross-entropy — mean over valid tokens, or sum / num_items_in_batch exactly like
transformers' ForCausalLMLoss — is computed on the server from the last hidden states. With
labels and no gradients (evaluation) the loss is a server Forward: no logits either.

In server mode (gradients="server", the default) the trainer keeps no copy of W: the lm_head
parameter stays in the module and in state_dict() with its shape and dtype, but its storage is
released (one element, broadcast), and the lm_head module asks the server for logits. A forward
without labels (generate(), evaluation, TRL's rollouts) thus gets [rows, V] logits from the
server for the positions Hugging Face's logits_to_keep selects — the last one while decoding.
`generate()` (remotehead.hf.generate) draws the tokens on the server instead (B·D up, B ids
down per step).
Wherever the server's head is the trained one (server mode, or a frozen head; with or without
a local copy), save_pretrained() writes the head's current weights streamed from the server,
pinned to the version the trainer holds, and publishes the checkpoint whole or not at all
(remotehead.hf.checkpoint); loading a state dict into the model (Trainer's resume) uploads the
head. keep_local_copy=True keeps a frozen local copy for local generation, refreshed by
`sync_lm_head()`.

A model whose input embedding is its head (tied: Gemma, Llama 3.2, Qwen) takes the same call: in
server mode the input embedding is served by the same head too (remotehead.hf.tied: its rows
read from the server, their gradient added into the head's dW), so the trainer holds no [V, D]
tensor at all.

The package, one concern a module (its names are all importable from remotehead.hf):
surgery.py, the model's head moved to the server (offload_lm_head, OffloadedHead,
route_causal_lm_loss); tied.py, a tied model's input embedding served by its head
(TiedOffloadedHead, ServedEmbedding); generation.py, decoding with the tokens drawn on the server (generate,
head_params); trainer.py, transformers' Trainer glue (RemoteHeadCallback,
accumulation_window_ends); the checkpoints, remotehead.hf.checkpoint.
"""

from remotehead.hf.generation import GenerateOutput, generate, head_params
from remotehead.hf.surgery import OffloadedHead, offload_lm_head, route_causal_lm_loss
from remotehead.hf.trainer import RemoteHeadCallback, accumulation_window_ends
# HEAD_SHARD: where checkpoints hold the head (remotehead.hf.HEAD_SHARD, as before).
from remotehead.hf.checkpoint import HEAD_SHARD, save_head_from_server

__all__ = ["HEAD_SHARD", "GenerateOutput", "OffloadedHead", "RemoteHeadCallback",
           "accumulation_window_ends", "generate", "head_params", "offload_lm_head",
           "route_causal_lm_loss", "save_head_from_server"]
