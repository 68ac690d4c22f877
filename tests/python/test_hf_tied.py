"""Tied input embeddings served by the server (offload_lm_head with gradients="server" on a
model whose lm_head is its input embedding), against the same model trained with its own tied
matrix (autograd on full logits), for a tied Llama, a Gemma-2-like model (its scaled embedding,
final logit soft-capping 0.5, which moves the loss) and a Gemma-3-like one (√hidden embedding
scale); tiny configs, fixed seeds (tied_models.py), padding ids among the inputs.

- Training, one process, 3 AdamW steps of 2 micro-batches (sum / num_items_in_batch): per-step
  losses to 1e-5 relative; in the first window the body's gradients and the server's dW against
  the local tied matrix's gradient (embedding + head, padding row included) to 1e-5 of each
  tensor's magnitude (measured: exactly equal); after the steps the server's tied weight to
  1e-5 and the body to 1e-4; the trainer holds no [V, D] tensor (parameters, gradients,
  buffers, optimizer state), its state_dict has the local model's keys, head version = steps.
- The embedding's semantics: the forward equals the model's own embedding module bit for bit
  (bf16 body, Gemma's scale); only the distinct ids travel; the padding row gets no gradient;
  the gradient carries the head step's gradient id, so the micro-batch counts once.
- Exactly-once and bad input: a replayed gradient adds nothing; ids out of range (the module's
  and the server's errors), a gradient of another width, a gradient for rows the call did not
  read, a head of another width, a gradient after the head moved on: precise errors, and the
  accumulated dW is bit-identical afterwards.
- Generation: model.generate equals the local model's tokens, each new token's row read from
  the server; remotehead.hf.generate too.
- Checkpoints: save_pretrained writes the tied tensor once (the input embedding's name, from
  the server), from_pretrained gives the served weights bit-exactly; load_state_dict of a local
  tied model's state (both names) uploads it once.
- A frozen head (LoRA on a tied model) serves the lookups, nothing accumulates, the adapters get
  the local gradients; keep_local_copy=True keeps a frozen lm_head copy, refreshed by sync.
- A head group of 2: the same rows and the same dW as one server.
The runs under torchrun and TRL's GRPO: test_hf_tied_cluster.py; the memory: test_hf_tied_memory.py.
"""

import copy
import os

import peft
import pytest
import torch
import transformers
from safetensors import safe_open

import numerics
import remotehead
import remotehead.hf
from remotehead.local_server import LocalHeadGroup
from tied_models import KINDS, PAD, VOCAB, holds_no_matrix, tiny, token_rows

STEPS, ACCUMULATION, LR, EPS = 3, 2, 3e-3, 1e-6
BINARY = os.environ.get("REMOTEHEAD_SERVER_BINARY", "build/server/remotehead-server")


@pytest.fixture
def client(server_target):
    with remotehead.Client(server_target) as c:
        yield c


