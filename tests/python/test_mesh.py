"""Replicas of a head on a mesh, with real server processes (Gloo on loopback): R replicas, each
one server or a head group of K ranks (--group_replicas), all R·K processes in one c10d world.

- 2 replicas of 1 and 2 replicas of groups of 2, fed different micro-batches by 4 different
  trainers (trainer t dials fronts[t mod 2]), then 3 synchronous AdamW steps: every replica's
  weights bit-identical to the other's (torch.equal), versions equal, and equal to one server
  fed all the micro-batches (fp32, 1e-5 relative) and to the same run in float64 (1e-5 of the
  weights' magnitude: AdamW amplifies fp32 rounding where a gradient is ~0, hence eps = 1e-6).
- Replicas that disagree (a learning rate) are refused everywhere naming the field, nothing
  applied on any replica; a replica whose trainers never come makes the step ABORTED on every
  replica, nothing applied.
- A tied embedding on the same meshes: the 4 trainers each read their input ids' rows from their
  replica (EmbeddingLookup), add the head's use (ForwardBackward) and the rows' gradient
  (EmbeddingGradient) under one GradientId, then 3 synchronous steps: the replicas
  bit-identical, equal to one server fed the same (1e-5) and to W trained in float64 with the
  sum of both uses (1e-5 of the weights; the head's use alone lands far off); a lookup at
  every front answers the same rows, W's.
- transformers' Trainer with 4 data-parallel processes (torchrun) on 2 replicas equals 1 process
  with the same global batch on one server: losses and head to 1e-5 relative, body to 1e-4.
- The C++ client takes the fronts list (trainer rank 1 dials replica 1) or follows the
  NOT_THE_LEADER it gets, and every replica ends with the same weights.
- Operations that change every replica go to the leader: a client given only another front is
  redirected by the NOT_THE_LEADER it gets (the leader's address), and the head exists on
  every replica afterwards; a trainer at the wrong replica gets WRONG_REPLICA.
"""

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import urllib.request

import pytest
import torch

import remotehead
from remotehead.local_server import LocalHeadGroup

from test_conformance import generate
from test_hf_tied import assert_an_empty_gradient_changes_nothing
from test_data_parallel import assert_same_run, trainer_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
VOCAB, HIDDEN, ROWS, WORLD, STEPS = 37, 16, 12, 4, 3
ADAMW = dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
SYNC_TIMEOUT = 4.0


def start_mesh(replicas: int, per_replica: int) -> LocalHeadGroup:
    return LocalHeadGroup(BINARY, size=replicas * per_replica, replicas=replicas,
                          args=("--device=cpu", "--torch_threads=1",
                                f"--sync_step_timeout_seconds={SYNC_TIMEOUT}",
                                "--mesh_checksum_every_steps=1",
                                "--metrics_address=127.0.0.1:0"),
                          timeout_seconds=20).start()


@pytest.fixture(scope="module", params=[(2, 1), (2, 2)], ids=["2x1", "2x2"])
def mesh(request):
    replicas, per_replica = request.param
    mesh = start_mesh(replicas, per_replica)
    yield mesh
    codes = mesh.stop()
    assert codes == [0] * len(codes), "".join(line for r in mesh.ranks for line in r.log)


def batch(trainer: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + trainer)
    return torch.randn(ROWS, HIDDEN, generator=g), torch.randint(0, VOCAB, (ROWS,), generator=g)


EMBED_SCALE = HIDDEN ** 0.5  # a Gemma-like √hidden scale on a tied model's embedding rows


def tied_batch(trainer: int, step: int):
    """A tied model's micro-batch: its input ids (repeats among them), what the rest of its body
    adds to their rows (hidden = context + EMBED_SCALE · W[ids]), and the targets."""
    g = torch.Generator().manual_seed(1000 * step + trainer + 500)
    return (torch.randint(0, VOCAB, (ROWS,), generator=g), torch.randn(ROWS, HIDDEN, generator=g),
            torch.randint(0, VOCAB, (ROWS,), generator=g))


