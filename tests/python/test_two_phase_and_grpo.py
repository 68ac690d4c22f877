"""Through the Python client, against PyTorch references written from their definitions (fp32,
relative 1e-5): the two-phase path (per-token log-probs now, the trainer's own objective's
dL/dy later, X kept on the server between the two) and the GRPO policy loss in one fused pass
(clipped ratio, KL to a reference, per-token weights: TRL's formula)."""

import time

import grpc
import pytest
import torch
import torch.nn.functional as F

import numerics
import remotehead

V, D = 200, 24


def close(actual, expected, rel=1e-5):
    return numerics.close(actual, expected, rel)


@pytest.fixture
def setup(server_target, request):
    torch.manual_seed(4)
    weight = torch.randn(V, D) / D**0.5
    client = remotehead.Client(server_target, chunk_bytes=1024)
    head_id = request.node.name
    client.upload_head(head_id, weight)
    yield client, head_id, weight
    client.drop_head(head_id)
    client.close()


def test_two_phase_log_probs_then_the_trainers_objective(setup):
    client, head_id, weight = setup
    hidden = torch.randn(2, 15, D, requires_grad=True)
    labels = torch.randint(0, V, (2, 15))
    advantages = torch.randn(2, 15)

    w = weight.clone().requires_grad_()
    local_hidden = hidden.detach().clone().requires_grad_()
    local_logp = torch.log_softmax(F.linear(local_hidden, w), -1).gather(-1, labels[..., None])[..., 0]
    (-(local_logp * advantages).mean()).backward()

    head = remotehead.RemoteHead(client, head_id)
    logp = head.token_outputs(hidden, labels, function="token_logprobs")
    assert logp.shape == labels.shape
    assert close(logp.detach(), local_logp.detach())
    (-(logp * advantages).mean()).backward()  # dL/dy goes to the server, which kept X
    assert close(hidden.grad, local_hidden.grad)
    dw, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 1
    assert close(dw, w.grad)


def test_grpo_policy_loss_in_one_fused_pass(setup):
    client, head_id, weight = setup
    n = 40
    hidden = torch.randn(n, D, requires_grad=True)
    labels = torch.randint(0, V, (n,))
    mask = (torch.rand(n) > 0.2).float()  # completion tokens (per-token weights)
    with torch.no_grad():
        logp_now = torch.log_softmax(F.linear(hidden, weight), -1).gather(1, labels[:, None])[:, 0]
    old = logp_now + 0.1 * torch.randn(n)  # the policy that sampled
    ref = logp_now + 0.1 * torch.randn(n)  # the reference model
    advantages = torch.randn(n)
    beta, eps_low, eps_high = 0.04, 0.2, 0.28

    # TRL's GRPO per-token loss, then its "bnpo" normalisation: Σ mask·loss / Σ mask.
    w = weight.clone().requires_grad_()
    local_hidden = hidden.detach().clone().requires_grad_()
    logp = torch.log_softmax(F.linear(local_hidden, w), -1).gather(1, labels[:, None])[:, 0]
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * advantages,
                           torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    local = (per_token * mask).sum() / mask.sum()
    local.backward()

    head = remotehead.RemoteHead(client, head_id)
    loss = head.loss(hidden, labels, function="grpo", reduction="weighted_sum", weights=mask,
                     normalizer=float(mask.sum()),
                     params={"beta": beta, "epsilon_low": eps_low, "epsilon_high": eps_high},
                     aux={"advantages": advantages, "old_logprobs": old, "ref_logprobs": ref})
    loss.backward()
    assert abs(loss.item() - local.item()) <= 1e-5 * abs(local.item())
    assert close(hidden.grad, local_hidden.grad)
    dw, _, _ = client.fetch_gradients(head_id)
    assert close(dw, w.grad)


def local_reduced_loss(hidden, w, labels, reduction, weights):
    """A scalar-reduction cross-entropy written from its definition (fp32 autograd)."""
    per_token = F.cross_entropy(F.linear(hidden, w), labels, reduction="none")  # 0 where -100
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / (labels != -100).sum()
    return (per_token * weights).sum()