def train(model, head=None):
    """STEPS AdamW steps of ACCUMULATION micro-batches of 2 rows. Returns the per-step losses,
    the first window's gradients by parameter name and the tied matrix's (the local one's, or
    the server's dW), and the optimizer."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  eps=EPS, weight_decay=0.0)
    ids, labels = token_rows(2 * ACCUMULATION * 2, 10, seed=1)
    ids, labels = ids.view(2, ACCUMULATION, 2, 10), labels.view(2, ACCUMULATION, 2, 10)
    losses, grads, tied_grad = [], None, None
    for step in range(STEPS):
        batch_ids, batch_labels = ids[step % 2], labels[step % 2]
        num_items = int((batch_labels[..., 1:] != -100).sum())
        loss = 0.0
        for micro in range(ACCUMULATION):
            out = model(input_ids=batch_ids[micro], labels=batch_labels[micro],
                        num_items_in_batch=num_items)
            out.loss.backward()
            loss += out.loss.item()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
            tied_grad = (head.client.fetch_gradients(head.head_id)[0] if head is not None
                         else model.get_input_embeddings().weight.grad.clone())
        optimizer.step()
        optimizer.zero_grad()
        if head is not None:
            head.optimizer_step(adamw=dict(lr=LR, eps=EPS, weight_decay=0.0))
        losses.append(loss)
    return losses, grads, tied_grad, optimizer


@pytest.mark.parametrize("kind", KINDS)
def test_training_matches_the_model_with_its_own_tied_head(client, kind):
    local = tiny(kind)
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, f"tied-{kind}")
    assert isinstance(remote.get_input_embeddings(), remotehead.RemoteEmbedding)
    assert not head.has_local_copy
    assert list(remote.state_dict()) == list(local.state_dict())
    local_losses, local_grads, local_tied, _ = train(local)
    remote_losses, remote_grads, served_tied, optimizer = train(remote, head)

    for step, (a, b) in enumerate(zip(remote_losses, local_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: served {a} vs local {b}"
    embedding = next(n for n, p in local.named_parameters() if p is local.lm_head.weight)
    assert set(remote_grads) == set(local_grads) - {embedding}
    for name, grad in remote_grads.items():
        assert numerics.close(grad, local_grads[name], 1e-5), name
    # dW on the server = the local tied matrix's gradient: the head's use plus the embedding's.
    assert numerics.close(served_tied, local_tied, 1e-5)
    weight, _ = client.export_weights(f"tied-{kind}")
    assert numerics.close(weight, local.lm_head.weight.detach(), 1e-5)
    local_params = dict(local.named_parameters())
    for name, p in remote.named_parameters():
        assert numerics.close(p.detach(), local_params[name].detach(), 1e-4), name
    assert holds_no_matrix(remote, optimizer)
    info = client.describe_head(f"tied-{kind}")
    assert info.weight_version == STEPS and info.accumulated_micro_batches == 0
    if kind == "gemma2":  # the soft-capping is in the served loss, and it matters here
        uncapped = copy.deepcopy(local)
        uncapped.config.final_logit_softcapping = None
        ids, labels = token_rows(2, 10, seed=1)
        with torch.no_grad():
            capped_loss, plain_loss = (m(ids, labels=labels).loss.item()
                                       for m in (local, uncapped))
        assert abs(capped_loss - plain_loss) > 1e-3 * abs(plain_loss)
    client.drop_head(f"tied-{kind}")


class Calls:
    """Records a client's embedding calls (ids and gradient ids) and passes them on."""

    def __init__(self, client):
        self.lookups, self.gradients = [], []
        lookup, gradient = client.embedding_lookup, client.embedding_gradient

        def recorded_lookup(head_id, ids, **kwargs):
            self.lookups.append(torch.as_tensor(ids).clone())
            return lookup(head_id, ids, **kwargs)

        def recorded_gradient(head_id, ids, grad, **kwargs):
            self.gradients.append((head_id, torch.as_tensor(ids).clone(), grad.clone(), kwargs))
            return gradient(head_id, ids, grad, **kwargs)

        client.embedding_lookup, client.embedding_gradient = recorded_lookup, recorded_gradient


def test_the_embedding_keeps_the_models_semantics(client):
    ids, labels = token_rows(3, 9, seed=4)
    assert (ids == PAD).any()
    # bf16 body, Gemma's √hidden scale: the served rows are the module's own, bit for bit.
    for kind in ("gemma3", "gemma2", "llama"):
        local = tiny(kind, dtype=torch.bfloat16)
        remote = copy.deepcopy(local)
        remotehead.hf.offload_lm_head(remote, client, f"tied-bf16-{kind}")
        with torch.no_grad():
            expected = local.get_input_embeddings()(ids)
            got = remote.get_input_embeddings()(ids)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected), kind
        client.drop_head(f"tied-bf16-{kind}")

    local = tiny("gemma3")
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, "tied-semantics")
    calls = Calls(client)
    upstream = torch.randn(*ids.shape, local.config.hidden_size,
                           generator=torch.Generator().manual_seed(5))
    (local.get_input_embeddings()(ids) * upstream).sum().backward()
    (remote.get_input_embeddings()(ids) * upstream).sum().backward()
    # Only the distinct ids travel; the padding row's gradient stays home.
    assert torch.equal(calls.lookups[0], ids.unique())
    (_, sent_ids, _, sent), = calls.gradients
    assert torch.equal(sent_ids, ids.unique()[ids.unique() != PAD])
    dw, _, info = client.fetch_gradients("tied-semantics")
    local_grad = local.get_input_embeddings().weight.grad
    assert numerics.close(dw, local_grad, 1e-6)
    assert not dw[PAD].any() and not local_grad[PAD].any()
    # The micro-batch's head step carries the embedding's gradient id: counted once.
    assert sent["gradient_id"] == remotehead.GradientId(head.trainer, 0, 0)
    assert sent["expected_weight_version"] == 0
    remote(ids, labels=labels).loss.backward()
    assert client.describe_head("tied-semantics").accumulated_micro_batches == 2  # two forwards
    client.drop_head("tied-semantics")


