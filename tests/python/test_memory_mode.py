"""The memory mode: a half-precision head whose dW (and db) accumulate in its own dtype
(create_head / upload_head with grad_dtype = the head's bf16), through the real server.

- HeadInfo says so (grad_dtype), and the server reserves half the gradient memory: a memory
  budget that holds W and a bf16 dW refuses the same head with fp32 accumulators
  (RESOURCE_EXHAUSTED naming the head's bytes) and takes it in the memory mode.
- dW over several micro-batches, against float64 autograd on the same bf16 values: the default
  (fp32 accumulators) within 2e-3 relative (the bf16 logits' rounding), the memory mode within
  1.5e-2 (one bf16 rounding per chunk's addition, on top); dX is the same in both modes.
- Refusals name the field, expected and actual: a dtype that is neither float32 nor the head's,
  a replace that would change it. A saved state restores it, and a head group creates every
  shard with it.
"""

import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

import numerics
import remotehead
from remotehead.local_server import LocalHeadGroup, LocalServer

V, D, N, MICRO_BATCHES = 512, 64, 96, 4
ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))


def weight():
    torch.manual_seed(0)
    return (torch.randn(V, D) / D**0.5).to(torch.bfloat16)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(N, D, generator=g).to(torch.bfloat16),
             torch.randint(0, V, (N,), generator=g)) for _ in range(MICRO_BATCHES)]


def float64_reference(w):
    """Σ dW and each dX of the micro-batches, float64 autograd on the bf16 values."""
    w64 = w.double().requires_grad_()
    dxs = []
    for hidden, targets in batches():
        h = hidden.double().requires_grad_()
        F.cross_entropy(h @ w64.T, targets).backward()
        dxs.append(h.grad)
    return w64.grad, dxs


def train(client, head_id):
    dxs = []
    for i, (hidden, targets) in enumerate(batches()):
        r = client.forward_backward(head_id, hidden, targets, gradient_id=("memory", 0, i))
        dxs.append(r.grad_hidden)
    dw, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == MICRO_BATCHES
    return dw, dxs


def test_the_memory_mode_accumulates_in_bf16_within_its_stated_accuracy(server_target):
    w = weight()
    dw64, dx64 = float64_reference(w)
    with remotehead.Client(server_target) as client:
        default = client.upload_head("memory-default", w)
        memory = client.upload_head("memory-mode", w, grad_dtype=torch.bfloat16)
        assert default.grad_dtype == torch.float32 and memory.grad_dtype == torch.bfloat16
        assert client.describe_head("memory-mode").grad_dtype == torch.bfloat16
        try:
            dw_default, dx_default = train(client, "memory-default")
            dw_memory, dx_memory = train(client, "memory-mode")
        finally:
            client.drop_head("memory-default")
            client.drop_head("memory-mode")
    assert dw_default.dtype == torch.float32 and dw_memory.dtype == torch.bfloat16
    err_default = numerics.relative_error(dw_default.double(), dw64)
    err_memory = numerics.relative_error(dw_memory.double(), dw64)
    print(f"dW against float64: fp32 accumulators {err_default:.2e}, bf16 {err_memory:.2e}")
    assert err_default <= 2e-3, err_default
    assert err_memory <= 1.5e-2, err_memory
    # The bf16 accumulator rounds each addition: it is measurably less exact than fp32's.
    assert err_memory > err_default
    for a, b, ref in zip(dx_default, dx_memory, dx64):
        assert torch.equal(a, b)  # dX does not depend on where dW accumulates
        assert numerics.relative_error(a.double(), ref) <= 1e-2


def test_the_server_reserves_half_the_gradient_memory():
    # Bytes per element of W: the upload's assembly buffer (2, bf16) while the head is made, W
    # (2) and dW — fp32 (4): 8 in all; the memory mode's bf16 (2): 6. A budget of 7 takes only
    # the memory mode's head.
    rows, width = 4096, 256
    budget = 7 * rows * width
    server = LocalServer(BINARY, ["--device=cpu", f"--memory_budget_bytes={budget}"]).start()
    try:
        with remotehead.Client(server.target) as client:
            w = torch.zeros(rows, width, dtype=torch.bfloat16)
            with pytest.raises(remotehead.RemoteheadError) as e:
                client.upload_head("fp32-dw", w)
            assert e.value.code.name == "RESOURCE_EXHAUSTED", e.value
            assert "float32 gradients" in e.value.details, e.value.details
            info = client.upload_head("bf16-dw", w, grad_dtype=torch.bfloat16)
            assert info.grad_dtype == torch.bfloat16
    finally:
        assert server.stop() == 0


def test_refusals_name_the_field_expected_and_actual(server_target):
    w = weight()
    with remotehead.Client(server_target) as client:
        with pytest.raises(remotehead.InvalidArgumentError) as e:
            client.upload_head("memory-fp16", w, grad_dtype=torch.float16)
        assert e.value.details == ("header.grad_dtype: expected float32 or the head's dtype "
                                   "(bfloat16); got float16")
        with pytest.raises(remotehead.InvalidArgumentError) as e:
            client.create_head("memory-init", 16, 8, grad_dtype=torch.bfloat16)
        assert e.value.details == ("init.grad_dtype: expected float32 or the head's dtype "
                                   "(float32); got bfloat16")
        client.upload_head("memory-replace", w, grad_dtype=torch.bfloat16)
        try:
            with pytest.raises(remotehead.InvalidArgumentError) as e:
                client.upload_head("memory-replace", w, replace=True, grad_dtype=torch.float32)
            assert e.value.details.startswith("header.grad_dtype: expected bfloat16 (head "
                                              "\"memory-replace\"'s gradient dtype"), e.value
            # Unset keeps it.
            assert client.upload_head("memory-replace", w, replace=True).grad_dtype == \
                torch.bfloat16
        finally:
            client.drop_head("memory-replace")
        assert [h.head_id for h in client.list_heads() if h.head_id.startswith("memory-")] == []


def test_a_saved_state_and_a_head_group_keep_the_memory_mode(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    args = ["--device=cpu", f"--state_dir={state_dir}"]
    server = LocalServer(BINARY, args).start()
    with remotehead.Client(server.target) as client:
        client.upload_head("kept", weight(), grad_dtype=torch.bfloat16)
        client.save_head_state("kept")
    assert server.stop() == 0
    server = LocalServer(BINARY, args).start()
    try:
        with remotehead.Client(server.target) as client:
            assert client.describe_head("kept").grad_dtype == torch.bfloat16
    finally:
        assert server.stop() == 0

    with LocalHeadGroup(BINARY, 2) as group:
        with remotehead.Client(group.target) as client:
            info = client.create_head("sharded", V, D, dtype=torch.bfloat16,
                                      grad_dtype=torch.bfloat16)
            assert info.group_size == 2 and info.grad_dtype == torch.bfloat16
            hidden, targets = batches()[0]
            client.forward_backward("sharded", hidden, targets, gradient_id=("g", 0, 0))
            dw, _, _ = client.fetch_gradients("sharded")
            assert dw.dtype == torch.bfloat16 and dw.shape == (V, D) and dw.abs().sum() > 0
