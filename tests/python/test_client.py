"""The Python client against the real server binary: the fused loss, hidden.grad and the
server's dW equal a local PyTorch head (plain F.linear + the loss, autograd), and server errors
surface as RemoteheadError with the gRPC status and the server's message. Every other function
the server lists is checked against its reference by tests/python/test_functions.py.

Tolerances: fp32 on both sides, relative 1e-5 of each quantity's magnitude (the server sums
chunk by chunk in another order).
"""

import grpc
import pytest
import torch
import torch.nn.functional as F

import numerics
import remotehead

V, D, N = 300, 32, 57


def close(actual, expected, rel=1e-5):
    return numerics.close(actual, expected, rel)


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target, chunk_bytes=2048) as c:  # many messages per step
        yield c


@pytest.fixture
def head_weight(client, request):
    torch.manual_seed(0)
    weight = torch.randn(V, D) / D**0.5
    head_id = request.node.name
    client.upload_head(head_id, weight)
    yield head_id, weight
    client.drop_head(head_id)


def test_fused_loss_hidden_grad_and_dw_match_a_local_head(client, head_weight):
    head_id, weight = head_weight
    torch.manual_seed(1)
    hidden = torch.randn(3, 19, D, requires_grad=True)
    labels = torch.randint(0, V, (3, 19))
    labels[0, :4] = -100  # ignored positions

    w = weight.clone().requires_grad_()
    local_hidden = hidden.detach().clone().requires_grad_()
    local = F.cross_entropy(F.linear(local_hidden, w).reshape(-1, V), labels.reshape(-1))
    local.backward()

    head = remotehead.RemoteHead(client, head_id)
    loss = head.loss(hidden, labels)
    loss.backward()
    assert abs(loss.item() - local.item()) <= 1e-5 * abs(local.item())
    assert close(hidden.grad, local_hidden.grad)
    dw, db, info = client.fetch_gradients(head_id)
    assert db is None and info.accumulated_micro_batches == 1
    assert close(dw, w.grad)


def test_gradient_accumulation_with_a_global_normalizer(client, head_weight):
    head_id, weight = head_weight
    torch.manual_seed(2)
    hidden = torch.randn(2, 20, D)
    labels = torch.randint(0, V, (2, 20))
    w = weight.clone().requires_grad_()
    F.cross_entropy(F.linear(hidden, w).reshape(-1, V), labels.reshape(-1)).backward()

    # Two micro-batches, each normalised by the whole batch's token count (HF's
    # num_items_in_batch): their gradients add up to the one-batch gradient.
    head = remotehead.RemoteHead(client, head_id, reduction="sum", normalizer=labels.numel())
    for i in range(2):
        head.loss(hidden[i].clone().requires_grad_(), labels[i]).backward()
    dw, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 2
    assert close(dw, w.grad)


def test_per_token_forward_gives_log_probs(client, head_weight):
    head_id, weight = head_weight
    hidden = torch.randn(N, D)
    labels = torch.randint(0, V, (N,))
    result = client.forward(head_id, hidden, labels, function="token_logprobs")
    expected = torch.log_softmax(F.linear(hidden, weight), dim=-1).gather(1, labels[:, None])[:, 0]
    assert close(result.outputs, expected)


def test_server_errors_surface_with_status_and_message(client, head_weight):
    head_id, _ = head_weight
    with pytest.raises(remotehead.RemoteheadError) as missing:
        client.forward_backward("no-such-head", torch.randn(4, D), torch.zeros(4, dtype=torch.long),
                                gradient_id=("t", 0, 0))
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert '"no-such-head"' in missing.value.details

    with pytest.raises(remotehead.RemoteheadError) as bad_label:
        client.forward_backward(head_id, torch.randn(4, D), torch.full((4,), V),
                                gradient_id=("t", 0, 0))
    assert bad_label.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_label.value.details == (
        f"targets[0]: expected a token id in [0, {V}) or ignore_index (-100); got {V}")
    _, _, info = client.fetch_gradients(head_id)
    assert info.accumulated_micro_batches == 0  # nothing was added


def test_server_side_optimizer_step_updates_the_weights(client, head_weight):
    head_id, weight = head_weight
    hidden = torch.randn(N, D, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    head = remotehead.RemoteHead(client, head_id)
    head.loss(hidden, labels).backward()
    dw, _, _ = client.fetch_gradients(head_id)
    head.optimizer_step(sgd=dict(lr=0.5))
    info = client.describe_head(head_id)
    assert info.weight_version == 1 and info.accumulated_micro_batches == 0
    # The next loss is computed with W − 0.5·dW.
    probe = torch.randn(8, D)
    probe_labels = torch.randint(0, V, (8,))
    with torch.no_grad():
        expected = F.cross_entropy(F.linear(probe, weight - 0.5 * dw), probe_labels)
        got = head.loss(probe, probe_labels)
    assert abs(got.item() - expected.item()) <= 1e-5 * abs(expected.item())


def test_a_zero_learning_rate_is_a_step_that_changes_no_weight_as_in_torch(client, head_weight):
    """A linear schedule past its end (a Trainer resumed there) asks for lr = 0: torch.optim's
    AdamW takes that step — its moments and step count advance, the parameters stay — and so does
    the server's; the next step (lr > 0) then equals torch's after the same two steps."""
    head_id, weight = head_weight
    head = remotehead.RemoteHead(client, head_id)
    reference = weight.clone().requires_grad_(True)
    adamw = torch.optim.AdamW([reference], lr=0.0, weight_decay=0.1)
    for lr in (0.0, 1e-2):
        hidden = torch.randn(N, D, requires_grad=True)
        labels = torch.randint(0, V, (N,))
        head.loss(hidden, labels).backward()
        dw, _, _ = client.fetch_gradients(head_id)
        head.optimizer_step(adamw=dict(lr=lr, weight_decay=0.1))
        adamw.param_groups[0]["lr"] = lr
        reference.grad = dw
        adamw.step()
        got, _ = client.export_weights(head_id)
        if lr == 0.0:
            assert torch.equal(got, weight), "lr 0 changed the weights"
        assert close(got, reference.detach()), lr
    assert client.describe_head(head_id).weight_version == 2
    with pytest.raises(remotehead.RemoteheadError) as negative:
        head.optimizer_step(adamw=dict(lr=-1e-3))
    assert negative.value.details == "adamw.lr: expected a finite value in [0, inf); got -0.001"
