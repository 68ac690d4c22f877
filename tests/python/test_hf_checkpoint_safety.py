"""A checkpoint of an offloaded model never loads with a wrong or random head (issue 26, part 1).

save_pretrained stages the body and the server's head in a hidden directory, verifies them and
publishes them with renames, the index last (remotehead/hf/checkpoint.py). Against real servers
and tiny Llamas built from configs (fixed seeds, no download):
- saving twice into one directory (Trainer.save_model after an earlier save) loads the second
  save's body and head, bit-exact; so do a sharded save followed by a single-file one, and two
  variants in one directory, each with its own head;
- the server killed in the middle of the export: the save fails, the previous checkpoint loads
  as it was, nothing partial is left;
- the trainer killed in the middle of the export: the previous checkpoint loads as it was; the
  next save removes what the crash left;
- a server restart before the save, or during the export (the client's retry reaching the new
  process, which restored the same version): ServerRestartedError, the directory unchanged;
- another client stepped the head: FAILED_PRECONDITION, the directory unchanged; a pinned
  export_weights_to_safetensors (remotehead.hf.checkpoint) that the server refuses leaves no file, not even .tmp;
- a server head that is not the model's lm_head's shape fails verification, nothing published;
- a kept local copy (keep_local_copy=True) is not what is saved: the server's head is;
- Trainer's checkpoint-N directories and save_model twice into output_dir load with the server's
  head of that moment;
- a file system without locks still saves (with a warning);
- is_main_process=False writes nothing, push_to_hub is refused before anything is written.
Heads are compared bit-exactly with the server's ExportWeights.
"""

import errno
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import grpc
import pytest
import torch
import transformers

import remotehead
import remotehead._safetensors
import remotehead.hf
from remotehead.hf.checkpoint import STAGING_PREFIX, export_weights_to_safetensors
from remotehead.local_server import LocalServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
VOCAB, HIDDEN = 257, 32
# A head of 64 MiB: more than gRPC's flow-control windows and the sockets' buffers hold, so a
# server killed after its first rows cannot have sent the rest already.
BIG_VOCAB, BIG_HIDDEN = 32768, 512


def tiny_llama(vocab=VOCAB, hidden=HIDDEN):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def train_step(model, head, seed):
    """One step that moves both the body (local SGD) and the head (a server AdamW step)."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.05 * p.grad.sign())
                p.grad = None
    head.optimizer_step(adamw=dict(lr=1e-2, weight_decay=0.0))


def body(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def assert_loads(directory, expected_body, expected_head, **kwargs):
    """from_pretrained(directory) holds exactly this body and head, nothing missing."""
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(
        directory, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(loaded.lm_head.weight.detach(), expected_head)
    state = loaded.state_dict()
    for name, value in expected_body.items():
        assert torch.equal(state[name], value), name


def snapshot(directory):
    """Every file under `directory` (hidden ones too) with a hash of its bytes."""
    files = {}
    for path in sorted(pathlib.Path(directory).rglob("*")):
        if path.is_file():
            files[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def assert_clean(directory):
    """Nothing left by a save: no staging directory, no partial file; the index lists exactly
    the weight files there are."""
    entries = os.listdir(directory)
    assert not [e for e in entries if e.startswith(STAGING_PREFIX) or e.endswith(".tmp")], entries
    assert "model.safetensors" not in entries
    index = (pathlib.Path(directory) / "model.safetensors.index.json").read_text()
    listed = set(json.loads(index)["weight_map"].values())
    assert listed == {e for e in entries if e.endswith(".safetensors")}, (listed, entries)


def kill_after_first_rows(monkeypatch, action):
    """Runs `action()` once, when an export has written its first row chunk into the shard,
    then lets the export go on reading the server's stream (and retrying)."""
    write_rows = remotehead._safetensors.write_rows
    pending = [action]

    def hooked(path, name, dtype, shape, chunks):
        def rows():
            for chunk in chunks:
                yield chunk
                if pending:
                    pending.pop()()
        return write_rows(path, name, dtype, shape, rows())

    monkeypatch.setattr(remotehead._safetensors, "write_rows", hooked)


class RestartableServer:
    """A server on a fixed port with a --state_dir: killed with SIGKILL and started again there,
    it restores its heads' saved states under a new incarnation."""

    def __init__(self, tmp_path):
        self.port = free_port()
        self.flags = [f"--listen=127.0.0.1:{self.port}", "--device=cpu",
                      f"--state_dir={tmp_path / 'state'}"]
        self.server = None

    def start(self):
        self.server = LocalServer(BINARY, self.flags).start()
        assert self.server.target == f"127.0.0.1:{self.port}"
        return self

    def kill(self):
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait(timeout=30)
        self.server.process = None

    def restart(self):
        self.kill()
        self.start()

    @property
    def target(self):
        return self.server.target

    def stop(self):
        if self.server is not None:
            self.server.stop()


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


