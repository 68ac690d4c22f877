"""The server's --fused_blocks (the engine's fused kernel, its CPU twin on this machine) through a
real server process: cross_entropy with label smoothing, z-loss and a softcap, token_logprobs and
entropy, on bf16 and fp32 heads — the fused step's loss, dX and dW against float64 autograd on the
same head values, at the accuracy the same step has without the flag (the shared server); the
chunk is sized without a separate fp32 gradient buffer, so a bf16 head's budget buys more rows;
and a function the kernel does not cover (mse_onehot) computes as before."""

import os
import pathlib

import pytest
import torch

import numerics
import remotehead
from remotehead.local_server import LocalServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                        str(ROOT / "build" / "server" / "remotehead-server"))
V, D, N = 3001, 64, 200
BUDGET = 1 << 20  # forces chunking at this N on both servers
CASES = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 15.0},
    "token_logprobs": {"temperature": 0.7},
    "entropy": {"softcap": 15.0},
    "mse_onehot": {},
}


@pytest.fixture(scope="module")
def fused_target():
    with LocalServer(BINARY, ["--device=cpu", "--torch_threads=1", "--fused_blocks"]) as server:
        yield server.target


def data(dtype):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(V, D, generator=g) * 2 / D ** 0.5).to(dtype)
    x = torch.randn(N, D, generator=g).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[::9] = -100
    return w, x, t


def reference(function, params, w, x, t):
    """float64 autograd of the function's mean over the valid tokens, from the head's values and
    its logits rounded to the head's dtype (what its GEMM writes)."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    z = x64 @ w64.t()
    z = z + (z.detach().to(w.dtype).double() - z.detach())  # the GEMM's rounding, no gradient
    if params.get("softcap"):
        z = torch.tanh(z / params["softcap"]) * params["softcap"]
    z = z / params.get("temperature", 1.0)
    valid = t != -100
    safe = t.clamp(min=0)
    logp = torch.log_softmax(z, -1)
    if function == "cross_entropy":
        eps, zl = params["label_smoothing"], params["z_loss"]
        nll = -logp.gather(1, safe[:, None])[:, 0]
        lse = torch.logsumexp(z, -1)
        per_token = (1 - eps) * nll - eps * logp.mean(-1) + zl * lse ** 2
    elif function == "token_logprobs":
        per_token = logp.gather(1, safe[:, None])[:, 0]
    elif function == "entropy":
        per_token = -(logp.exp() * logp).sum(-1)
    else:  # mse_onehot
        one_hot = torch.nn.functional.one_hot(safe, V).double()
        per_token = ((z - one_hot) ** 2).mean(-1)
    loss = per_token[valid].mean()
    dx, dw = torch.autograd.grad(loss, (x64, w64))
    return loss.item(), dx, dw


def run(client, function, params, w, x, t, tag):
    client.upload_head("head", w)
    try:
        r = client.forward_backward("head", x, t, function=function, params=params,
                                    memory_budget_bytes=BUDGET, gradient_id=(tag, 0, 0))
        dw, _, _ = client.fetch_gradients("head")
        return r.loss, r.grad_hidden, dw, r.summary.chunk_rows
    finally:
        client.drop_head("head")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("function", list(CASES))
def test_fused_blocks_match_float64_as_the_autograd_path_does(server_target, fused_target,
                                                              function, dtype):
    params = CASES[function]
    w, x, t = data(dtype)
    ref_loss, ref_dx, ref_dw = reference(function, params, w, x, t)
    with remotehead.Client(fused_target) as fused, remotehead.Client(server_target) as plain:
        f_loss, f_dx, f_dw, f_rows = run(fused, function, params, w, x, t, f"fused-{function}")
        p_loss, p_dx, p_dw, p_rows = run(plain, function, params, w, x, t, f"plain-{function}")
    # Tolerances relative to the reference's magnitude: fp32 near-exact; bf16 within a few of its
    # ulps, where dX is rounded to bf16 and the fused dW reads dz rounded to bf16.
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for name, got, plain_got, want in (("loss", torch.tensor(f_loss), torch.tensor(p_loss),
                                        torch.tensor(ref_loss)),
                                       ("dX", f_dx, p_dx, ref_dx), ("dW", f_dw, p_dw, ref_dw)):
        assert numerics.relative_error(plain_got, want, 1e-3) <= tol, (name, "autograd path")
        assert numerics.relative_error(got, want, 1e-3) <= tol, (name, "fused blocks")
    if function == "mse_onehot":
        assert f_rows == p_rows, "a function the kernel does not cover is planned as before"
    elif dtype == torch.bfloat16:
        # No fp32 gradient buffer and no block: about 3× the rows of a bf16 head's chunk.
        assert f_rows >= 2 * p_rows, (f_rows, p_rows)
    assert f_rows < N and p_rows < N, "the budget must force chunking"
