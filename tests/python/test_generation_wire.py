"""The generation outputs of Forward ("logits", "sample") through a real server: rows of logits
streamed in several messages in the requested dtype equal X·Wᵀ (fp32 rounding), drawn tokens come
with their log-probs, and every misuse is refused with INVALID_ARGUMENT naming the field, the
expected and the actual value — with nothing accumulated on the head."""

import grpc
import pytest
import torch

import remotehead

VOCAB, HIDDEN = 5000, 24


@pytest.fixture
def head(server_target):
    with remotehead.Client(server_target) as client:
        weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.1
        client.upload_head("gen-wire", weight)
        yield client, weight
        client.drop_head("gen-wire")


def test_rows_of_logits_stream_in_the_requested_dtype(head):
    client, weight = head
    hidden = torch.randn(2, 40, HIDDEN, generator=torch.Generator().manual_seed(4))
    expected = hidden @ weight.T
    # 80 rows × 5000 float64 values = 3.2 MB: more than one response message.
    got = client.logits("gen-wire", hidden, dtype=torch.float64)
    assert got.shape == (2, 40, VOCAB) and got.dtype == torch.float64
    torch.testing.assert_close(got, expected.double(), rtol=1e-5, atol=1e-5)
    half = client.logits("gen-wire", hidden, dtype=torch.bfloat16, params={"temperature": 2.0})
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), expected / 2, rtol=1e-2, atol=1e-2)


def test_sampled_tokens_come_with_their_log_probs(head):
    client, weight = head
    hidden = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(5))
    z = hidden @ weight.T
    ids, logp = client.sample("gen-wire", hidden, greedy=True)
    assert torch.equal(ids, z.argmax(-1))
    torch.testing.assert_close(logp, z.log_softmax(-1).gather(1, ids[:, None])[:, 0])
    a, _ = client.sample("gen-wire", hidden, top_k=10, seed=42)
    b, _ = client.sample("gen-wire", hidden, top_k=10, seed=42)
    assert torch.equal(a, b)
    assert (z.topk(10, dim=-1).indices == a[:, None]).any(-1).all()


def refused(call, message):
    with pytest.raises(remotehead.RemoteheadError) as e:
        call()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details == message, e.value.details


def test_misuse_is_refused_with_the_field_expected_and_actual(head):
    client, _ = head
    hidden, targets = torch.randn(3, HIDDEN), torch.tensor([1, 2, 3])
    refused(lambda: client.forward("gen-wire", hidden, targets, function="logits"),
            "targets: function logits takes none (it is computed from hidden alone); got [3]")
    refused(lambda: client.forward("gen-wire", hidden, None, function="sample",
                                   reduction="sum"),
            'function.reduction: "sample" returns rows, not a loss: expected none; got sum')
    refused(lambda: client.forward_backward("gen-wire", hidden, targets, function="logits",
                                            reduction="sum", gradient_id=("t", 0, 0)),
            'function: "logits" is a generation output with no gradient: expected a Forward; '
            'got ForwardBackward')
    refused(lambda: client.forward("gen-wire", hidden, targets, function="token_logprobs",
                                   output_dtype=torch.float16),
            'header.output_dtype: expected unset (only function "logits" returns rows in a '
            'chosen dtype); got DTYPE_FLOAT16 with function "token_logprobs"')
    refused(lambda: client.logits("gen-wire", hidden, dtype=torch.int32),
            "header.output_dtype: expected a floating dtype; got Int")
    refused(lambda: client.sample("gen-wire", hidden, top_p=0.0),
            'params["top_p"]: expected a finite value in [1e-09, 1]; got 0')
    refused(lambda: client.sample("gen-wire", hidden, seed=-1),
            'params["seed"]: expected a finite value in [0, 9.0072e+15]; got -1')
    assert client.describe_head("gen-wire").accumulated_micro_batches == 0
