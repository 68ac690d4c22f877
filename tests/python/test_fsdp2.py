"""FSDP2 bodies with the head offloaded (untied and tied models), with real processes: one
torchrun launch of tests/python/fsdp2_job.py (2 ranks, gloo, CPU; accelerate does not enable
FSDP on the CPU, so the job calls torch.distributed.fsdp.fully_shard itself: each decoder layer,
then the root, as accelerate's TRANSFORMER_BASED_WRAP does) against the same FSDP2 run with the
model's own lm_head:

- 3 AdamW steps (the server's synchronous AdamW for the head): every rank's per-step losses to
  1e-5 relative, the body's parameters to 1e-4 and the head to 1e-5 of their magnitude, head
  version 3 — and the head moved from its initial weights, so the comparison is not vacuous;
  once with fully_shard by hand, once with accelerate's own FSDP2 preparation
  (fsdp2_prepare_model, what Trainer runs on GPUs: transformer-based wrap, lm_head and the
  final norm in a group of their own, CPU-RAM-efficient loading through the meta device);
- the sharded, offloaded model holds nothing of W: the released weight keeps its shape, is no
  parameter (FSDP2 would refuse its broadcast storage: "FSDP does not support non-contiguous
  parameters"), costs 4 bytes, and the sharded model's state dict is the reference's without
  lm_head.weight;
- packed sequences (DataCollatorWithFlattening, each rank its own): every rank's loss to 1e-5,
  the body's gradients after FSDP's reduce-scatter to 1e-5, and the server's dW (the sum over
  the ranks) / 2 = the reference's lm_head gradient (FSDP's average) to 1e-5;
- hidden states that are a DTensor (a sequence-parallel shard) are refused by RemoteHead.loss
  and token_outputs naming the DTensor and what to do (full_tensor()), nothing accumulated on
  the server; the plain tensor the message asks for gives the loss of the unsharded rows;
- tied models (a tied Llama and the Gemma-3-like model of tied_models.py: √hidden embedding
  scale, padding ids among the inputs), offloaded by the same one call (the input embedding
  served by the head, the lm_head released) and sharded both ways, against the same FSDP2 run
  with the model's own tied matrix (one parameter, sharded by FSDP2): 3 AdamW steps, every
  rank's losses to 1e-5 relative, the body to 1e-4, the server's tied weight to 1e-5 of the
  local tied parameter's magnitude (moved from its start), head version 3; every rank's
  backward sent its embedding gradient once per step under its own trainer identity; the
  sharded model holds no [V, D] tensor (parameters, buffers, optimizer state) and its state
  dict is the reference's without either name of the tied matrix.
All in the same launch (the tied models after the untied one).
"""

import pytest
import torch

import numerics
from test_data_parallel import HERE, torchrun
import tied_models
from test_hf_trainer import VOCAB, tiny_llama

WORLD, STEPS = 2, 3
TIED = ("llama", "gemma3")  # tied_models.py kinds run under FSDP2