def train(target, head_id: str, steps: int = STEPS, lr: float = ADAMW["lr"], tied=False):
    """WORLD trainers, each a client of `target` (a server, or a mesh's fronts) with its own
    rank, each adding its own micro-batch, then the synchronous step; the versions seen.
    tied: each first reads its ids' rows of W (EmbeddingLookup, at its replica), and after the
    head's step sends their gradient (dX · EMBED_SCALE) under the same gradient id, pinned to
    the version it read."""
    def trainer(rank: int, step: int):
        with remotehead.Client(target, rank=rank) as client:
            gradient_id = remotehead.GradientId(f"run/rank-{rank}", step, 0)
            if tied:
                ids, context, targets = tied_batch(rank, step)
                rows, version = client.embedding_lookup(head_id, ids)
                hidden = context + EMBED_SCALE * rows
            else:
                hidden, targets = batch(rank, step)
            result = client.forward_backward(head_id, hidden, targets, reduction="sum",
                                             accumulate=True, gradient_id=gradient_id)
            if tied:
                client.embedding_gradient(head_id, ids, EMBED_SCALE * result.grad_hidden,
                                          gradient_id=gradient_id,
                                          expected_weight_version=version)
            return client.optimizer_step(head_id, adamw=dict(ADAMW, lr=lr), zero_gradients=True,
                                         synchronous=(step, rank, WORLD)).weight_version
    versions = []
    with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
        for step in range(steps):
            versions.append(list(pool.map(lambda r: trainer(r, step), range(WORLD))))
    return versions


def float64_run(w0: torch.Tensor, tied=False, embedding_gradient=True) -> torch.Tensor:
    """The same steps in float64 with PyTorch's AdamW: the mean over trainers of each one's
    summed cross-entropy gradient (DDP's average). tied: train's tied model, W's gradient the
    sum of its two uses (without embedding_gradient: the head's use alone)."""
    w = w0.double().clone().requires_grad_(True)
    opt = torch.optim.AdamW([w], lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]),
                            eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    for step in range(STEPS):
        opt.zero_grad()
        loss = 0
        for rank in range(WORLD):
            if tied:
                ids, context, targets = tied_batch(rank, step)
                rows = w[ids] if embedding_gradient else w.detach()[ids]
                hidden = context.double() + EMBED_SCALE * rows
            else:
                hidden, targets = batch(rank, step)
            loss = loss + torch.nn.functional.cross_entropy(hidden.double() @ w.T, targets,
                                                            reduction="sum")
        (loss / WORLD).backward()
        opt.step()
    return w.detach()


def mesh_metrics(rank) -> dict:
    """The remotehead_mesh_* samples of one rank's /metrics, by name with labels."""
    url = f"http://127.0.0.1:{rank.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines() if line.startswith("remotehead_mesh")}


def replica_weights(mesh, head_id):
    out = []
    for front in mesh.fronts:
        with remotehead.Client(front) as client:
            weight, _ = client.export_weights(head_id)
            out.append((weight, client.describe_head(head_id).weight_version))
    return out


