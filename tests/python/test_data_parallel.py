"""Data-parallel trainers on one head, with real processes: torchrun (gloo, CPU) runs W trainer
processes that offload the head exactly as one process does, against the same DDP run with the
model's own lm_head.

- The plain DDP loop (client/python/examples/ddp_train.py), W = 2 and 4, gradient accumulation
  2: per-step losses to 1e-5 relative, version = steps.
- transformers' Trainer (tests/python/ddp_trainer_job.py), W = 2 (and 4), gradient accumulation 2,
  average_tokens_across_devices on and off; with it on the run also equals one process with
  the same global batch; against one server and against a head group of 2. Losses to 1e-5
  relative.
- The head to 1e-5 of its magnitude, the Trainer's body to 1e-4 (its gradients come from dX,
  which a head group sums over its ranks' partials: 1.2e-5 measured). Both runs use AdamW with
  eps = 1e-6: with 1e-8, AdamW normalises the elements whose gradient is ~0 to ±lr, and there
  the fp32 summation order of dW (the server adds the ranks' micro-batches in arrival order,
  DDP sums each rank's, then all-reduces) showed at 1.3e-5–1.6e-4 in 1–4 elements of 8224 —
  as it does between the local DDP run and one local process (7e-5).
- TRL's GRPOTrainer with 2 processes (tests/python/trl_grpo_job.py), RemoteHeadGRPOTrainer
  against TRL with a local head, for dapo, grpo, bnpo, dr_grpo (fused) and sapo (two-phase):
  losses to 1e-5, rewards and completions equal, kl / entropy / clip metrics to 1e-5, head
  to 1e-5, body to 1e-4, head version = optimizer steps.
- The synchronous step itself, ranks as separate processes (tests/python/sync_step_rank.py): a
  rank killed before the step makes the others ABORTED naming it within the timeout, nothing
  applied; after its restart (its replayed micro-batch adds nothing) the step goes through
  with the exact DDP average. Disagreeing ranks (learning rate, grad scale) are all refused
  naming the field; a retry of an applied step gets the same version and applies nothing.
"""

import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import numerics
import remotehead
from remotehead.local_server import LocalHeadGroup, LocalServer, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
TORCHRUN = str(pathlib.Path(sys.executable).parent / "torchrun")
SYNC_TIMEOUT = 3.0


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client" / "python"), str(HERE),
                                       e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