def test_exactly_once_and_bad_input_change_nothing(client):
    model = tiny("llama")
    head = remotehead.hf.offload_lm_head(model, client, "tied-bad")
    calls = Calls(client)
    ids, labels = token_rows(2, 8, seed=6)
    model(ids, labels=labels).loss.backward()
    before, _, info = client.fetch_gradients("tied-bad")
    assert info.accumulated_micro_batches == 1 and before.abs().sum() > 0
    D = model.config.hidden_size

    def unchanged():
        dw, _, now = client.fetch_gradients("tied-bad")
        return torch.equal(dw, before) and now.accumulated_micro_batches == 1

    (head_id, sent_ids, sent_grad, kwargs), = calls.gradients
    again = client.embedding_gradient(head_id, sent_ids, sent_grad, **kwargs)
    assert again.replayed and unchanged()

    gid = remotehead.GradientId(head.trainer, 0, 7)
    refused = [
        (lambda: model.get_input_embeddings()(torch.tensor([[5, VOCAB]])),
         rf"input_ids: expected token ids in \[0, {VOCAB}\).*got {VOCAB} at position \[0, 1\]"),
        (lambda: model.get_input_embeddings()(torch.tensor([-1])),
         r"input_ids: expected token ids.*got -1 at position \[0\]"),
        (lambda: client.embedding_lookup("tied-bad", [3, VOCAB + 4]),
         rf"ids: expected token ids in \[0, {VOCAB}\).*got {VOCAB + 4} at position 1"),
        (lambda: client.embedding_gradient("tied-bad", [VOCAB], torch.ones(1, D), gradient_id=gid),
         rf"header.ids: expected token ids.*got {VOCAB} at position 0"),
        (lambda: client.embedding_gradient("tied-bad", [3, 4], torch.ones(2, D + 1),
                                           gradient_id=gid),
         rf"grad_rows.*expected \[rows, {D}\].*got Float \[2, {D + 1}\]"),
        (lambda: client.embedding_gradient("tied-bad", [3, 4], torch.ones(3, D),
                                           gradient_id=gid),
         rf"grad: expected a floating \[2, D\] tensor \(one row per id\); got .*\[3, {D}\]"),
    ]
    for call, message in refused:
        with pytest.raises(remotehead.InvalidArgumentError, match=message):
            call()
        assert unchanged(), message
    # A head of another width: the model's embedding is not that head's.
    wide = tiny("llama", hidden=48)
    with pytest.raises(ValueError, match=r"expected the input embedding's shape \(263, 48\); "
                                         r"got \(263, 32\)"):
        remotehead.hf.offload_lm_head(wide, client, "tied-bad", upload=False)
    assert unchanged()

    # A gradient for weights the head no longer has: refused, nothing added.
    out = model(ids, labels=labels).loss
    head.optimizer_step(adamw=dict(lr=1e-2, weight_decay=0.0))
    with pytest.raises(remotehead.WeightVersionMismatchError,
                       match="header.expected_weight_version"):
        out.backward()
    dw, _, info = client.fetch_gradients("tied-bad")
    assert not dw.any() and info.accumulated_micro_batches == 0
    client.drop_head("tied-bad")