def test_replicas_fed_different_trainers_stay_identical_and_equal_one_server(mesh,
                                                                             server_target):
    head = f"mesh-train-{len(mesh.ranks)}"
    before = [mesh_metrics(r) for r in mesh.ranks]
    with remotehead.Client(mesh.fronts, rank=0) as leader, \
            remotehead.Client(server_target) as single:
        leader.create_head(head, VOCAB, HIDDEN, seed=7)
        single.create_head(head, VOCAB, HIDDEN, seed=7)
        w0, _ = single.export_weights(head)
        try:
            mesh_versions = train(mesh.fronts, head)
            single_versions = train(server_target, head)
            assert mesh_versions == single_versions == [[s + 1] * WORLD for s in range(STEPS)]
            (w_a, v_a), (w_b, v_b) = replica_weights(mesh, head)
            assert v_a == v_b == STEPS
            assert torch.equal(w_a, w_b), "the replicas' weights differ"
            w_single, _ = single.export_weights(head)
            scale = w_single.abs().max().item()
            assert (w_a - w_single).abs().max().item() <= 1e-5 * scale
            w64 = float64_run(w0)
            assert (w_a.double() - w64).abs().max().item() <= 1e-5 * scale
            assert (w_a.double() - w0.double()).abs().max().item() > 1e-3  # it did train
            # Every rank summed its shard's dW (fp32) over the replicas once per step, read the
            # step's commit decision ("apply") once per step, and the replicas compared their
            # weights' checksums once per step (every 1), all alike.
            per_replica = len(mesh.ranks) // len(mesh.fronts)
            for rank, was in zip(mesh.ranks, before):
                shard_rows = -(-VOCAB // per_replica) if rank is mesh.ranks[0] else None
                now = mesh_metrics(rank)
                reduced = (now["remotehead_mesh_reduced_bytes_total"]
                           - was["remotehead_mesh_reduced_bytes_total"])
                if shard_rows is not None:
                    assert reduced == STEPS * shard_rows * HIDDEN * 4, reduced
                assert reduced > 0
                matched = 'remotehead_mesh_checksums_total{result="match"}'
                assert now[matched] - was[matched] == STEPS
                assert now['remotehead_mesh_checksums_total{result="mismatch"}'] == 0
                applied = 'remotehead_mesh_steps_resolved_total{decision="apply"}'
                assert now[applied] - was[applied] == STEPS
                assert now['remotehead_mesh_steps_resolved_total{decision="abort"}'] == 0
                assert now["remotehead_mesh_up"] == 1
        finally:
            leader.drop_head(head)
            single.drop_head(head)


def test_a_tied_embedding_trained_on_replicas_stays_identical_and_equals_one_server(
        mesh, server_target):
    """Each trainer reads its ids' rows from its replica, sends the head's use and the rows'
    gradient there under one gradient id, then the synchronous step: each replica's dW holds
    both uses of its trainers, the mesh sums them, and W moves as a local tied parameter."""
    head = f"mesh-tied-{len(mesh.ranks)}"
    with remotehead.Client(mesh.fronts, rank=0) as leader, \
            remotehead.Client(server_target) as single:
        leader.create_head(head, VOCAB, HIDDEN, seed=19)
        single.create_head(head, VOCAB, HIDDEN, seed=19)
        w0, _ = single.export_weights(head)
        try:
            steps = [[s + 1] * WORLD for s in range(STEPS)]
            assert train(mesh.fronts, head, tied=True) == steps
            assert train(server_target, head, tied=True) == steps
            (w_a, v_a), (w_b, v_b) = replica_weights(mesh, head)
            assert v_a == v_b == STEPS
            assert torch.equal(w_a, w_b), "the replicas' weights differ"
            w_single, _ = single.export_weights(head)
            scale = w_single.abs().max().item()
            assert (w_a - w_single).abs().max().item() <= 1e-5 * scale
            assert (w_a.double() - float64_run(w0, tied=True)).abs().max().item() <= 1e-5 * scale
            # The embedding's gradient counts: W trained by the head's use alone is far off.
            head_only = float64_run(w0, tied=True, embedding_gradient=False)
            assert (w_a.double() - head_only).abs().max().item() > 1e-2 * scale
            # A lookup at every front (on a group: the shards' partial rows summed) gives the
            # same rows, W's: every id (both shards' rows) and repeats.
            ids = torch.cat([torch.arange(VOCAB).flip(0), torch.tensor([5, 5, 0])])
            for front in mesh.fronts:
                with remotehead.Client(front) as client:
                    rows, version = client.embedding_lookup(head, ids)
                    assert version == STEPS and torch.equal(rows, w_a[ids]), front
        finally:
            leader.drop_head(head)
            single.drop_head(head)


def failed_steps(fronts, head, ranks, add_batches=False, lr_of=lambda rank: ADAMW["lr"],
                 max_attempts=5):
    """Trainers `ranks` of WORLD (each its own client of `fronts`), each adding its micro-batch
    first with `add_batches`, ask for synchronous step 0 with learning rate lr_of(rank); every
    one must fail: their errors, by rank."""
    def trainer(rank):
        with remotehead.Client(fronts, rank=rank, max_attempts=max_attempts) as client:
            if add_batches:
                hidden, targets = batch(rank, 0)
                client.forward_backward(head, hidden, targets, reduction="sum", accumulate=True,
                                        gradient_id=(f"run/rank-{rank}", 0, 0))
            with pytest.raises(remotehead.RemoteheadError) as failed:
                client.optimizer_step(head, adamw=dict(ADAMW, lr=lr_of(rank)),
                                      zero_gradients=True, synchronous=(0, rank, WORLD))
            return failed.value
    ranks = list(ranks)
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(trainer, ranks))


