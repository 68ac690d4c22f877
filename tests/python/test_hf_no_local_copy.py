"""A trainer with no copy of the head (issue: zero head memory on the trainer).

offload_lm_head in server mode releases the local W; then, against a tiny Llama built from a
config (fixed seeds) and a real server:
- the released weight keeps its shape, dtype and place in state_dict() and costs no memory
  (measured: the process's resident memory drops by W's size; W is larger than glibc's largest
  mmap threshold, so its pages go back to the system when freed); it is no longer one of the
  module's parameters (what FSDP2 shards, DDP broadcasts and optimizers take), and
  model.to(dtype / device) converts its one element;
- generate() with the head on the server gives the same tokens as the same model with its own
  lm_head: greedy, and seeded sampling (top-k, top-p, temperature) with the same generator; each
  decode step asks the server for one row of logits per sequence (logits_to_keep);
- remotehead.hf.generate draws the tokens on the server: greedy equals local greedy; seeded
  sampling equals torch.multinomial with the documented generators, with log-probs within fp32
  rounding of the local log-softmax;
- evaluation with labels (no gradients) is a server Forward: the same loss as a local head;
- save_pretrained writes the server's current head (streamed): from_pretrained of the result
  holds bit-exactly the server's W and the body's weights; offloading the loaded model uploads
  that W and frees the copy;
- loading a state dict into the offloaded model (Trainer's resume) sets the server's head,
  strictly (its own state dict and a full one load with strict=True); a head of another shape
  is refused as a parameter's would be, nothing uploaded.
Tolerances: logits are compared at fp32 rounding (relative 1e-5); tokens exactly.
"""

import copy
import os

import pytest
import torch
import transformers

import remotehead
import remotehead.hf

VOCAB = 257


def tiny_llama(vocab=VOCAB, hidden=32):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float().eval()


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


class RowLog:
    """Records the rows of every logits request a client makes."""

    def __init__(self, client):
        self.rows = []
        original = client.logits

        def logits(head_id, hidden, **kwargs):
            self.rows.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
            return original(head_id, hidden, **kwargs)

        client.logits = logits


def offloaded(client, head_id, model=None):
    local = model if model is not None else tiny_llama()
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, head_id)
    return local, remote, head


def prompts():
    return torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4))


def test_released_parameter_keeps_its_place_and_costs_no_memory(client):
    def resident_bytes():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    # W = 40000 × 320 fp32 = 51 MB: above glibc's largest mmap threshold (32 MiB).
    model = tiny_llama(vocab=40000, hidden=320)
    weight = model.lm_head.weight
    w_bytes = weight.numel() * weight.element_size()
    # Uploaded first (the upload's own buffers come and go), then released: what that frees.
    head = remotehead.hf.offload_lm_head(model, client, "no-copy-memory", keep_local_copy=True)
    assert head.has_local_copy
    before = resident_bytes()
    head.release_local_copy()
    freed = before - resident_bytes()
    assert not head.has_local_copy
    assert model.lm_head.weight is weight  # the same object, the module's attribute
    assert all(p is not weight for p in model.parameters())  # but no parameter (FSDP2)
    assert weight.shape == (40000, 320) and weight.dtype == torch.float32
    assert model.state_dict()["lm_head.weight"].shape == (40000, 320)
    assert weight.untyped_storage().nbytes() == weight.element_size()
    assert freed >= 0.9 * w_bytes, f"freed {freed} bytes of W's {w_bytes}"
    client.drop_head("no-copy-memory")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device on this machine (CUDA half skipped)")
def test_released_parameter_costs_no_cuda_memory(client):
    model = tiny_llama(vocab=4096, hidden=256).cuda()
    w_bytes = model.lm_head.weight.numel() * 4
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    remotehead.hf.offload_lm_head(model, client, "no-copy-cuda")
    assert before - torch.cuda.memory_allocated() >= w_bytes
    client.drop_head("no-copy-cuda")


