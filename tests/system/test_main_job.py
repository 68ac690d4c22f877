"""The main job (client/python/examples/train_tiny_llama.py, run by scripts/demo) at a few
steps: it starts its own server, trains the local-head, torch-linear_cross_entropy and
remote-head variants in their own processes, their per-step losses agree (fp32, relative 1e-4),
the table prints, the picture is written from memory sampled during every step, and the server
drains and exits 0. The same for --tied (scripts/demo --tied: a Gemma-3-like model whose scaled
input embedding is its head): the remote run holds no [V, D] tensor at all, the local runs the tied
matrix and its AdamW state. No memory or speed assertion here: those are what the full run
shows."""

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "client" / "python" / "examples"))

import train_tiny_llama  # noqa: E402

STEPS = 4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_main_job_runs_three_heads_and_they_agree(capsys, tmp_path, tied):
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    vocab, hidden = 4096, 32
    args = train_tiny_llama.parse_args([f"--server-binary={binary}", f"--steps={STEPS}",
                                        "--batch=2", "--seq=32", f"--vocab={vocab}",
                                        f"--hidden={hidden}", *(["--tied"] if tied else [])])
    results = train_tiny_llama.compare(args)
    assert results["server_exit_code"] == 0
    for variant in ("local", "torch-lce", "remote"):
        run = results[variant]
        assert len(run["losses"]) == STEPS, variant
        assert run["loss_deviation"] <= 1e-4, variant
        # Memory sampled inside every step: fractional steps cover 0 .. STEPS.
        steps = [step for step, _ in run["memory_by_step"]]
        assert min(steps) < 0.5 and max(steps) > STEPS - 0.5, variant
        assert all(0 <= step <= STEPS for step in steps), variant
        assert max(mib for _, mib in run["memory_by_step"]) <= run["peak_mib"] + 1, variant
    # The [V, D] tensors held at the end, each with AdamW's two moments (Trainer sets the
    # gradients to None after each step): the local runs' embedding and lm_head (one matrix when
    # tied); the remote run's embedding when untied, nothing when tied.
    held = 3 * vocab * hidden * 4
    local_held = (1 if tied else 2) * held
    assert results["local"]["vd_bytes"] == results["torch-lce"]["vd_bytes"] == local_held
    assert results["remote"]["vd_bytes"] == (0 if tied else held)
    train_tiny_llama.print_table(results)
    table = capsys.readouterr().out
    for heading in ("local lm_head", "torch LCE", "remote head", "trainer peak memory (MiB)",
                    "growth in training", "tokens/s", "largest step loss diff",
                    "[V, D] tensors held (MiB)"):
        assert heading in table
    picture = tmp_path / "main-job.png"
    train_tiny_llama.plot(results, args, str(picture))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size > 20_000


def test_samples_map_to_fractional_steps():
    # Steps start at t=1 and t=3, training ends at t=4: t=2 is half-way through step 0,
    # t=3.5 half-way through step 1; samples before training are left out.
    samples = [(0.5, 10.0), (1.0, 11.0), (2.0, 12.0), (3.5, 13.0), (4.0, 14.0)]
    assert train_tiny_llama.samples_by_step(samples, [1.0, 3.0], 4.0) == [
        (0.0, 11.0), (0.5, 12.0), (1.5, 13.0), (2.0, 14.0)]


def test_torch_linear_cross_entropy_column_matches_the_models_own_loss():
    # The torch-lce column's loss: no logits built, and the loss, the body's and the head's
    # gradients equal transformers' own ForCausalLMLoss (fp32, 1e-5), with and without
    # num_items_in_batch.
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).float()
    patched = transformers.LlamaForCausalLM(config).float()
    patched.load_state_dict(reference.state_dict())
    train_tiny_llama.use_torch_linear_cross_entropy(patched)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(37)}):
        outputs = []
        for model in (reference, patched):
            model.zero_grad()
            out = model(input_ids=ids, labels=labels, **kwargs)
            out.loss.backward()
            outputs.append((out, model.lm_head.weight.grad.clone(),
                            model.model.embed_tokens.weight.grad.clone()))
        (ref, ref_dw, ref_demb), (got, dw, demb) = outputs
        assert got.logits is None and ref.logits is not None
        torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(demb, ref_demb, rtol=1e-5, atol=1e-6)


def test_main_job_with_two_data_parallel_trainers_prints_the_cluster_table(capsys, tmp_path):
    # scripts/demo --trainers 2 at a tiny shape: W = 1 and 2 runs (torchrun), every remote run
    # against its own server, the losses of W = 2 equal W = 1's and the local run's.
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    code = train_tiny_llama.main([f"--server-binary={binary}", "--steps=2", "--batch=2",
                                  "--seq=32", "--vocab=4096", "--hidden=32", "--trainers=2",
                                  "--plot="])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cluster: W data-parallel trainers" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert [row[0] for row in rows[-2:]] == ["1", "2"], out
    assert "per-step losses, largest relative difference" in out


def test_distillation_main_job_runs_three_ways_and_they_agree(capsys):
    # scripts/demo --distill (distill_main_job.py) at a small vocabulary: both heads local, TRL's
    # chunked loss, both heads on the server, each in its own process; per-step losses agree
    # (1e-4 relative), the remote run holds no lm_head bytes (a released W keeps one element per
    # model), and the table prints. The memory bar is what the full run (V = 128,256) shows.
    import distill_main_job

    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    args = distill_main_job.parse_args([f"--server-binary={binary}", "--vocab=4096", "--seq=128",
                                        "--steps=3", "--peak-share=1.5"])
    results = distill_main_job.run_all(args)
    for name in ("local", "trl", "remote"):
        assert len(results[name]["losses"]) == 3, name
        assert results[name]["loss_diff"] <= 1e-4, name
    assert results["remote"]["trainer_head_bytes"] <= 8
    assert results["local"]["trainer_head_bytes"] == 4096 * (32 + 64) * 4
    assert results["remote"]["losses"][-1] < results["remote"]["losses"][0]
    assert distill_main_job.print_table(args, results)
    table = capsys.readouterr().out
    for heading in ("local heads", "TRL chunked", "remote heads", "trainer peak memory (MiB)",
                    "largest step loss diff", "lm_head bytes on the trainer"):
        assert heading in table
