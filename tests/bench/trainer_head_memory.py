"""How much of the trainer's memory the LM head costs, measured as a user has it.

A Llama with Llama-3.2-1B's shapes (hidden 2048, vocabulary 128,256, untied head, 32 heads, 8 KV
heads, MLP 8192) and one decoder layer, trained for a few AdamW steps on random tokens, in four
configurations, each in a process of its own:

  local      the model's own lm_head (W, dW, AdamW state and the [N, V] logits here)
  copy       offload_lm_head(..., keep_local_copy=True): head trained on the server, a frozen
             local copy of W kept for generation
  no-copy    offload_lm_head(...): no local W (the default)
  body-only  the same model without any head: the body's last hidden states into a loss that
             needs no head (their mean square) — the floor the offloaded trainer can reach

The trainer's peak: on CUDA, torch.cuda.max_memory_allocated; on the CPU the process's peak
resident memory (ru_maxrss), measured after the imports so that only the run counts. The
verdict: no-copy's peak minus body-only's, against W's size (zero head memory: within 5 % of W).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CONFIGS = ("body-only", "no-copy", "copy", "local")
SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
             num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=1,
             max_position_embeddings=4096, tie_word_embeddings=False)


def peak_bytes(device) -> int:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(config: str, args) -> dict:
    """One configuration in this process."""
    import torch
    import transformers

    import remotehead
    import remotehead.hf
    from remotehead.local_server import LocalServer

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).to(device)
    w_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    server = client = head = None
    if config in ("copy", "no-copy"):
        server = LocalServer(os.environ["REMOTEHEAD_SERVER_BINARY"]).start()
        client = remotehead.Client(server.target)
        head = remotehead.hf.offload_lm_head(model, client, "memory",
                                             keep_local_copy=config == "copy")
    elif config == "body-only":
        model.lm_head = None  # the same model without any head
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = peak_bytes(device) if device.type == "cuda" else 0
    losses = []
    for _ in range(args.steps):
        if config == "body-only":
            hidden = model.model(input_ids=ids).last_hidden_state
            loss = hidden.float().square().mean()
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if head is not None:
            head.optimizer_step(adamw=dict(lr=1e-4, weight_decay=0.0))
        losses.append(float(loss))
    result = {"config": config, "peak_bytes": peak_bytes(device) - start, "w_bytes": w_bytes,
              "losses": losses}
    if server is not None:
        client.drop_head("memory")
        client.close()
        server.stop()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per step (default 512)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(args.one, args)))
        return 0
    results = {}
    for config in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--one", config, "--device", args.device,
                              "--seq", str(args.seq), "--steps", str(args.steps)],
                             check=True, capture_output=True, text=True).stdout
        results[config] = json.loads(out.strip().splitlines()[-1])
    w = results["local"]["w_bytes"]
    floor = results["body-only"]["peak_bytes"]
    gib = 2.0 ** 30
    print(f"trainer peak at Llama-3.2-1B's head shape (V=128256, D=2048, untied; one layer; "
          f"{args.seq} tokens; {args.device}); W = {w / gib:.2f} GiB")
    print(f"{'configuration':<12} {'peak GiB':>9} {'above body-only':>16} {'/ W':>6}")
    for config in ("local", "copy", "no-copy", "body-only"):
        peak = results[config]["peak_bytes"]
        print(f"{config:<12} {peak / gib:>9.2f} {(peak - floor) / gib:>14.2f} G "
              f"{(peak - floor) / w:>6.2f}")
    excess = (results["no-copy"]["peak_bytes"] - floor) / w
    verdict = "within" if excess <= 0.05 else "NOT within"
    print(f"no-copy: {excess * 100:.1f} % of W above body-only ({verdict} 5 %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