def torchrun(world: int, script: pathlib.Path, *args: str, timeout: float = 600):
    """Runs `script` as `world` processes under torchrun (one process: plain python)."""
    launcher = ([TORCHRUN, f"--nproc_per_node={world}", f"--master_port={free_port()}"]
                if world > 1 else [sys.executable])
    done = subprocess.run([*launcher, str(script), *args], env=env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


@pytest.fixture(scope="module")
def server_process():
    with LocalServer(BINARY, ["--device=cpu", "--torch_threads=1", "--metrics_address=127.0.0.1:0",
                              f"--sync_step_timeout_seconds={SYNC_TIMEOUT}"]) as s:
        yield s


@pytest.fixture(scope="module")
def server(server_process):
    return server_process.target


def sync_step_metrics(server_process) -> dict:
    """The synchronous-step samples of the server's /metrics, by name with labels."""
    url = f"http://127.0.0.1:{server_process.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines() if line.startswith("remotehead_sync_step")}


@pytest.fixture(scope="module")
def group():
    g = LocalHeadGroup(BINARY, size=2, args=("--device=cpu", "--torch_threads=1")).start()
    yield g.target
    assert g.stop() == [0, 0], "".join(g.ranks[0].log + g.ranks[1].log)


def assert_losses_equal(actual, expected, rel=1e-5):
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"step {step}: {a} vs {e}"


# ----- the plain DDP loop -----

@pytest.mark.parametrize("world", [2, 4])
def test_a_ddp_loop_with_the_head_offloaded_equals_the_local_head_ddp_run(server, world,
                                                                           tmp_path):
    script = ROOT / "client" / "python" / "examples" / "ddp_train.py"
    common = ["--steps=3", "--accumulation=2", "--batch=2"]
    torchrun(world, script, *common, f"--server={server}", f"--head-id=loop-{world}",
             f"--out={tmp_path / 'remote.json'}")
    torchrun(world, script, *common, f"--out={tmp_path / 'local.json'}")
    remote = json.loads((tmp_path / "remote.json").read_text())
    local = json.loads((tmp_path / "local.json").read_text())
    assert remote["world_size"] == local["world_size"] == world
    assert_losses_equal(remote["losses"], local["losses"])
    assert remote["head_version"] == 3  # one step per global step, not one per rank
    assert numerics.close(torch.tensor(remote["head"]), torch.tensor(local["head"]), 1e-5)


# ----- transformers' Trainer -----

def trainer_run(world, out, *args, launcher=None, output_dir=None):
    output_dir = output_dir or out.parent / (out.stem + "-trainer")
    job = [f"--out={out}", f"--output-dir={output_dir}", *args]
    if launcher is None:
        torchrun(world, HERE / "ddp_trainer_job.py", *job)
    else:
        done = subprocess.run([*launcher, str(HERE / "ddp_trainer_job.py"), *job], env=env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    result = torch.load(out)
    if "--server" in " ".join(args):
        # Trainer moved the model and DDP wrapped it: the head stayed released on the trainer.
        assert result["trainer_head_bytes"] <= 4, result["trainer_head_bytes"]
    return result


def assert_same_run(remote, local, same_eval_batches=True):
    assert_losses_equal(remote["losses"], local["losses"])
    if same_eval_batches:  # Trainer's eval_loss is a mean of batch means
        assert_losses_equal([remote["eval_loss"]], [local["eval_loss"]])
    assert numerics.close(remote["head"], local["head"], 1e-5)
    for name, p in local["body"].items():
        assert numerics.close(remote["body"][name], p, 1e-4), name


@pytest.mark.parametrize("average_tokens", [1, 0])
def test_trainer_under_torchrun_with_the_head_offloaded_equals_the_local_head_ddp_run(
        server, average_tokens, tmp_path):
    flags = ["--steps=4", "--accumulation=2", "--batch=2", f"--average-tokens={average_tokens}"]
    remote = trainer_run(2, tmp_path / "remote.pt", *flags, f"--server={server}",
                         f"--head-id=trainer-avg{average_tokens}")
    local = trainer_run(2, tmp_path / "local.pt", *flags)
    assert remote["world_size"] == 2
    assert remote["version"] == 4
    assert_same_run(remote, local)
    if average_tokens:
        # The exact global-token mean: one process with the same global batch.
        one = trainer_run(1, tmp_path / "one.pt", "--steps=4", "--accumulation=2", "--batch=4")
        assert_same_run(remote, one, same_eval_batches=False)


def test_trainer_with_four_processes_equals_the_local_head_ddp_run(server, tmp_path):
    flags = ["--steps=3", "--accumulation=2", "--batch=1"]
    remote = trainer_run(4, tmp_path / "remote.pt", *flags, f"--server={server}",
                         "--head-id=trainer-four")
    local = trainer_run(4, tmp_path / "local.pt", *flags)
    assert remote["world_size"] == 4 and remote["version"] == 3
    assert_same_run(remote, local)


def test_trainer_under_torchrun_against_a_head_group_equals_the_local_head_ddp_run(
        group, tmp_path):
    flags = ["--steps=4", "--accumulation=2", "--batch=2"]
    remote = trainer_run(2, tmp_path / "remote.pt", *flags, f"--server={group}")
    local = trainer_run(2, tmp_path / "local.pt", *flags)
    assert remote["version"] == 4
    assert_same_run(remote, local)


def test_trainer_under_accelerate_launch_equals_the_local_head_ddp_run(server, tmp_path):
    # accelerate 1.15 on CPU: --multi_gpu with 2 processes runs DDP over gloo (torchrun inside).
    accelerate = [str(pathlib.Path(sys.executable).parent / "accelerate"), "launch",
                  "--multi_gpu", "--num_processes=2", "--num_machines=1",
                  "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}"]
    flags = ["--steps=4", "--accumulation=2", "--batch=2"]
    remote = trainer_run(2, tmp_path / "remote.pt", *flags, f"--server={server}",
                         "--head-id=trainer-accelerate", launcher=accelerate)
    local = trainer_run(2, tmp_path / "local.pt", *flags)
    assert remote["world_size"] == 2 and remote["version"] == 4
    assert_same_run(remote, local)


def test_trainer_under_torchrun_resumes_with_the_head_restored_once(tmp_path):
    # A server with durable state: each trainer checkpoint records the head's saved state.
    state_dir = tmp_path / "state"
    with LocalServer(BINARY, ["--device=cpu", "--torch_threads=1",
                              f"--state_dir={state_dir}"]) as s:
        flags = ["--steps=4", "--accumulation=2", "--batch=2", f"--server={s.target}",
                 "--head-id=resumed", "--save-steps=2"]
        out_dir = tmp_path / "trainer"
        full = trainer_run(2, tmp_path / "full.pt", *flags, output_dir=out_dir)
        # Resume at step 2 (the head is at version 4 on the server by now): rank 0 restores the
        # head's state of step 2 once; both ranks continue from it.
        resumed = trainer_run(2, tmp_path / "resumed.pt", *flags,
                              f"--resume={out_dir / 'checkpoint-2'}", output_dir=out_dir)
    restores = [line for line in s.log if "head state restored" in line]
    assert len(restores) == 1, restores
    assert resumed["version"] == 4
    # Trainer's log history: steps 1–2 from the checkpoint, 3–4 trained again.
    assert_losses_equal(resumed["losses"], full["losses"])
    assert numerics.close(resumed["head"], full["head"], 1e-5)


# ----- the synchronous step, rank by rank -----

def start_rank(server, head_id, rank, world, *flags):
    return subprocess.Popen(
        [sys.executable, str(HERE / "sync_step_rank.py"), f"--server={server}",
         f"--head-id={head_id}", f"--rank={rank}", f"--world={world}", *flags],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def answer(process, timeout=60):
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def new_head(client, head_id):
    import sync_step_rank as r
    client.create_head(head_id, r.VOCAB, r.HIDDEN, seed=3)
    return client.export_weights(head_id)[0]


def ddp_sgd(weight, ranks, lr):
    """W − lr · mean over ranks of d(sum of the rank's cross-entropy)/dW, by autograd."""
    import sync_step_rank as r
    grads = []
    for rank in ranks:
        hidden, targets = r.batch(rank)
        w = weight.clone().double().requires_grad_(True)
        torch.nn.functional.cross_entropy(hidden.double() @ w.t(), targets,
                                          reduction="sum").backward()
        grads.append(w.grad)
    return weight.double() - lr * torch.stack(grads).mean(0)


def test_a_rank_killed_before_the_step_aborts_the_others_and_after_its_restart_the_step_goes_through(
        server_process):
    server = server_process.target
    before = sync_step_metrics(server_process)
    client = remotehead.Client(server)
    w0 = new_head(client, "killed")
    start = time.monotonic()
    survivor = start_rank(server, "killed", 0, 2)
    killed = start_rank(server, "killed", 1, 2, "--die-before-step")
    killed.wait(timeout=60)
    assert killed.returncode == -9
    aborted = answer(survivor)
    assert time.monotonic() - start < SYNC_TIMEOUT + 30
    assert aborted["code"] == "ABORTED"
    assert "missing ranks [1]" in aborted["details"] and "nothing applied" in aborted["details"]
    info = client.describe_head("killed")
    assert info.weight_version == 0
    assert info.accumulated_micro_batches == 2  # both ranks' dW kept
    # Rank 1 restarts and runs its step again: its micro-batch is a replay, and now every rank
    # comes.
    ranks = [start_rank(server, "killed", r, 2) for r in (0, 1)]
    answers = [answer(p) for p in ranks]
    assert [a["version"] for a in answers] == [1, 1]
    assert [a["replayed"] for a in answers] == [True, True]
    weight = client.export_weights("killed")[0]
    assert numerics.close(weight, ddp_sgd(w0, [0, 1], 0.5), 1e-5)
    # The metrics saw it: one step aborted for a missing rank, one applied, three waits.
    after = sync_step_metrics(server_process)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('remotehead_sync_steps_aborted_total{reason="timeout"}') == 1
    assert delta("remotehead_sync_steps_applied_total") == 1
    assert delta("remotehead_sync_step_wait_seconds_count") == 3
    assert delta("remotehead_sync_step_wait_seconds_sum") >= SYNC_TIMEOUT * 0.9
    assert after["remotehead_sync_step_ranks_waiting"] == 0


@pytest.mark.parametrize("flag,field,values", [
    ("--lr=0.25", "sgd.lr", ("0.5", "0.25")),
    ("--grad-scale=0.5", "grad_scale", ("1", "0.5")),
])
def test_ranks_that_disagree_are_all_refused_naming_the_field_and_nothing_is_applied(
        server, flag, field, values):
    client = remotehead.Client(server)
    head_id = "disagree-" + field.replace(".", "-")
    w0 = new_head(client, head_id)
    first = start_rank(server, head_id, 0, 2)
    time.sleep(1.0)  # rank 0 is waiting when rank 1 asks
    second = start_rank(server, head_id, 1, 2, flag)
    for a in (answer(first), answer(second)):
        assert a["code"] == "INVALID_ARGUMENT"
        assert a["details"].startswith(field + ":"), a
        assert values[0] in a["details"] and values[1] in a["details"], a
    info = client.describe_head(head_id)
    assert info.weight_version == 0 and info.accumulated_micro_batches == 2
    assert torch.equal(client.export_weights(head_id)[0], w0)


def test_generation_and_evaluation_work_while_ranks_wait_at_a_step(server, tmp_path):
    client = remotehead.Client(server)
    import sync_step_rank as r
    new_head(client, "busy")
    # Rank 1 starts now and waits for `go`: started later, its Python and torch start-up (5 s
    # on a slow machine) would outlast rank 0's wait at the step (SYNC_TIMEOUT).
    go = tmp_path / "go"
    rank1 = start_rank(server, "busy", 1, 2, f"--wait-for={go}")
    waiting = start_rank(server, "busy", 0, 2)
    hidden, targets = r.batch(7)
    deadline = time.monotonic() + 30
    while client.describe_head("busy").accumulated_micro_batches < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # rank 0 is at the step, waiting for rank 1
    started = time.monotonic()
    tokens, logprobs = client.sample("busy", hidden, greedy=True)
    evaluated = client.forward("busy", hidden, targets, reduction="mean")
    assert time.monotonic() - started < SYNC_TIMEOUT / 2  # answered while rank 0 waits
    assert waiting.poll() is None
    w = client.export_weights("busy")[0]
    assert torch.equal(tokens, (hidden @ w.t()).argmax(-1))
    reference = torch.nn.functional.cross_entropy(hidden.double() @ w.double().t(), targets)
    assert abs(evaluated.loss - reference.item()) <= 1e-5 * reference.item()
    go.touch()
    assert [answer(waiting)["version"], answer(rank1)["version"]] == [1, 1]


def test_a_retried_step_gets_the_same_version_and_applies_nothing(server):
    client = remotehead.Client(server)
    new_head(client, "retried")
    ranks = [start_rank(server, "retried", r, 2) for r in (0, 1)]
    assert [answer(p)["version"] for p in ranks] == [1, 1]
    weight = client.export_weights("retried")[0]
    # Rank 1's answer was lost: it asks again.
    info = client.optimizer_step("retried", sgd=dict(lr=0.5), zero_gradients=True,
                                 synchronous=(0, 1, 2))
    assert info.weight_version == 1
    assert torch.equal(client.export_weights("retried")[0], weight)


# ----- TRL's GRPOTrainer -----

GRPO_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
                "cispo_clip_ratio", "vespo/phi_seq_mean")


# Every loss type is one server call of a policy function (per-token weights and a normalizer:
# per sequence, per rank, or over the generation batch's gathered count / W). grpo with
# sequence-level ratios (GSPO) and vespo are row-coupled on the server; the top-entropy mask is
# a quantile over both ranks' tokens (TRL's gather), sent as the policy mask.
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "sapo",
                                       "grpo:sequence:0.5", "vespo"])