def test_generation_reads_each_new_tokens_row_from_the_server(client):
    local = tiny("gemma3").eval()
    remote = copy.deepcopy(local)
    head = remotehead.hf.offload_lm_head(remote, client, "tied-generate")
    calls = Calls(client)
    prompts = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(8))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    expected = local.generate(prompts, **kwargs)
    assert torch.equal(remote.generate(prompts, **kwargs), expected)
    # The prompt's rows, then the row of each new token (one lookup per decode step).
    assert len(calls.lookups) == 5
    assert torch.equal(calls.lookups[0], prompts.unique())
    for step, looked_up in enumerate(calls.lookups[1:]):
        assert torch.equal(looked_up, expected[:, 5 + step].unique())
    drawn = remotehead.hf.generate(remote, head, prompts, max_new_tokens=5, greedy=True,
                                   eos_token_id=[])
    assert torch.equal(drawn.sequences, expected)
    assert not calls.gradients
    client.drop_head("tied-generate")


def test_checkpoints_hold_the_tied_tensor_once(client, tmp_path):
    model = tiny("gemma2")
    local_state = copy.deepcopy(model).state_dict()
    head = remotehead.hf.offload_lm_head(model, client, "tied-save")
    ids, labels = token_rows(2, 8, seed=2)
    model(ids, labels=labels).loss.backward()
    head.optimizer_step(adamw=dict(lr=1e-2, weight_decay=0.0))
    served, _ = client.export_weights("tied-save")
    model.save_pretrained(tmp_path / "ckpt")
    names = []
    for shard in (tmp_path / "ckpt").glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names += list(f.keys())
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    assert torch.equal(loaded.lm_head.weight.detach(), served)
    body = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        if name != "model.embed_tokens.weight":
            assert torch.equal(p.detach(), body[name].detach()), name
    # A local tied model's state (the matrix under both names): uploaded once, then released.
    version = client.describe_head("tied-save").weight_version
    model.load_state_dict(local_state)
    assert torch.equal(client.export_weights("tied-save")[0],
                       local_state["model.embed_tokens.weight"])
    assert client.describe_head("tied-save").weight_version == version + 1
    model.load_state_dict(model.state_dict())  # its own (released) state: nothing uploaded
    assert client.describe_head("tied-save").weight_version == version + 1
    model.tie_weights()  # nothing to tie: no local matrix comes back
    assert holds_no_matrix(model)
    client.drop_head("tied-save")


def test_a_frozen_head_serves_lookups_and_a_kept_copy_stays_for_generation(client):
    ids, labels = token_rows(2, 8, seed=7)
    # LoRA on a tied model (offload_lm_head(..., trainable=False)): the embedding is served by
    # the frozen head, the adapters get the local run's gradients, nothing accumulates.
    base = tiny("llama")
    models = []
    for _ in range(2):
        torch.manual_seed(1)
        models.append(peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])))
    local, remote = models
    remotehead.hf.offload_lm_head(remote, client, "tied-lora", trainable=False)
    assert isinstance(remote.get_input_embeddings(), remotehead.RemoteEmbedding)
    assert holds_no_matrix(remote.get_base_model())
    local(input_ids=ids, labels=labels).loss.backward()
    remote(input_ids=ids, labels=labels).loss.backward()
    local_params = dict(local.named_parameters())
    adapters = [(n, p) for n, p in remote.named_parameters() if p.requires_grad]
    assert adapters
    for name, p in adapters:
        assert numerics.close(p.grad, local_params[name].grad, 1e-5), name
    assert client.describe_head("tied-lora").accumulated_micro_batches == 0
    client.drop_head("tied-lora")
    # keep_local_copy=True: a frozen lm_head copy for local generation; the embedding is served.
    model = tiny("gemma2")
    head = remotehead.hf.offload_lm_head(model, client, "tied-copy", keep_local_copy=True)
    assert isinstance(model.get_input_embeddings(), remotehead.RemoteEmbedding)
    assert [n for n, p in model.named_parameters() if p.numel() >= VOCAB * 32] == \
        ["lm_head.weight"] and not model.lm_head.weight.requires_grad
    model(ids, labels=labels).loss.backward()
    head.optimizer_step(adamw=dict(lr=1e-2, weight_decay=0.0), sync=True)
    assert torch.equal(model.lm_head.weight.detach(), client.export_weights("tied-copy")[0])
    client.drop_head("tied-copy")