@pytest.fixture
def restartable(tmp_path):
    server = RestartableServer(tmp_path).start()
    yield server
    server.stop()


def test_saving_twice_into_one_directory_loads_the_second_save(client, tmp_path):
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-twice")
    model.save_pretrained(tmp_path / "ckpt")
    train_step(model, head, seed=1)
    server_head, _ = client.export_weights("safety-twice")
    # What trainer.save_model() does after an earlier save there: transformers alone would
    # write a new model.safetensors next to the first save's index and head shard.
    model.save_pretrained(tmp_path / "ckpt")
    assert_loads(tmp_path / "ckpt", body(model), server_head)
    assert_clean(tmp_path / "ckpt")
    client.drop_head("safety-twice")


def test_a_sharded_save_then_a_single_file_one_loads_the_second(client, tmp_path):
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-shards")
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    shards = [e for e in os.listdir(tmp_path / "ckpt") if "-of-" in e]
    assert len(shards) >= 3, shards  # max_shard_size is honoured
    first_head, _ = client.export_weights("safety-shards")
    assert_loads(tmp_path / "ckpt", body(model), first_head)
    train_step(model, head, seed=2)
    # The state_dict passed is what is saved (its head entry aside: that is the server's).
    state = model.state_dict()
    state["model.norm.weight"] = state["model.norm.weight"] + 1.0
    expected = {**body(model), "model.norm.weight": state["model.norm.weight"]}
    model.save_pretrained(tmp_path / "ckpt", state_dict=state)
    second_head, _ = client.export_weights("safety-shards")
    assert_loads(tmp_path / "ckpt", expected, second_head)
    assert_clean(tmp_path / "ckpt")
    assert not [s for s in shards if (tmp_path / "ckpt" / s).exists()]  # old shards gone
    client.drop_head("safety-shards")


def test_two_variants_in_one_directory_keep_their_own_heads(client, tmp_path):
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-variant")
    model.save_pretrained(tmp_path / "ckpt")
    first_body, first_head = body(model), client.export_weights("safety-variant")[0]
    train_step(model, head, seed=3)
    model.save_pretrained(tmp_path / "ckpt", variant="later")
    later_head, _ = client.export_weights("safety-variant")
    assert_loads(tmp_path / "ckpt", body(model), later_head, variant="later")
    assert_loads(tmp_path / "ckpt", first_body, first_head)
    client.drop_head("safety-variant")


def test_the_server_killed_during_the_export_leaves_the_previous_checkpoint(
        restartable, tmp_path, monkeypatch):
    client = remotehead.Client(restartable.target, max_attempts=2)
    model = tiny_llama(BIG_VOCAB, BIG_HIDDEN)
    head = remotehead.hf.offload_lm_head(model, client, "safety-killed")
    model.save_pretrained(tmp_path / "ckpt")
    old_body, old_head = body(model), client.export_weights("safety-killed")[0]
    train_step(model, head, seed=4)
    kill_after_first_rows(monkeypatch, restartable.kill)
    with pytest.raises(remotehead.RemoteheadError):
        model.save_pretrained(tmp_path / "ckpt")
    assert_loads(tmp_path / "ckpt", old_body, old_head)
    assert_clean(tmp_path / "ckpt")
    client.close()


def test_a_server_restart_during_the_export_raises_and_publishes_nothing(
        restartable, tmp_path, monkeypatch):
    client = remotehead.Client(restartable.target)
    model = tiny_llama(BIG_VOCAB, BIG_HIDDEN)
    head = remotehead.hf.offload_lm_head(model, client, "safety-restart")
    model.save_pretrained(tmp_path / "ckpt")
    train_step(model, head, seed=5)
    # The restarted server restores exactly the trainer's version: only the incarnation says
    # that the export's rows would come from another process.
    assert client.save_head_state("safety-restart").weight_version == head.info.weight_version
    before = snapshot(tmp_path / "ckpt")
    kill_after_first_rows(monkeypatch, restartable.restart)
    with pytest.raises(remotehead.ServerRestartedError):
        model.save_pretrained(tmp_path / "ckpt")
    assert client.retries > 0  # the export's retry reached the new process, which refused it
    assert snapshot(tmp_path / "ckpt") == before
    client.close()