def test_an_embedding_gradient_without_ids_is_refused_at_every_front(mesh):
    # The same refusal as one server's (test_hf_tied.py), by the trainers of both replicas
    # (ranks 0 and 1: the leader's front and a follower replica's): nothing accumulated on any
    # replica, no micro-batch counted.
    head = "mesh-empty-ids"
    with remotehead.Client(mesh.fronts, rank=0) as leader:
        leader.create_head(head, VOCAB, HIDDEN, seed=8)
        try:
            for rank in range(len(mesh.fronts)):
                with remotehead.Client(mesh.fronts, rank=rank) as c:
                    hidden, targets = batch(rank, 0)
                    c.forward_backward(head, hidden, targets, reduction="sum", accumulate=True,
                                       gradient_id=remotehead.GradientId(f"empty/{rank}", 0, 0))
                    assert_an_empty_gradient_changes_nothing(
                        c, head, remotehead.GradientId(f"empty/{rank}", 0, 1))
        finally:
            leader.drop_head(head)


def test_replicas_that_disagree_are_refused_everywhere_and_nothing_is_applied(mesh):
    head = "mesh-disagree"
    with remotehead.Client(mesh.fronts) as leader:
        leader.create_head(head, VOCAB, HIDDEN, seed=3)
        try:
            # Replica 1's trainers (odd ranks) ask for another learning rate.
            errors = failed_steps(mesh.fronts, head, range(WORLD), add_batches=True,
                                  lr_of=lambda rank: 0.05 if rank % 2 == 0 else 0.07)
            for e in errors:
                assert isinstance(e, remotehead.RanksDisagreeError), e
                assert "replica 1 disagrees with replica 0" in e.details, e.details
                assert e.metadata.get("field") == "adamw.lr", e.metadata
            for _, version in replica_weights(mesh, head):
                assert version == 0
        finally:
            leader.drop_head(head)


def test_a_replica_whose_trainers_never_come_aborts_the_step_everywhere(mesh):
    head = "mesh-missing"
    with remotehead.Client(mesh.fronts) as leader:
        leader.create_head(head, VOCAB, HIDDEN, seed=5)
        try:
            # Replica 0's trainers (0, 2) come; replica 1's (1, 3) never do.
            errors = failed_steps(mesh.fronts, head, [0, 2])
            for e in errors:
                assert e.code.name == "ABORTED", e
                assert "got ranks [0, 2], missing ranks [1, 3]" in e.details, e.details
                assert e.metadata.get("missing_ranks") == "1,3", e.metadata
            for _, version in replica_weights(mesh, head):
                assert version == 0
        finally:
            leader.drop_head(head)


def test_changes_go_to_the_leader_and_reach_every_replica(mesh):
    head = "mesh-redirect"
    # A client that knows only replica 1's front: its create is refused there with the
    # leader's address, and the client follows it.
    with remotehead.Client(mesh.fronts[1]) as other:
        with pytest.raises(remotehead.NotTheLeaderError) as refused:
            other._unary(other._stub.CreateHead, remotehead.client.pb.CreateHeadRequest(
                head_id=head, init=dict(vocab_size=VOCAB, hidden_size=HIDDEN, seed=1)))
        assert refused.value.leader == mesh.fronts[0]
        assert refused.value.code.name == "FAILED_PRECONDITION"
        info = other.create_head(head, VOCAB, HIDDEN, seed=1)
        assert info.vocab_size == VOCAB
        weights = [w for w, _ in replica_weights(mesh, head)]
        assert torch.equal(weights[0], weights[1])
        with pytest.raises(remotehead.WrongReplicaError) as wrong:
            other.optimizer_step(head, sgd=dict(lr=0.1), synchronous=(0, 0, 2))
        assert wrong.value.metadata["replica"] == "0"
        upload = torch.randn(VOCAB, HIDDEN)
        other.upload_head(head, upload, replace=True)
        for w, _ in replica_weights(mesh, head):
            assert torch.equal(w, upload)
        other.drop_head(head)
    for front in mesh.fronts:
        with remotehead.Client(front) as client:
            with pytest.raises(remotehead.HeadNotFoundError):
                client.describe_head(head)


