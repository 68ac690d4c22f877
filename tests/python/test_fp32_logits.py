"""fp32 logits from a bf16 head's weights (StepOptions.logits_dtype=torch.float32, the wire's
StepHeader.logits_dtype) through a real server process and a head group of 2: the fused
cross-entropy's loss, dX and dW and a Forward's per-token log-probs (what an RL trainer compares
with its rollouts') against float64 autograd on the same bf16 values, at fp32 accuracy where the
default (logits rounded to bf16) is measurably further off; the group the same as one server;
a dtype other than float32 refused with INVALID_ARGUMENT naming the field, nothing accumulated."""

import os
import pathlib

import pytest
import torch

import numerics
import remotehead
from remotehead.local_server import LocalHeadGroup

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
V, D, N = 3001, 64, 53


@pytest.fixture(scope="module")
def group_target():
    group = LocalHeadGroup(BINARY, size=2, args=("--device=cpu", "--torch_threads=1")).start()
    yield group.target
    codes = group.stop()
    assert codes == [0, 0], "".join(line for r in group.ranks for line in r.log)


def data():
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(V, D, generator=g) / D ** 0.5).to(torch.bfloat16)
    x = torch.randn(N, D, generator=g).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -100
    return w, x, t


def reference(w, x, t):
    """float64 autograd of the mean cross-entropy from the bf16 values (exact in float64), and
    the per-token log-probs of the targets."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    z = x64 @ w64.t()
    loss = torch.nn.functional.cross_entropy(z, t, ignore_index=-100)
    dx, dw = torch.autograd.grad(loss, (x64, w64))
    valid = t != -100
    logprobs = torch.where(valid, torch.log_softmax(z.detach(), -1).gather(
        1, t.clamp(min=0)[:, None])[:, 0], torch.zeros((), dtype=torch.float64))
    return loss.item(), dx, dw, logprobs


def step(client, x, t, tag, **options):
    """A fused mean cross-entropy (loss, dX, dW fetched from the server), then a Forward's
    per-token log-probs."""
    fused = client.forward_backward("head", x, t, gradient_id=(tag, 0, 0), **options)
    dw, _, _ = client.fetch_gradients("head")
    client.zero_gradients("head")
    logprobs = client.forward("head", x, t, function="token_logprobs", reduction="none",
                              **options).outputs
    return fused.loss, fused.grad_hidden, dw, logprobs


def test_fp32_logits_match_float64_where_bf16_logits_do_not(server_target, group_target):
    w, x, t = data()
    ref_loss, ref_dx, ref_dw, ref_logprobs = reference(w, x, t)
    results = {}
    with remotehead.Client(server_target) as single, remotehead.Client(group_target) as group:
        for name, client in (("single", single), ("group", group)):
            client.upload_head("head", w)
            try:
                results[name, "bf16"] = step(client, x, t, f"{name}-bf16")
                results[name, "fp32"] = step(client, x, t, f"{name}-fp32",
                                             logits_dtype=torch.float32)
            finally:
                client.drop_head("head")
    for name in ("single", "group"):
        loss, dx, dw, logprobs = results[name, "fp32"]
        bf16_loss, _, bf16_dw, bf16_logprobs = results[name, "bf16"]
        assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
        errors = {"loss": numerics.relative_error(loss, ref_loss),
                  "dW": numerics.relative_error(dw, ref_dw),
                  "log-probs": numerics.relative_error(logprobs, ref_logprobs)}
        bf16_errors = {"loss": numerics.relative_error(bf16_loss, ref_loss),
                       "dW": numerics.relative_error(bf16_dw, ref_dw),
                       "log-probs": numerics.relative_error(bf16_logprobs, ref_logprobs)}
        for what, error in errors.items():
            assert error <= 1e-5, (name, what, error)
            assert bf16_errors[what] >= 10 * error, (name, what, bf16_errors[what], error)
        # dX comes back in the head's dtype: one bf16 rounding of the fp32 result.
        assert numerics.relative_error(dx, ref_dx) <= 1 / 256, name
    # The group computes what one server computes.
    for what, a, b in zip(("loss", "dX", "dW", "log-probs"), results["group", "fp32"],
                          results["single", "fp32"]):
        bf16 = isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16
        assert numerics.relative_error(a, b) <= (1 / 128 if bf16 else 1e-5), what


def test_another_logits_dtype_is_refused_naming_the_field(server_target):
    w, x, t = data()
    with remotehead.Client(server_target) as client:
        client.upload_head("head", w)
        try:
            for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float64, "float64")):
                with pytest.raises(remotehead.InvalidArgumentError) as e:
                    client.forward_backward("head", x, t, gradient_id=("bad", 0, 0),
                                            logits_dtype=dtype)
                assert e.value.details == (
                    "logits_dtype: expected float32 (fp32 logits from the head's bfloat16 "
                    f"weights) or unset (logits in the head's dtype); got {name}")
                assert e.value.reason == "INVALID_FIELD"
                assert e.value.metadata["field"] == "logits_dtype"
            assert client.describe_head("head").accumulated_micro_batches == 0
        finally:
            client.drop_head("head")