def test_trl_grpo_with_two_processes_equals_the_local_head_run(server, loss_type, tmp_path):
    # tests/python/trl_grpo_job.py: 3 optimizer steps of 2 micro-batches per rank, one
    # generation per 2 steps (steps_per_generation 4: each step holds part of the groups, so
    # the logged loss is no cancelling sum of a group's advantages, and every second step is
    # off-policy and clips), completions ending at different lengths, beta > 0 (the reference
    # head on the server), AdamW eps 1e-6, no gradient clipping (GRPOConfig's default 1.0 clips
    # the local run's head with the body; the remote head is not clipped).
    import trl_grpo_job as job
    loss_type, level, quantile = (loss_type.split(":") + ["token", "1.0"])[:3]
    flags = ["--steps=3", f"--loss-type={loss_type}", "--beta=0.04",
             f"--importance-sampling-level={level}", f"--top-entropy-quantile={quantile}"]
    torchrun(2, HERE / "trl_grpo_job.py", *flags, f"--server={server}",
             f"--head-id=grpo-{loss_type}-{level}", f"--out={tmp_path / 'remote.pt'}")
    torchrun(2, HERE / "trl_grpo_job.py", *flags, f"--out={tmp_path / 'local.pt'}")
    remote, local = torch.load(tmp_path / "remote.pt"), torch.load(tmp_path / "local.pt")
    assert remote["world_size"] == local["world_size"] == 2
    assert remote["version"] == 3  # one synchronous step per optimizer step, not one per rank
    assert_losses_equal(remote["losses"], local["losses"])
    for r, l in zip(remote["logs"], local["logs"]):
        # The same completions (rewards, lengths), then the same loss metrics, reduced over
        # the ranks (relative, values below 1 held to 1e-5 absolute).
        for key in l:
            if key.startswith(("reward", "completions/")):
                assert r[key] == pytest.approx(l[key], rel=1e-6), key
        assert r.keys() == l.keys()
        for key in (k for k in GRPO_METRICS if k in l):  # each loss type logs its own
            assert numerics.close(r[key], l[key], 1e-5, floor=1.0), (key, r[key], l[key])
    # The EOS row is scaled up (early ends): the others are held to their own magnitude.
    eos = job.EOS_TOKEN
    others = [i for i in range(remote["head"].shape[0]) if i != eos]
    assert numerics.close(remote["head"][others], local["head"][others], 1e-5)
    assert numerics.close(remote["head"][eos], local["head"][eos], 1e-5)
    for name, p in local["body"].items():
        assert numerics.close(remote["body"][name], p, 1e-4), name