def test_tied_embeddings_keep_the_matrix_and_say_so(client):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    with pytest.warns(UserWarning, match="tied to the input embeddings"):
        head = remotehead.hf.offload_lm_head(model, client, "no-copy-tied", gradients="local",
                                             keep_local_copy=False)
    assert head.has_local_copy
    assert model.lm_head.weight.untyped_storage().nbytes() == model.lm_head.weight.nbytes
    client.drop_head("no-copy-tied")


def test_greedy_generation_matches_the_local_head(client):
    local, remote, _ = offloaded(client, "no-copy-greedy")
    log = RowLog(client)
    ids = prompts()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = local.generate(ids, **kwargs)
    got = remote.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    # Prefill: the last position of each prompt only; then one row per sequence and step.
    assert log.rows == [ids.shape[0]] * 6
    client.drop_head("no-copy-greedy")


def test_seeded_sampling_matches_the_local_head(client):
    local, remote, _ = offloaded(client, "no-copy-sample")
    ids = prompts()
    kwargs = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=50, top_p=0.9,
                  pad_token_id=0)
    torch.manual_seed(123)
    expected = local.generate(ids, **kwargs)
    torch.manual_seed(123)
    got = remote.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    client.drop_head("no-copy-sample")


def test_forward_without_labels_returns_the_server_logits(client):
    local, remote, _ = offloaded(client, "no-copy-logits")
    ids = prompts()
    with torch.no_grad():
        expected = local(ids).logits
        got = remote(ids).logits
        last = remote(ids, logits_to_keep=1).logits
    assert got.shape == expected.shape == (3, 5, VOCAB)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, expected[:, -1:], rtol=1e-5, atol=1e-5)
    # No gradient can flow through server logits: refused, not silently detached.
    with pytest.raises(RuntimeError, match="no gradient"):
        remote(ids)
    client.drop_head("no-copy-logits")