@pytest.mark.parametrize("by_handle", [False, True], ids=["rows_resent", "by_inputs_handle"])
@pytest.mark.parametrize("reduction", ["sum", "mean", "weighted_sum"])
def test_scalar_backward_scales_dx_and_dw_by_dl_dloss(setup, reduction, by_handle):
    """Regression: a scalar dL/dloss of 0.5 used to travel as a row tensor the server ignores
    (dX and dW came back as for 1); it travels as the header's upstream_scale."""
    client, head_id, weight = setup
    torch.manual_seed(5)
    n, g = 33, 0.5
    hidden = torch.randn(n, D)
    labels = torch.randint(0, V, (n,))
    labels[::4] = -100
    weights = torch.rand(n) if reduction == "weighted_sum" else None

    w = weight.clone().requires_grad_()
    local_hidden = hidden.clone().requires_grad_()
    (g * local_reduced_loss(local_hidden, w, labels, reduction, weights)).backward()

    forward = client.forward(head_id, hidden, labels, reduction=reduction, weights=weights,
                             retain_inputs_seconds=60.0 if by_handle else 0.0)
    expected_loss = local_reduced_loss(hidden, weight, labels, reduction, weights).item()
    assert abs(forward.loss - expected_loss) <= 1e-5 * abs(expected_loss)
    assert bool(forward.summary.inputs_handle) == by_handle
    options = remotehead.StepOptions(reduction=reduction, gradient_id=("scalar", 0, 0),
                                     inputs_handle=forward.summary.inputs_handle)
    # dL/dloss as a Python number by handle, as a 0-d tensor otherwise: both are one value.
    grad = g if by_handle else torch.tensor(g)
    result = client.backward(head_id, hidden, labels, grad, options, weights=weights)
    assert close(result.grad_hidden, local_hidden.grad)
    dw, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 1
    assert close(dw, w.grad)


def test_scalar_backward_refuses_a_per_token_or_missing_grad_output(setup):
    client, head_id, _ = setup
    hidden = torch.randn(6, D)
    labels = torch.randint(0, V, (6,))
    cases = [(torch.ones(6), "got [6]"), (torch.ones(1, 2), "got [1, 2]"),
             (torch.tensor(1), "got []"), (None, "got none")]
    for grad_output, got in cases:
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.backward(head_id, hidden, labels, grad_output, reduction="sum",
                            gradient_id=("refused", 0, 0))
        assert refused.value.details == ("grad_output: expected one floating value "
                                         f"(dL/d(loss)) for a scalar reduction; {got}")
    with pytest.raises(remotehead.InvalidArgumentError) as refused:
        client.backward(head_id, hidden, labels, torch.tensor(0.5), reduction="none",
                        gradient_id=("refused", 0, 0))
    assert refused.value.details == "grad_output: expected shape [6]; got []"
    _, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 0  # nothing reached the server


@pytest.mark.parametrize("retain_seconds", [0.0, 0.05], ids=["rows_resent", "handle_expired"])
def test_two_phase_backward_after_an_optimizer_step_fails_instead_of_mixing_versions(
        setup, retain_seconds):
    """The Backward carries the Forward's weight version (expected_weight_version), on the path
    that re-sends X too: without a handle at all, and after the handle expired (NOT_FOUND, then
    X again). A handle alone would be refused by the server; these two paths would not."""
    client, head_id, _ = setup
    head = remotehead.RemoteHead(client, head_id)
    head.retain_seconds = retain_seconds
    hidden = torch.randn(2, 7, D, requires_grad=True)
    labels = torch.randint(0, V, (2, 7))
    logp = head.token_outputs(hidden, labels)
    assert head.last_result.summary.weight_version == 0
    client.optimizer_step(head_id, sgd=dict(lr=0.1))
    assert client.describe_head(head_id).weight_version == 1
    time.sleep(2 * retain_seconds)  # past the handle's lifetime
    with pytest.raises(remotehead.RemoteheadError) as refused:
        logp.sum().backward()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details == ("header.expected_weight_version: expected the head's "
                                     "current version 1; got 0")
    _, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 0