def test_a_server_restart_before_the_save_raises_and_publishes_nothing(restartable, tmp_path):
    client = remotehead.Client(restartable.target)
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-restarted")
    model.save_pretrained(tmp_path / "ckpt")
    train_step(model, head, seed=6)
    client.save_head_state("safety-restarted")
    before = snapshot(tmp_path / "ckpt")
    restartable.restart()
    assert client.describe_head("safety-restarted").incarnation != head.incarnation
    with pytest.raises(remotehead.ServerRestartedError, match="restarted"):
        model.save_pretrained(tmp_path / "ckpt")
    assert snapshot(tmp_path / "ckpt") == before
    client.close()


def test_a_head_another_client_stepped_is_not_saved(client, server_target, tmp_path):
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-other")
    model.save_pretrained(tmp_path / "ckpt")
    train_step(model, head, seed=7)
    with remotehead.Client(server_target) as other:
        other.forward_backward("safety-other", torch.randn(4, HIDDEN),
                               torch.randint(0, VOCAB, (4,)), gradient_id=("other", 0, 0))
        other.optimizer_step("safety-other", adamw=dict(lr=1e-2), zero_gradients=True)
    before = snapshot(tmp_path / "ckpt")
    with pytest.raises(remotehead.RemoteheadError) as refused:
        model.save_pretrained(tmp_path / "ckpt")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "expected_weight_version" in refused.value.details
    assert snapshot(tmp_path / "ckpt") == before
    client.drop_head("safety-other")


def test_a_server_head_of_another_shape_fails_verification(client, tmp_path):
    model = tiny_llama()
    remotehead.hf.offload_lm_head(model, client, "safety-verify")
    model.save_pretrained(tmp_path / "ckpt")
    before = snapshot(tmp_path / "ckpt")
    # A head of the same id but another vocabulary (dropped and created again): the shard
    # would not fit the model.
    client.drop_head("safety-verify")
    client.create_head("safety-verify", VOCAB + 3, HIDDEN)
    other = tiny_llama()
    remotehead.hf.offload_lm_head(other, client, "safety-verify", upload=False)
    with pytest.raises(remotehead.hf.checkpoint.CheckpointError, match="lm_head"):
        other.save_pretrained(tmp_path / "ckpt")
    assert snapshot(tmp_path / "ckpt") == before
    client.drop_head("safety-verify")


CRASHING_SAVE = """
import os, signal, sys
import torch
import remotehead, remotehead._safetensors, remotehead.hf
from test_hf_checkpoint_safety import kill_after_first_rows, tiny_llama

target, server, head_id = sys.argv[1:4]
model = tiny_llama()
remotehead.hf.offload_lm_head(model, remotehead.Client(server), head_id, upload=False)
with torch.no_grad():
    model.model.norm.weight.add_(1.0)  # a body unlike the one saved before


class Patch:  # pytest's monkeypatch, for this process
    def setattr(self, owner, name, value):
        setattr(owner, name, value)


kill_after_first_rows(Patch(), lambda: os.kill(os.getpid(), signal.SIGKILL))
model.save_pretrained(target)
"""


