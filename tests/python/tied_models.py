"""The tiny tied models of the tied-embedding tests (test_hf_tied.py, tied_trainer_job.py,
test_hf_tied_memory.py): a tied Llama, a Gemma-2-like model (Gemma2ForCausalLM, its scaled
embedding, final logit soft-capping) and a Gemma-3-like one (Gemma3ForCausalLM's text model,
Gemma3TextScaledWordEmbedding's √hidden scale), built from configs with fixed seeds (no
download); id 0 is the padding id (the embedding's padding_idx)."""

import torch
import transformers

KINDS = ("llama", "gemma2", "gemma3")
VOCAB, HIDDEN, PAD = 263, 32, 0
# Gemma 2's is 30; at this size logits are ~0.3, so a cap that bends them: the loss depends on it.
GEMMA2_SOFTCAP = 0.5


def tiny(kind: str, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = 2,
         dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, pad_token_id=PAD, eos_token_id=1,
                  bos_token_id=None, tie_word_embeddings=True)
    common.update(overrides)
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "gemma2":
        common.setdefault("final_logit_softcapping", GEMMA2_SOFTCAP)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            head_dim=hidden // 2, sliding_window=8, **common))
    elif kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            head_dim=hidden // 2, sliding_window=8, **common))
    else:
        raise ValueError(kind)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model.to(dtype)


def token_rows(rows: int, seq: int, seed: int, vocab: int = VOCAB):
    """`rows` sequences of `seq` ids with padding ids among them, and their labels: a prompt of
    1–4 tokens and the padding positions are not trained on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, seq), generator=g)
    pads = torch.rand(rows, seq, generator=g) < 0.15
    ids[pads] = PAD
    labels = ids.masked_fill(pads, -100)
    for r in range(rows):
        labels[r, : int(torch.randint(1, 5, (1,), generator=g))] = -100
    return ids, labels


def holds_no_matrix(model, optimizer=None) -> bool:
    """Whether nothing of `model` (parameters, their gradients, buffers) nor of `optimizer`'s
    state has V·D elements or more (the tied matrix's size)."""
    big = model.config.vocab_size * model.config.hidden_size
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor)]
    weight = model.lm_head.weight  # released: one element, broadcast
    return (all(t.numel() < big for t in tensors)
            and weight.untyped_storage().nbytes() == weight.element_size())
