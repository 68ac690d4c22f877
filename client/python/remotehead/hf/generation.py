"""Generation with the tokens drawn on the server (remotehead.hf.generate), and the server
params that reproduce a model's logit transform (head_params)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from remotehead.hf.offloaded import OffloadedHead


def head_params(model, temperature: float = 1.0) -> dict:
    """The server's common params (temperature, softcap) that reproduce the logit transform of
    `model`'s architecture (Gemma's final_logit_softcapping) at `temperature`; ValueError for a
    logit scaling the server's head does not apply."""
    config = model.config.get_text_config()
    for name in _LOGIT_SCALE_ATTRIBUTES:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(f"config.{name}: expected none or 1.0 (the server's head applies "
                             f"temperature and softcap only); got {value}")
    params = {"temperature": temperature}
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        params["softcap"] = softcap
    return params


# Logit scalings of some architectures (as TRL's add_fused_lm_head reads them): the server's
# functions have temperature and softcap only.
_LOGIT_SCALE_ATTRIBUTES = ("logit_scale", "output_multiplier", "lm_head_multiplier",
                           "logits_scaling")


@dataclasses.dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, prompt + new] token ids (pad_token_id after a row's EOS)
    logprobs: torch.Tensor   # [B, new] each drawn token's log-probability (0 after EOS)


@torch.no_grad()
def generate(model, head: OffloadedHead, input_ids: torch.Tensor, *,
             attention_mask: Optional[torch.Tensor] = None, max_new_tokens: int = 20,
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, eos_token_id: Optional[int] = None,
             pad_token_id: Optional[int] = None) -> GenerateOutput:
    """Decodes with the model's body here and the next token drawn on the server
    (Client.sample): per step B·D hidden values go up and B ids with their log-probabilities
    come back — no [B, V] logits anywhere on the trainer.

    The sampling is Hugging Face's (softcap of the architecture, temperature, top_k, top_p;
    greedy: argmax); step t's row r draws with a CPU generator seeded with seed + t·B + r, so a
    run is reproducible from its seed. Left-padded prompts: pass their attention_mask. Rows stop
    at eos_token_id (default: the model's generation config), then hold pad_token_id."""
    config = model.generation_config
    eos = eos_token_id if eos_token_id is not None else config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    pad = pad_token_id if pad_token_id is not None else (
        config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0))
    params = head_params(model, temperature)
    batch = input_ids.shape[0]
    mask = (attention_mask if attention_mask is not None
            else torch.ones_like(input_ids)).to(input_ids.device)
    sequences, logprobs = input_ids, []
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    decoder, cache, step_ids = model.get_decoder(), None, input_ids
    for step in range(max_new_tokens):
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        out = decoder(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                      past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tokens, logp = head.client.sample(
            head.head_id, out.last_hidden_state[:, -1, :].float(), greedy=greedy,
            temperature=params["temperature"], softcap=params.get("softcap", 0.0), top_k=top_k,
            top_p=top_p, seed=seed + step * batch)
        tokens = torch.where(finished, torch.full_like(tokens, pad), tokens)
        logprobs.append(torch.where(finished, torch.zeros_like(logp), logp))
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if eos:
            finished |= torch.isin(tokens, torch.tensor(eos, device=tokens.device))
        if bool(finished.all()):
            break
        step_ids = tokens[:, None]
    return GenerateOutput(sequences, torch.stack(logprobs, dim=1) if logprobs
                          else torch.empty(batch, 0))
