"""Through the Python client, against PyTorch references written from their definitions (fp32,
relative 1e-5): the two-phase path (per-token log-probs now, the trainer's own objective's
dL/dy later, X kept on the server between the two) and the GRPO policy loss in one fused pass
(clipped ratio, KL to a reference, per-token weights: TRL's formula)."""

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
