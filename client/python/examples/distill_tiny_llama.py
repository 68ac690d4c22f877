"""Distillation in a plain PyTorch loop with both LM heads on a remotehead server: a tiny Llama
teacher (hidden 48) distilled into a tiny Llama student (hidden 32, the same vocabulary).

    python distill_tiny_llama.py --server 127.0.0.1:50051      # both heads on the server
    python distill_tiny_llama.py                                # both heads local (reference)

The teacher's head is uploaded frozen and the student's trainable (remotehead.hf.offload_lm_head:
neither model keeps its W afterwards). Each step runs both bodies here — the teacher's under
no_grad — and sends both last hidden states to the server, which computes TRL's generalized
JSD (beta 0.5) at temperature 0.9 mixed with 0.1 × the next-token cross-entropy, over the
completion tokens only, chunk by chunk without the [N, V] logits of either model; dX comes back
for the student's body (AdamW here), dW stays on the server (AdamW there). Without --server the
same loss is computed locally from both models' full logits: the per-step losses agree.
Models and data are built from seeds (no download).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import transformers

import remotehead
import remotehead.hf

VOCAB, PROMPT = 257, 4
BETA, TEMPERATURE, ALPHA = 0.5, 0.9, 0.1
LR, EPS = 3e-3, 1e-6


def tiny_llama(hidden: int, seed: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden,
                                      intermediate_size=2 * hidden, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def batches(steps: int, batch: int, seq: int):
    """(input_ids, targets): targets[t] = input_ids[t + 1] on the completion, -100 on the prompt
    and the last position (the tokens the loss leaves out)."""
    generator = torch.Generator().manual_seed(2)
    data = torch.randint(0, VOCAB, (2, batch, seq), generator=generator)
    for step in range(steps):
        ids = data[step % 2]
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        targets[:, :PROMPT] = -100
        yield ids, targets


def local_loss(student_logits, teacher_logits, targets):
    """The same loss from full logits: (1 − α)·JSD_β(p_s, p_t) + α·CE, mean over the completion
    tokens (what the server's "distill_jsd" computes)."""
    valid = targets != -100
    log_ps = torch.log_softmax(student_logits / TEMPERATURE, -1)
    log_pt = torch.log_softmax(teacher_logits / TEMPERATURE, -1)
    log_m = torch.logaddexp(log_ps + math.log(1 - BETA), log_pt + math.log(BETA))
    jsd = (BETA * log_pt.exp() * (log_pt - log_m)
           + (1 - BETA) * log_ps.exp() * (log_ps - log_m)).sum(-1)
    ce = torch.nn.functional.cross_entropy(student_logits.transpose(1, 2), targets,
                                           reduction="none")
    return ((1 - ALPHA) * jsd + ALPHA * ce)[valid].mean()


def run(args) -> dict:
    student, teacher = tiny_llama(32, seed=0), tiny_llama(48, seed=1)
    teacher.eval()
    head = None
    if args.server:
        client = remotehead.Client(args.server)
        # Frozen on the server: it takes no dW and no optimizer step; the only kind of head a
        # distillation step may name as its teacher.
        remotehead.hf.offload_lm_head(teacher, client, args.teacher_id, frozen=True)
        head = remotehead.hf.offload_lm_head(student, client, args.head_id)
    # A server-trained head is frozen locally: not among these parameters.
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for ids, targets in batches(args.steps, args.batch, args.seq):
        student_hidden = student.model(input_ids=ids).last_hidden_state
        with torch.no_grad():
            teacher_hidden = teacher.model(input_ids=ids).last_hidden_state
        if head is not None:
            loss = head.distill(student_hidden, teacher_hidden, targets, teacher=args.teacher_id,
                                function="distill_jsd",
                                params={"beta": BETA, "temperature": TEMPERATURE,
                                        "alpha": ALPHA})
        else:
            with torch.no_grad():
                teacher_logits = teacher.lm_head(teacher_hidden)
            loss = local_loss(student.lm_head(student_hidden), teacher_logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if head is not None:
            head.optimizer_step(adamw=dict(lr=LR, eps=EPS, weight_decay=0.0))
        losses.append(loss.item())
        print(f"step {len(losses)}: loss {loss.item():.6f}", flush=True)
    held = sum(m.lm_head.weight.untyped_storage().nbytes() for m in (student, teacher))
    result = {"losses": losses, "head_version": head.info.weight_version if head else None,
              # Bytes of lm_head storage the two models hold (a released W keeps one element).
              "trainer_head_bytes": held}
    if head is not None:
        client.drop_head(args.head_id)
        client.drop_head(args.teacher_id)
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="", help="remotehead server (empty: local heads)")
    parser.add_argument("--head-id", default="distill-student")
    parser.add_argument("--teacher-id", default="distill-teacher")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(run(parse_args())))