def test_trainer_with_four_processes_on_two_replicas_equals_one_process_on_one_server(
        server_target, tmp_path):
    mesh = start_mesh(2, 1)
    try:
        remote = trainer_run(4, tmp_path / "mesh.pt", "--steps=3", "--accumulation=2",
                             "--batch=1", f"--server={','.join(mesh.fronts)}",
                             "--head-id=trainer-mesh")
    finally:
        assert mesh.stop() == [0, 0], "".join(line for r in mesh.ranks for line in r.log)
    one = trainer_run(1, tmp_path / "one.pt", "--steps=3", "--accumulation=2", "--batch=4",
                      f"--server={server_target}", "--head-id=trainer-mesh-one")
    assert remote["world_size"] == 4 and remote["version"] == one["version"] == 3
    assert_same_run(remote, one, same_eval_batches=False)


DRIVER = os.environ.get("REMOTEHEAD_CONFORMANCE_DRIVER",
                        str(ROOT / "build" / "tests" / "remotehead-conformance-driver"))


@pytest.mark.parametrize("how", ["fronts", "redirect"])
def test_the_cpp_client_takes_the_fronts_and_follows_the_leader(mesh, how, server_target,
                                                               tmp_path):
    """The C++ client (through the conformance driver): given the fronts list as trainer rank
    1 it dials replica 1 and sends the creation and the step to the leader; given replica 1's
    front only, it follows the NOT_THE_LEADER it gets. Either way every replica ends with the
    same weights at version 1, which the dW of the ForwardBackward on replica 1 moved."""
    head = f"mesh-cpp-{how}"
    fb = {"name": "fb", "rpc": "ForwardBackward", "head_id": head,
          "inputs": {"rows": 8, "hidden_size": HIDDEN, "seed": 1, "hidden_dtype": "float32",
                     "targets": {"vocab_size": VOCAB, "ignore_every": 0, "ignore_value": -1}},
          "options": {"reduction": "sum", "gradient_id": ["cpp", 0, 0]}}
    calls = [{"name": "create", "rpc": "CreateHead", "head_id": head, "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "seed": 9, "dtype": "float32", "bias": False},
             fb,
             {"name": "step", "rpc": "OptimizerStep", "head_id": head, "lr": 0.5,
              "zero_gradients": True}]
    (tmp_path / "calls.json").write_text(json.dumps({"calls": calls}))
    target = ([f"--target={mesh.fronts[0]}", f"--fronts={','.join(mesh.fronts)}", "--rank=1"]
              if how == "fronts" else [f"--target={mesh.fronts[1]}"])
    done = subprocess.run([DRIVER, *target, f"--calls={tmp_path / 'calls.json'}",
                           f"--out={tmp_path / 'out.json'}"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    results = {r["name"]: r for r in json.loads((tmp_path / "out.json").read_text())["calls"]}
    assert all(r["ok"] for r in results.values()), results
    with remotehead.Client(mesh.fronts[0]) as leader:
        try:
            (w_a, v_a), (w_b, v_b) = replica_weights(mesh, head)
            assert v_a == v_b == 1
            assert torch.equal(w_a, w_b)
            with remotehead.Client(mesh.fronts[1]) as replica1:
                # Replica 1 took the ForwardBackward: its dW (zeroed by the step) was there.
                assert replica1.describe_head(head).accumulated_micro_batches == 0
            # The same calls on one server (the Python client, the same generated inputs).
            with remotehead.Client(server_target) as single:
                single.create_head(head, VOCAB, HIDDEN, seed=9)
                try:
                    g, _ = generate(fb["inputs"])
                    single.forward_backward(head, g["hidden"], g["targets"], reduction="sum",
                                            accumulate=True, gradient_id=("cpp", 0, 0))
                    single.optimizer_step(head, sgd=dict(lr=0.5), zero_gradients=True)
                    w_single, _ = single.export_weights(head)
                finally:
                    single.drop_head(head)
            assert (w_a - w_single).abs().max().item() <= 1e-6 * w_single.abs().max().item()
        finally:
            leader.drop_head(head)


def forged_create(head_id: str) -> bytes:
    """A GroupCommand{create = CreateHeadRequest} as a stranger would encode it (field 1)."""
    request = remotehead.client.pb.CreateHeadRequest(head_id=head_id)
    request.init.vocab_size = VOCAB
    request.init.hidden_size = HIDDEN
    body = request.SerializeToString()
    return b"\x0a" + bytes([len(body)]) + body


def test_a_strangers_writes_into_the_mesh_store_change_nothing(server_target):
    """A stranger who reaches the store writes forged commands, OK replies and garbage at the
    next places of every log of a mesh of 2 groups of 2 (the fronts' log and each replica's):
    nothing is executed, the refusals are logged, and the mesh trains on in step with one
    server, every rank SERVING."""
    from torch.distributed import TCPStore
    import datetime
    import time
    head = "mesh-forged"
    mesh = start_mesh(2, 2)
    try:
        with remotehead.Client(mesh.fronts) as leader, \
                remotehead.Client(server_target) as single:
            leader.create_head(head, VOCAB, HIDDEN, seed=11)
            single.create_head(head, VOCAB, HIDDEN, seed=11)
            stranger = TCPStore("127.0.0.1", mesh.store_port, is_master=False,
                                wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
            for log in ["remotehead/shard/0/commands", "remotehead/replica/0/commands",
                        "remotehead/replica/1/commands"]:
                for seq in range(64):
                    value = forged_create("evil") if seq % 2 == 0 else os.urandom(40)
                    stranger.set(f"{log}/cmd/{seq}", value)
                    stranger.set(f"{log}/reply/{seq}/1", b"0:0:")
            time.sleep(1.0)  # the followers poll every 200 ms: they have seen the entries
            assert train(mesh.fronts, head, steps=2) == train(server_target, head, steps=2)
            (w_a, v_a), (w_b, v_b) = replica_weights(mesh, head)
            w_single, _ = single.export_weights(head)
            single.drop_head(head)
            assert v_a == v_b == 2 and torch.equal(w_a, w_b)
            assert (w_a - w_single).abs().max().item() <= 1e-5 * w_single.abs().max().item()
            for front in mesh.fronts:
                with remotehead.Client(front) as c:
                    with pytest.raises(remotehead.HeadNotFoundError):
                        c.describe_head("evil")
            for rank in mesh.ranks:
                with remotehead.Client(rank.target) as c:
                    assert c.health() == "SERVING"
    finally:
        codes = mesh.stop()
    logs = ["".join(r.log) for r in mesh.ranks]
    assert codes == [0, 0, 0, 0], "".join(logs)
    for rank in (1, 2, 3):  # every follower: of replica 0's front, of the leader, of replica 1's
        assert "not executed" in logs[rank] and '"evil"' not in logs[rank], logs[rank][-3000:]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_rank_lost_before_the_step_aborts_it_everywhere_with_nothing_applied(how):
    """A mesh of 2 groups of 2: trainers add their micro-batches, then replica 1's second rank
    is killed (SIGKILL) or hung (SIGSTOP: treated as lost once --group_timeout_seconds passed)
    and the trainers ask for the step. Replica 1's front finds its rank gone before anything is
    summed over the replicas: the step fails on every replica within two timeouts, no weight
    moved anywhere (replica 0's version and weights as before), and the mesh is down (health
    NOT_SERVING on the leader): it restarts as a whole. A hung rank continued later runs
    nothing more: it leaves (exit 1)."""
    import signal
    import time
    head = "mesh-killed"
    mesh = LocalHeadGroup(BINARY, size=4, replicas=2,
                          args=("--device=cpu", "--torch_threads=1",
                                f"--sync_step_timeout_seconds={SYNC_TIMEOUT}"),
                          timeout_seconds=4).start()
    try:
        with remotehead.Client(mesh.fronts) as leader:
            leader.create_head(head, VOCAB, HIDDEN, seed=13)
            w0, _ = leader.export_weights(head)
            for rank in range(WORLD):
                with remotehead.Client(mesh.fronts, rank=rank) as client:
                    hidden, targets = batch(rank, 0)
                    client.forward_backward(head, hidden, targets, reduction="sum",
                                            accumulate=True,
                                            gradient_id=(f"run/rank-{rank}", 0, 0))
            lost = mesh.ranks[3].process
            if how == "SIGKILL":
                lost.send_signal(signal.SIGKILL)
                lost.wait()
            else:
                mesh.ranks[3].pause()
            started = time.monotonic()
            errors = failed_steps(mesh.fronts, head, range(WORLD), max_attempts=1)
            assert time.monotonic() - started < 2 * 4 + 3, "not reported within two timeouts"
            for e in errors:
                assert e.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"), e
            # Replica 0's group is whole: its weights read as they were, at version 0.
            with remotehead.Client(mesh.fronts[0]) as replica0:
                info = replica0.describe_head(head)
                assert info.weight_version == 0
                w, _ = replica0.export_weights(head)
                assert torch.equal(w, w0), "a weight moved although the step failed"
                deadline = time.monotonic() + 5
                while replica0.health() != "NOT_SERVING" and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert replica0.health() == "NOT_SERVING"
            if how == "SIGSTOP":
                lost.send_signal(signal.SIGCONT)
                assert lost.wait(timeout=30) == 1
    finally:
        for r in mesh.ranks:
            if r.process is not None and r.process.poll() is None:
                r.process.kill()
        mesh.stop()


@pytest.mark.parametrize("flags, named", [
    (["--group_size=4", "--group_rank=0", "--group_replicas=3"], "--group_replicas"),
    (["--group_size=2", "--group_rank=0", "--group_replicas=0"], "--group_replicas"),
    (["--mesh_reduce_dtype=float8"], "--mesh_reduce_dtype"),
    (["--mesh_checksum_every_steps=-1"], "--mesh_checksum_every_steps"),
    (["--group_size=4", "--group_rank=0", "--group_replicas=2", "--mesh_min_replicas=3"],
     "--mesh_min_replicas"),
    (["--mesh_min_replicas=-1"], "--mesh_min_replicas"),
    (["--mesh_max_evictions=-2"], "--mesh_max_evictions"),
    (["--mesh_eviction_window_seconds=0"], "--mesh_eviction_window_seconds"),
    (["--testonly_mesh_pause=after_sum,1,1"], "--testonly_mesh_pause"),
])
def test_bad_mesh_flags_are_refused_naming_the_flag(flags, named):
    done = subprocess.run([BINARY, "--listen=127.0.0.1:0", "--device=cpu", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr and "expected" in done.stderr and "got" in done.stderr, \
        done.stderr


def test_dw_summed_in_bfloat16_keeps_the_replicas_identical_and_close():
    """--mesh_reduce_dtype=bfloat16: dW travels in bf16 along R. The replicas stay bit-identical
    (replica 0's sums are broadcast), and one SGD step lands within bf16 rounding of dW
    (2^-8 relative) of the fp32 step on one server."""
    head = "mesh-bf16"
    mesh = LocalHeadGroup(BINARY, size=2, replicas=2,
                          args=("--device=cpu", "--torch_threads=1",
                                "--mesh_reduce_dtype=bfloat16")).start()
    try:
        with remotehead.Client(mesh.fronts) as leader:
            leader.create_head(head, VOCAB, HIDDEN, seed=17)
            w0, _ = leader.export_weights(head)
            grads = []
            for rank in range(2):
                with remotehead.Client(mesh.fronts, rank=rank) as client:
                    hidden, targets = batch(rank, 0)
                    client.forward_backward(head, hidden, targets, reduction="sum",
                                            accumulate=True, gradient_id=(f"bf16/{rank}", 0, 0))
                    w = w0.double().clone().requires_grad_(True)
                    torch.nn.functional.cross_entropy(hidden.double() @ w.T, targets,
                                                      reduction="sum").backward()
                    grads.append(w.grad)
            leader.optimizer_step(head, sgd=dict(lr=0.01), zero_gradients=True)
            (w_a, v_a), (w_b, v_b) = replica_weights(mesh, head)
            assert v_a == v_b == 1 and torch.equal(w_a, w_b)
            step = 0.01 * (grads[0] + grads[1])
            moved = w0.double() - w_a.double()
            assert (moved - step).abs().max().item() <= 2 ** -7 * step.abs().max().item()
            # Rounded to bf16 on the way, far beyond fp32's rounding (~1e-7 of the step).
            assert (moved - step).abs().max().item() > 1e-5 * step.abs().max().item()
            leader.drop_head(head)
    finally:
        assert mesh.stop() == [0, 0]


def test_the_sizing_table_in_the_docs_is_the_cost_models():
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "bench" / "sizing.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in (ROOT / "docs" / "meshes.md").read_text()
