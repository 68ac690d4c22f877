"""The RL policy losses (grpo, cispo, sapo, vespo: TRL's loss types) on real server processes,
against the float64 references of references.py (TRL's _compute_loss written one sequence at a
time), fp32 heads, relative 1e-5:

- row-coupled calls (sequence-level ratios, vespo, the off-policy mask) sent as many small
  messages give the results of one message: the server waits for the call's last row and
  computes it in one batch, in two passes;
- on a head group of 2 ranks (the vocabulary sharded), every variant equals the reference;
- one importance-sampling ratio per sequence (importance_sampling_per_sequence = 1, TRL's (B, 1)
  ratio repeated at its tokens): vespo counts its log once per sequence;
- what is refused, with the field, expected and actual: vespo without sequence_ids, a switch
  that is not 0 or 1, a per-sequence ratio that differs within a sequence.
"""

import pytest
import torch

import numerics
import references
import remotehead
from conftest import ROOT
from remotehead.local_server import LocalHeadGroup

V, D, N = 300, 24, 48
BINARY = str(ROOT / "build" / "server" / "remotehead-server")

# (server function, params beyond the defaults): token level and row-coupled.
VARIANTS = [
    ("grpo", {"beta": 0.04, "bias_correction_kl": 1.0, "delta": 1.25}),
    ("grpo", {"sequence_level": 1.0, "beta": 0.04}),
    ("cispo", {"epsilon_high": 1.1, "off_policy_mask": 1.0, "off_policy_threshold": 0.02}),
    ("sapo", {"sequence_level": 1.0, "temperature_pos": 0.8}),
    ("vespo", {"beta": 0.04, "bias_correction_kl": 1.0}),
    # One importance-sampling ratio per sequence (TRL's (B, 1)), repeated at its tokens: vespo
    # counts its log once per sequence, grpo multiplies each token by it.
    ("vespo", {"importance_sampling_per_sequence": 1.0}),
    ("grpo", {"importance_sampling_per_sequence": 1.0, "sequence_level": 1.0}),
]