def test_evaluation_loss_is_a_server_forward(client):
    local, remote, _ = offloaded(client, "no-copy-eval")
    ids = prompts()
    with torch.no_grad():
        expected = local(ids, labels=ids).loss
        out = remote(ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    assert client.describe_head("no-copy-eval").accumulated_micro_batches == 0
    client.drop_head("no-copy-eval")


def local_pipeline_tokens(model, ids, steps, seed, temperature, top_k, top_p, greedy):
    """The documented server-side sampling, reproduced with the local head: HF's warpers then
    torch.multinomial with a generator seeded seed + t·B + r per step t and row r."""
    warpers = transformers.LogitsProcessorList()
    if not greedy:
        warpers.append(transformers.TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(transformers.TopKLogitsWarper(top_k))
        if top_p < 1:
            warpers.append(transformers.TopPLogitsWarper(top_p))
    sequences, logprobs = ids, []
    for t in range(steps):
        with torch.no_grad():
            z = model(sequences).logits[:, -1, :].float()
        logp = (z / temperature).log_softmax(-1)  # greedy too: under softmax(z / T)
        if greedy:
            tokens = z.argmax(-1)
        else:
            probs = warpers(sequences, z.clone()).softmax(-1)
            tokens = torch.stack([
                torch.multinomial(probs[r], 1, generator=torch.Generator().manual_seed(
                    seed + t * ids.shape[0] + r))[0] for r in range(ids.shape[0])])
        logprobs.append(logp.gather(1, tokens[:, None])[:, 0])
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
    return sequences, torch.stack(logprobs, dim=1)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_tokens_drawn_on_the_server_match_the_documented_pipeline(client, greedy):
    local, remote, head = offloaded(client, f"no-copy-draw-{greedy}")
    ids = prompts()
    options = dict(temperature=0.7, top_k=40, top_p=0.85, seed=1234)
    out = remotehead.hf.generate(remote, head, ids, max_new_tokens=6, greedy=greedy,
                                 eos_token_id=[], **options)
    expected, expected_logp = local_pipeline_tokens(local, ids, 6, greedy=greedy, **options)
    assert torch.equal(out.sequences, expected)
    torch.testing.assert_close(out.logprobs, expected_logp, rtol=1e-5, atol=1e-5)
    if greedy:
        hf = local.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out.sequences, hf)
    # The same seed draws the same tokens again; another seed other ones.
    again = remotehead.hf.generate(remote, head, ids, max_new_tokens=6, greedy=greedy,
                                   eos_token_id=[], **options)
    assert torch.equal(again.sequences, out.sequences)
    client.drop_head(f"no-copy-draw-{greedy}")


def test_save_and_load_round_trip_is_bit_exact(client, tmp_path):
    _, remote, head = offloaded(client, "no-copy-save")
    # Move the server's head away from the local initial weights.
    ids = prompts()
    remote(ids, labels=ids).loss.backward()
    head.optimizer_step(adamw=dict(lr=1e-2, weight_decay=0.0))
    server_weight, _ = client.export_weights("no-copy-save")
    remote.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / remotehead.hf.HEAD_SHARD).is_file()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(loaded.lm_head.weight.detach(), server_weight)
    body = dict(remote.named_parameters())
    for name, p in loaded.named_parameters():
        if name != "lm_head.weight":
            assert torch.equal(p.detach(), body[name].detach()), name
    # from_pretrained + offload: the checkpoint's W goes to the server, the copy is freed.
    again = remotehead.hf.offload_lm_head(loaded, client, "no-copy-loaded")
    assert not again.has_local_copy
    reloaded, _ = client.export_weights("no-copy-loaded")
    assert torch.equal(reloaded, server_weight)
    # Saved again without the copy: the same bytes.
    loaded.save_pretrained(tmp_path / "ckpt2")
    second = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt2")
    assert torch.equal(second.lm_head.weight.detach(), server_weight)
    for head_id in ("no-copy-save", "no-copy-loaded"):
        client.drop_head(head_id)


def test_loading_a_state_dict_sets_the_server_head(client):
    _, remote, head = offloaded(client, "no-copy-load")
    state = tiny_llama().state_dict()
    state["lm_head.weight"] = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(9))
    remote.load_state_dict(state)
    weight, _ = client.export_weights("no-copy-load")
    assert torch.equal(weight, state["lm_head.weight"])
    assert not head.has_local_copy
    assert remote.lm_head.weight.untyped_storage().nbytes() == 4
    # Its own state dict (the released parameter) loads back without touching the server.
    remote.load_state_dict(remote.state_dict())
    assert torch.equal(client.export_weights("no-copy-load")[0], weight)
    # A head of another shape: refused as load_state_dict refuses a parameter's, not uploaded.
    state["lm_head.weight"] = torch.zeros(VOCAB + 1, 32)
    with pytest.raises(RuntimeError, match=r"size mismatch for lm_head.weight.*\(258, 32\)"):
        remote.load_state_dict(state)
    assert torch.equal(client.export_weights("no-copy-load")[0], weight)
    client.drop_head("no-copy-load")


def test_moving_or_casting_the_model_converts_the_released_weights_one_element(client):
    _, remote, head = offloaded(client, "no-copy-cast")
    weight = remote.lm_head.weight
    remote.to(torch.bfloat16)
    assert remote.lm_head.weight is weight and weight.dtype == torch.bfloat16
    assert weight.shape == (VOCAB, 32) and weight.untyped_storage().nbytes() == 2
    assert remote.model.norm.weight.dtype == torch.bfloat16
    remote.to("meta")  # what accelerate's CPU-RAM-efficient FSDP2 loading does
    assert remote.lm_head.weight.device.type == "meta"
    assert remote.lm_head.weight.shape == (VOCAB, 32)
    assert "lm_head.weight" in remote.state_dict()
    client.drop_head("no-copy-cast")
