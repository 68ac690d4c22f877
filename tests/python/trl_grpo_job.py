"""One TRL GRPO run of test_data_parallel.py, run by torchrun (gloo, CPU): the tiny Llama, the
character tokenizer, prompts and reward of test_trl_grpo.py; a few optimizer steps of
gradient accumulation 2, 4 completions of up to 6 tokens per prompt, a fixed seed. With
--server the policy's head is on the server (RemoteHeadGRPOTrainer, the same call on every
rank), without it plain GRPOTrainer with the model's own lm_head. Rank 0 writes the logged
losses and metrics, the head (from the server, or the local lm_head), its version and the
body's parameters to --out (torch.save)."""

import argparse
import os
import pathlib

import torch
import transformers
from trl import GRPOConfig, GRPOTrainer

import remotehead
from ddp_trainer_job import end_process_group, save_trainer_outcome
from remotehead.trl import RemoteHeadGRPOTrainer
from test_trl_grpo import VOCAB, char_tokenizer, prompts, reward_early_characters


EOS_TOKEN, EOS_ROW_SCALE = 1, 20.0


def save_tiny_llama(path: pathlib.Path) -> str:
    """The tiny Llama of test_trl_grpo.py (untied), saved: TRL loads the reference from it."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=EOS_TOKEN, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        # A larger EOS row: some completions end early, so the loss types' normalisations
        # (per sequence, per rank, over the generation batch) differ.
        model.lm_head.weight[EOS_TOKEN] *= EOS_ROW_SCALE
    model.save_pretrained(path)
    return str(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="")
    parser.add_argument("--head-id", default="ddp-grpo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--importance-sampling-level", default="token")
    parser.add_argument("--top-entropy-quantile", type=float, default=1.0)
    parser.add_argument("--adam-epsilon", type=float, default=1e-6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = pathlib.Path(args.out)
    # Each rank its own copy (identical: same seed), so no rank waits for another's files.
    model_dir = save_tiny_llama(out.parent / f"{out.stem}-model-rank{rank}")
    config = GRPOConfig(
        output_dir=str(out.parent / f"{out.stem}-trainer"), use_cpu=True, bf16=False, seed=0,
        activation_checkpointing=False, report_to="none", save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=2, num_generations=4,
        gradient_accumulation_steps=2, steps_per_generation=4, max_completion_length=6,
        max_steps=args.steps,
        loss_type=args.loss_type, beta=args.beta, use_bias_correction_kl=False,
        importance_sampling_level=args.importance_sampling_level,
        top_entropy_quantile=args.top_entropy_quantile,
        learning_rate=3e-3, adam_epsilon=args.adam_epsilon, max_grad_norm=0.0, logging_steps=1,
        ddp_backend="gloo" if world > 1 else None)
    kwargs = dict(model=transformers.AutoModelForCausalLM.from_pretrained(
                      model_dir, dtype=torch.float32),
                  reward_funcs=reward_early_characters, args=config, train_dataset=prompts(),
                  processing_class=char_tokenizer())
    client = None
    if args.server:
        client = remotehead.Client(args.server)
        trainer = RemoteHeadGRPOTrainer(**kwargs, client=client, head_id=args.head_id)
        # Every loss type is one server call.
        assert trainer.fused_grpo_loss and trainer.fused_grpo_fallback is None
    else:
        trainer = GRPOTrainer(**kwargs)
    trainer.train()
    save_trainer_outcome(trainer, client, args, world)



if __name__ == "__main__":
    main()
    end_process_group()