def case(listing, function, given, weight, seed):
    """Rows, targets (every 7th ignored), every aux input of the function and the resolved
    params; the reference's loss, dX and dW (weighted_sum over sequence-mean weights)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::7] = -100
    params = {p.name: p.default for p in listing[function].params if not p.common}
    params.update(given)
    common = {p.name: p.default for p in listing[function].params if p.common}
    with torch.no_grad():
        z = references.logits(hidden, weight, {**params, **common})
        logp = torch.log_softmax(z, 1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
    fn = listing[function]
    aux = {name: references.AUX_INPUTS[name](logp, g) for name in
           fn.required_aux + fn.optional_aux}
    if params.get("importance_sampling_per_sequence"):  # one ratio per sequence, at its tokens
        ids = aux["sequence_ids"].long()
        aux["importance_sampling_ratio"] = torch.exp(
            0.5 * torch.randn(int(ids.max()) + 1, generator=g, dtype=logp.dtype))[ids]
    aux = {k: t.float() if t.dtype.is_floating_point else t for k, t in aux.items()}
    weights = torch.rand(N, generator=g) + 0.5
    x = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    y = references.per_token(function, x, w, targets, aux, {**params, **common})
    loss = (y * weights.double()).sum() / 10.0
    loss.backward()
    # The terms' signs differ (advantages of both signs, the KL): fp32's error is relative to
    # the sum of their magnitudes, which can be many times the loss itself.
    magnitude = (y.detach().abs() * weights.double()).sum().item() / 10.0
    return dict(hidden=hidden, targets=targets, aux=aux, params=params, weights=weights,
                loss=loss.item(), magnitude=magnitude, dx=x.grad, dw=w.grad)


def check(client, head_id, function, c, step):
    result = client.forward_backward(head_id, c["hidden"], c["targets"], function=function,
                                     params=c["params"], aux=c["aux"], weights=c["weights"],
                                     reduction="weighted_sum", normalizer=10.0,
                                     gradient_id=("policy", step, 0))
    dw, _, _ = client.fetch_gradients(head_id)
    client.zero_gradients(head_id)
    assert abs(result.loss - c["loss"]) <= 1e-5 * c["magnitude"], (function, c["params"])
    assert numerics.close(result.grad_hidden, c["dx"], 1e-5), (function, c["params"])
    assert numerics.close(dw, c["dw"], 1e-5), (function, c["params"])
    return result


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(11)
    return torch.randn(V, D) / D ** 0.5


def test_coupled_calls_in_many_messages_equal_the_reference(server_target, weight):
    # 1 KiB messages: a call of 48 rows arrives in many; the coupled ones wait for the last.
    with remotehead.Client(server_target, chunk_bytes=1024) as client:
        client.upload_head("policy-messages", weight)
        listing = client.functions()
        for step, (function, given) in enumerate(VARIANTS):
            check(client, "policy-messages", function,
                  case(listing, function, given, weight, seed=step), step)
        client.drop_head("policy-messages")


def test_on_a_head_group_every_variant_equals_the_reference(weight):
    group = LocalHeadGroup(BINARY, size=2, args=("--device=cpu", "--torch_threads=1")).start()
    try:
        with remotehead.Client(group.target) as client:
            client.upload_head("policy-group", weight)
            listing = client.functions()
            for step, (function, given) in enumerate(VARIANTS):
                check(client, "policy-group", function,
                      case(listing, function, given, weight, seed=10 + step), step)
            client.drop_head("policy-group")
    finally:
        assert group.stop() == [0, 0], "".join(group.ranks[0].log + group.ranks[1].log)


def test_refusals_name_the_field(server_target, weight):
    with remotehead.Client(server_target) as client:
        client.upload_head("policy-refused", weight)
        listing = client.functions()
        c = case(listing, "vespo", {}, weight, seed=3)
        aux = {k: t for k, t in c["aux"].items() if k != "sequence_ids"}
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.forward_backward("policy-refused", c["hidden"], c["targets"], function="vespo",
                                    aux=aux, gradient_id=("refused", 0, 0))
        assert refused.value.details == ('aux["sequence_ids"]: function vespo needs this '
                                         'per-token input; got none')
        c = case(listing, "grpo", {}, weight, seed=4)
        aux = {k: t for k, t in c["aux"].items() if k != "sequence_ids"}
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.forward_backward("policy-refused", c["hidden"], c["targets"], function="grpo",
                                    aux=aux, params={"sequence_level": 1.0},
                                    gradient_id=("refused", 0, 1))
        assert refused.value.details.startswith(
            'aux["sequence_ids"]: expected the sequence of every token')
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.forward_backward("policy-refused", c["hidden"], c["targets"], function="grpo",
                                    aux=c["aux"], params={"sequence_level": 0.5},
                                    gradient_id=("refused", 0, 2))
        assert refused.value.details == 'params["sequence_level"]: expected 0 or 1; got 0.5'
        # A per-sequence ratio must be one value per sequence: a token of sequence 2 differs.
        ids = torch.arange(N) % 4
        ratio = torch.ones(N)
        ratio[6] = 0.5
        aux = {**c["aux"], "sequence_ids": ids, "importance_sampling_ratio": ratio}
        with pytest.raises(remotehead.InvalidArgumentError) as refused:
            client.forward_backward("policy-refused", c["hidden"], c["targets"], function="vespo",
                                    aux=aux, params={"importance_sampling_per_sequence": 1.0},
                                    gradient_id=("refused", 0, 3))
        assert refused.value.details == (
            'aux["importance_sampling_ratio"]: expected one ratio per sequence with '
            'params["importance_sampling_per_sequence"] = 1 (the same at every token of a '
            'sequence); got values from 0.5 to 1 in sequence 2')
        assert refused.value.metadata["field"] == 'aux["importance_sampling_ratio"]'
        assert client.describe_head("policy-refused").accumulated_micro_batches == 0
        client.drop_head("policy-refused")
