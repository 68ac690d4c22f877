"""Durable training state: a server started with --state_dir survives kill -9.

transformers' Trainer trains a tiny Llama whose lm_head is trained on the server (AdamW, the
Trainer's linear schedule) for 10 steps, saving a checkpoint at step 5 (RemoteHeadCallback saves
the head's state with it). The server is killed with SIGKILL at step 7 and started again on the
same --state_dir: it restores each head's newest state (here the periodic one of step 6). A
trainer still holding the old connection is refused with ServerRestartedError naming the
restored version; a new trainer resumed from checkpoint-5 puts the head back to step 5 and its
losses of steps 6–10 equal those of an uninterrupted run (relative 1e-6).
"""

import os
import pathlib
import signal

import pytest
import torch
import transformers

import remotehead
import remotehead.hf
from remotehead.local_server import LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
STEPS, SAVE_AT, KILL_AT, ACCUMULATION, BATCH, SEQ, VOCAB = 10, 5, 7, 2, 2, 12, 257


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def dataset():
    generator = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(STEPS * ACCUMULATION * BATCH):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        labels = ids.clone()
        labels[:3] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def train(model, output_dir, callbacks, resume_from=None):
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=3e-3, weight_decay=0.01,
        lr_scheduler_type="linear", max_grad_norm=0.0, logging_steps=1, report_to="none",
        save_strategy="steps", save_steps=SAVE_AT, use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


class Crash(Exception):
    pass


class KillServerAt(transformers.TrainerCallback):
    """SIGKILL to the server at the end of step `step`: no drain, no state saved at exit."""

    def __init__(self, step, server):
        self.step, self.server = step, server

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.process.send_signal(signal.SIGKILL)
            self.server.process.wait(timeout=30)
            raise Crash()


def test_a_killed_server_resumes_from_the_trainer_checkpoint_with_the_same_losses(tmp_path):
    with LocalServer(BINARY, ["--device=cpu", f"--state_dir={tmp_path / 'state-a'}"]) as server:
        with remotehead.Client(server.target) as client:
            model = tiny_llama()
            head = remotehead.hf.offload_lm_head(model, client, "durable")
            uninterrupted = train(model, tmp_path / "a", [remotehead.hf.RemoteHeadCallback(head)])
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))

    flags = ["--device=cpu", f"--state_dir={tmp_path / 'state-b'}", "--checkpoint_every_steps=3"]
    server = LocalServer(BINARY, flags).start()
    client = remotehead.Client(server.target, max_attempts=1)
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "durable")
    with pytest.raises(Crash):
        train(model, tmp_path / "b", [remotehead.hf.RemoteHeadCallback(head),
                                      KillServerAt(KILL_AT, server)])
    client.close()
    assert (tmp_path / "b" / f"checkpoint-{SAVE_AT}" / "remotehead_state.json").is_file()

    with LocalServer(BINARY, flags) as restarted:
        log = "".join(restarted.log)
        assert 'head restored: "durable" version 6' in log, log  # the periodic state of step 6
        with remotehead.Client(restarted.target) as client:
            info = client.describe_head("durable")
            assert info.weight_version == 6 and info.incarnation != head.incarnation
            # The trainer that was connected to the killed server cannot go on silently.
            head.client = client
            with pytest.raises(remotehead.ServerRestartedError, match="at version 6"):
                head.optimizer_step(adamw=dict(lr=1e-3))
            hidden = torch.randn(4, 32)
            with pytest.raises(remotehead.ServerRestartedError, match="restarted"):
                head.loss(hidden, torch.randint(0, VOCAB, (4,)))
            assert client.describe_head("durable").weight_version == 6

            # A new trainer resumes from the checkpoint of step 5: the head goes back to it.
            resumed_model = tiny_llama()
            resumed_head = remotehead.hf.offload_lm_head(resumed_model, client, "durable",
                                                         upload=False)
            resumed = train(resumed_model, tmp_path / "b",
                            [remotehead.hf.RemoteHeadCallback(resumed_head)],
                            resume_from=tmp_path / "b" / f"checkpoint-{SAVE_AT}")
            assert client.describe_head("durable").weight_version == STEPS
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert abs(resumed[step] - uninterrupted[step]) <= 1e-6 * abs(uninterrupted[step]), (
            step, resumed[step], uninterrupted[step])


def test_a_corrupt_state_file_stops_the_server_naming_it(tmp_path):
    state_dir = tmp_path / "state"
    with LocalServer(BINARY, ["--device=cpu", f"--state_dir={state_dir}"]) as server:
        with remotehead.Client(server.target) as client:
            client.create_head("h", 64, 8)
            client.optimizer_step("h", sgd=dict(lr=0.1, weight_decay=0.1))
            saved = client.save_head_state("h")
            assert saved.state_id and saved.weight_version == 1
    files = sorted((state_dir / "h").glob("*.safetensors"))
    assert files  # the SIGTERM drain saved one more
    newest = files[-1]
    data = bytearray(newest.read_bytes())
    for damage in ("truncated", "flipped"):
        broken = data[: len(data) - 17] if damage == "truncated" else bytearray(data)
        if damage == "flipped":
            broken[-5] ^= 0x40
        newest.write_bytes(bytes(broken))
        server = LocalServer(BINARY, ["--device=cpu", f"--state_dir={state_dir}"])
        with pytest.raises(RuntimeError) as failed:
            server.start()
        message = str(failed.value)
        assert "exited with 2" in message, message
        assert str(newest) in message, message
        assert "was not loaded" in message, message