@pytest.fixture(scope="module")
def job(server_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2") / "results.pt"
    torchrun(WORLD, HERE / "fsdp2_job.py", f"--server={server_target}", f"--steps={STEPS}",
             "--head-id=fsdp2", f"--tied={','.join(TIED)}", f"--out={out}", timeout=300)
    return torch.load(out)


def assert_losses_equal(actual, expected, rel=1e-5):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"{i}: {a} vs {e}"


@pytest.mark.parametrize("sharding", ["train", "accelerate"])
def test_the_sharded_model_holds_nothing_of_the_head(job, sharding):
    assert job["world_size"] == WORLD
    run = job[sharding]
    assert run["head_shape"] == (VOCAB, 32)
    assert not run["head_is_parameter"]
    assert run["head_bytes"] <= 4
    # accelerate puts lm_head in an FSDP group of its own (with the final norm): nothing to
    # shard there now.
    assert run["lm_head_wrapped"] == (sharding == "accelerate")
    assert "lm_head.weight" in run["local_state_keys"]
    assert run["remote_state_keys"] == [k for k in run["local_state_keys"]
                                        if k != "lm_head.weight"]


@pytest.mark.parametrize("sharding", ["train", "accelerate"])
def test_fsdp2_training_with_the_head_offloaded_equals_the_local_head_run(job, sharding):
    run = job[sharding]
    assert len(run["remote_losses"]) == WORLD
    for rank in range(WORLD):
        assert len(run["local_losses"][rank]) == STEPS
        assert_losses_equal(run["remote_losses"][rank], run["local_losses"][rank])
    assert run["version"] == STEPS  # one synchronous step per step, not one per rank
    assert run["remote_body"].keys() == run["local_body"].keys()
    for name, p in run["local_body"].items():
        assert numerics.close(run["remote_body"][name], p, 1e-4), name
    assert numerics.close(run["remote_head"], run["local_head"], 1e-5)
    initial = tiny_llama(tied=False).lm_head.weight.detach()
    assert numerics.relative_error(run["local_head"], initial) > 1e-3


def test_packed_sequences_under_fsdp2_give_the_local_losses_and_gradients(job):
    packed = job["packed"]
    assert_losses_equal(packed["remote_losses"], packed["local_losses"])
    assert packed["local_losses"][0] != packed["local_losses"][1]  # the ranks' own sequences
    local, remote = packed["local_grads"], packed["remote_grads"]
    assert remote.keys() == local.keys() - {"lm_head.weight"}
    for name, g in remote.items():
        assert numerics.close(g, local[name], 1e-5), name
    # The server holds the ranks' sum; FSDP averaged the reference's gradient over the ranks.
    head_grad = local["lm_head.weight"]
    assert head_grad.abs().max() > 0
    assert numerics.close(packed["server_dw"] / WORLD, head_grad, 1e-5)


@pytest.mark.parametrize("call", ["loss", "token_outputs"])
def test_a_dtensor_hidden_is_refused_with_what_to_do(job, call):
    answer = job["dtensor"][call]
    assert answer.startswith("INVALID_ARGUMENT: hidden: expected a torch.Tensor; got a DTensor")
    assert "Shard(dim=1)" in answer and "tensor- or sequence-parallel" in answer
    assert "hidden.full_tensor()" in answer
    assert job["dtensor"]["accumulated_before_after"] == (0, 0)
    # What it asks for: the gathered rows, the loss of the unsharded hidden states.
    assert job["dtensor"]["full_tensor_loss"] == job["dtensor"]["plain_loss"]


@pytest.mark.parametrize("sharding", ["train", "accelerate"])
@pytest.mark.parametrize("kind", TIED)
def test_fsdp2_training_of_a_tied_model_with_its_embedding_served_equals_its_own_tied_matrix(
        job, kind, sharding):
    run = job["tied"][kind][sharding]
    assert run["local_tied"]  # the reference: one tied parameter, sharded by FSDP2
    for rank in range(WORLD):
        assert len(run["local_losses"][rank]) == STEPS
        assert_losses_equal(run["remote_losses"][rank], run["local_losses"][rank])
    assert run["version"] == STEPS
    assert run["remote_body"].keys() == run["local_body"].keys()
    for name, p in run["local_body"].items():
        assert numerics.close(run["remote_body"][name], p, 1e-4), name
    # The server's W after the steps = the local tied parameter (both uses' gradients).
    assert numerics.close(run["remote_head"], run["local_head"], 1e-5)
    initial = tied_models.tiny(kind).lm_head.weight.detach()
    assert numerics.relative_error(run["local_head"], initial) > 1e-3
    # Each rank's backward sent its embedding's gradient once per step, as its own trainer.
    sent = run["embedding_gradients"]
    for rank in range(WORLD):
        assert [(step, micro) for _, step, micro in sent[rank]] == [(s, 0) for s in
                                                                    range(STEPS)]
    assert len({trainer for rank in sent for trainer, _, _ in rank}) == WORLD
    # What the sharded, served model holds: no [V, D] tensor, no parameter of either use.
    assert run["embedding_served"] and run["holds_no_matrix"]
    assert not run["head_is_parameter"] and run["head_bytes"] <= 4
    # accelerate sees them tied and puts both in the final norm's FSDP group (nothing of the
    # matrix to shard there); by hand they stay in the root's.
    wrapped = sharding == "accelerate"
    assert run["embedding_wrapped"] == run["lm_head_wrapped"] == wrapped
    names = run["head_names"]
    assert len(names) == 2 and set(names) <= set(run["local_state_keys"])
    assert run["remote_state_keys"] == [k for k in run["local_state_keys"] if k not in names]