@pytest.fixture(scope="module")
def group():
    g = LocalHeadGroup(BINARY, size=2, args=("--device=cpu", "--torch_threads=1")).start()
    yield g.target
    assert g.stop() == [0, 0], "".join(g.ranks[0].log + g.ranks[1].log)


def test_a_head_group_serves_the_same_rows_and_gradients(client, group):
    base = tiny("gemma3")
    ids, labels = token_rows(2, 10, seed=3)
    results = []
    with remotehead.Client(group) as group_client:
        for c in (client, group_client):
            model = copy.deepcopy(base)
            head = remotehead.hf.offload_lm_head(model, c, "tied-group")
            rows, _ = c.embedding_lookup("tied-group", torch.tensor([0, 140, 131, 262, 131]))
            loss = model(ids, labels=labels).loss
            loss.backward()
            dw, _, info = c.fetch_gradients("tied-group")
            head.optimizer_step(adamw=dict(lr=1e-2, weight_decay=0.0))
            results.append((rows, loss.item(), dw, info, c.export_weights("tied-group")[0]))
        assert group_client.describe_head("tied-group").shards == ((0, 132), (132, 131))
        group_client.drop_head("tied-group")
    client.drop_head("tied-group")
    (rows, loss, dw, info, weight), (g_rows, g_loss, g_dw, g_info, g_weight) = results
    assert torch.equal(g_rows, rows)  # each row from the one rank that holds it
    assert abs(g_loss - loss) <= 1e-5 * abs(loss)
    assert numerics.close(g_dw, dw, 1e-5) and g_info.accumulated_micro_batches == 1
    assert numerics.close(g_weight, weight, 1e-5)


EMPTY_GRADIENT = ("header.ids: expected at least 1 token id (a gradient for no rows adds nothing "
                  "and would count a micro-batch); got 0")


def assert_an_empty_gradient_changes_nothing(c: remotehead.Client, head_id: str,
                                             gradient_id) -> None:
    """An EmbeddingGradient with no ids on `head_id` (which has accumulated something) is
    refused — INVALID_ARGUMENT, reason INVALID_FIELD naming header.ids, expected >= 1, got 0,
    the message word for word — dW bit-identical and accumulated_micro_batches unchanged; the
    same gradient id was not taken (a real gradient under it then adds, not a replay)."""
    before, _, info = c.fetch_gradients(head_id)
    D = before.shape[1]
    with pytest.raises(remotehead.InvalidArgumentError) as empty:
        c.embedding_gradient(head_id, [], torch.zeros(0, D), gradient_id=gradient_id)
    assert empty.value.details == EMPTY_GRADIENT
    assert (empty.value.reason, empty.value.metadata["field"], empty.value.metadata["expected"],
            empty.value.metadata["actual"]) == ("INVALID_FIELD", "header.ids", ">= 1", "0")
    dw, _, after = c.fetch_gradients(head_id)
    assert torch.equal(dw, before)
    assert after.accumulated_micro_batches == info.accumulated_micro_batches
    assert after.weight_version == info.weight_version
    added = c.embedding_gradient(head_id, [3], torch.ones(1, D), gradient_id=gradient_id)
    assert not added.replayed
    dw, _, after = c.fetch_gradients(head_id)
    # (1e-6: on a mesh the leader's fetch sums the replicas' dW, in another order.)
    assert numerics.close(dw[3], before[3] + 1, 1e-6)
    assert after.accumulated_micro_batches == info.accumulated_micro_batches + 1


def test_an_embedding_gradient_without_ids_is_refused_alike_on_a_server_and_a_group(
        client, group):
    # One server and a head group of 2 refuse it at the front, before any rank adds anything.
    ids, labels = token_rows(2, 8, seed=9)
    with remotehead.Client(group) as group_client:
        for c in (client, group_client):
            model = tiny("llama")
            head = remotehead.hf.offload_lm_head(model, c, "tied-empty")
            model(ids, labels=labels).loss.backward()  # one micro-batch accumulated
            assert c.describe_head("tied-empty").accumulated_micro_batches == 1
            assert_an_empty_gradient_changes_nothing(
                c, "tied-empty", remotehead.GradientId(head.trainer, 5, 0))
            c.drop_head("tied-empty")