def test_a_trainer_killed_during_the_export_leaves_the_previous_checkpoint(client, server_target,
                                                                         tmp_path):
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-crash")
    model.save_pretrained(tmp_path / "ckpt")
    old_body, old_head = body(model), client.export_weights("safety-crash")[0]
    # Another process saves the same head into the directory and dies with SIGKILL after the
    # first rows of the head are written.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "client" / "python"), str(ROOT / "tests" / "python")])}
    crashed = subprocess.run([sys.executable, "-c", CRASHING_SAVE, str(tmp_path / "ckpt"),
                              server_target, "safety-crash"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert_loads(tmp_path / "ckpt", old_body, old_head)
    # The crash left its staging directory (the body and part of the head) for the next save.
    assert [e for e in os.listdir(tmp_path / "ckpt") if e.startswith(STAGING_PREFIX)]
    # What versions before staging left after a crash: a partial head shard beside the index.
    (tmp_path / "ckpt" / (remotehead.hf.HEAD_SHARD + ".tmp")).write_bytes(b"partial")
    # The next save publishes its own checkpoint and removes what the crashes left.
    train_step(model, head, seed=8)
    model.save_pretrained(tmp_path / "ckpt")
    assert_loads(tmp_path / "ckpt", body(model), client.export_weights("safety-crash")[0])
    assert_clean(tmp_path / "ckpt")
    client.drop_head("safety-crash")


def test_a_kept_local_copy_is_not_what_is_saved(client, tmp_path):
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-copy", keep_local_copy=True)
    train_step(model, head, seed=9)  # the server's head moves; the local copy stays
    server_head, _ = client.export_weights("safety-copy")
    assert not torch.equal(model.lm_head.weight.detach(), server_head)
    model.save_pretrained(tmp_path / "ckpt")
    assert_loads(tmp_path / "ckpt", body(model), server_head)
    client.drop_head("safety-copy")


def test_a_file_system_without_locks_still_saves(client, tmp_path, monkeypatch):
    model = tiny_llama()
    remotehead.hf.offload_lm_head(model, client, "safety-nolock")

    def no_lock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(remotehead.hf.checkpoint.fcntl, "flock", no_lock)
    with pytest.warns(UserWarning, match="no file lock"):
        model.save_pretrained(tmp_path / "ckpt")
    assert_loads(tmp_path / "ckpt", body(model), client.export_weights("safety-nolock")[0])
    client.drop_head("safety-nolock")


def test_not_the_main_process_writes_nothing_and_push_to_hub_is_refused(client, tmp_path):
    model = tiny_llama()
    remotehead.hf.offload_lm_head(model, client, "safety-rank")
    model.save_pretrained(tmp_path / "ckpt", is_main_process=False)
    assert snapshot(tmp_path / "ckpt") == {}
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "hub", push_to_hub=True)
    assert not (tmp_path / "hub").exists()
    client.drop_head("safety-rank")


class RecordServerHead(transformers.TrainerCallback):
    """The server's head at each checkpoint the Trainer writes (by global step)."""

    def __init__(self, client, head_id):
        self.client, self.head_id, self.heads = client, head_id, {}

    def on_save(self, args, state, control, **kwargs):
        self.heads[state.global_step] = self.client.export_weights(self.head_id)[0]


def test_trainer_checkpoints_and_save_model_twice_load_with_the_server_head(client, tmp_path):
    model = tiny_llama()
    head = remotehead.hf.offload_lm_head(model, client, "safety-trainer")
    generator = torch.Generator().manual_seed(10)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, VOCAB, (8, 12), generator=generator)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
        learning_rate=1e-2, save_strategy="steps", save_steps=2, report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True)
    record = RecordServerHead(client, "safety-trainer")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=rows,
        callbacks=[remotehead.hf.RemoteHeadCallback(head, save_state=False), record])
    trainer.train()
    assert sorted(record.heads) == [2, 4]
    for step, server_head in record.heads.items():
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out" /
                                                               f"checkpoint-{step}")
        assert torch.equal(loaded.lm_head.weight.detach(), server_head), step
    assert not torch.equal(record.heads[2], record.heads[4])
    trainer.save_model()
    train_step(model, head, seed=11)
    trainer.save_model()
    assert_loads(tmp_path / "out", body(model), client.export_weights("safety-trainer")[0])
    client.drop_head("safety-trainer")


def test_a_pinned_export_refused_by_the_server_leaves_no_file(client, tmp_path):
    info = client.create_head("safety-pinned", 64, 8)
    path = str(tmp_path / "head.safetensors")
    with pytest.raises(remotehead.RemoteheadError, match="expected_weight_version") as refused:
        export_weights_to_safetensors(client, "safety-pinned", path,
                                      expected_weight_version=info.weight_version + 1)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(remotehead.ServerRestartedError):
        export_weights_to_safetensors(client, "safety-pinned", path,
                                      expected_incarnation="another-process")
    assert os.listdir(tmp_path) == []  # neither the file nor its partial .tmp
    export_weights_to_safetensors(client, "safety-pinned", path,
                                  expected_incarnation=info.incarnation,
                                  expected_weight_version=info.weight_version)
    assert remotehead._safetensors.read_complete_header(path)["lm_head.weight"]["shape"] == [64, 8]
    client.drop_head("safety-pinned")


def test_a_truncated_shard_is_refused(tmp_path):
    path = str(tmp_path / "cut.safetensors")
    # A stream that ends before its rows: the file is cut short, as after a crash.
    with pytest.raises(remotehead.RemoteheadError, match="expected 2 rows"):
        remotehead._safetensors.write_rows(path, "w", torch.float32, (2, 4), iter(()))
    with pytest.raises(ValueError, match="expected 128 bytes .*; got 96"):
        remotehead._safetensors.read_complete_header(path)
