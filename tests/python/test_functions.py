"""Every function the server lists (ListFunctions, the `registry` fixture) against its reference
in tests/python/references.py, through the Python client and the real server binary: a
Forward's per-token outputs, and a fused sum's loss, dX and dW, with the listed defaults and
with other values of every parameter, with the required aux inputs and with every aux input.

No list of functions is kept here: a function registered in C++ is run as soon as the server
lists it, and test_every_listed_function_has_a_reference fails until references.py has its
reference. Each failure names the function and the case; every case runs before the test fails.

Tolerances: fp32 on the server against float64 references, relative 1e-5 of each quantity's
magnitude (tests/python/numerics.py).
"""

import pytest
import torch

import distill_reference
import numerics
import references
import remotehead

V, D, N = 300, 32, 57
REL = 1e-5


def distillation(fn) -> bool:
    """A function of a teacher (a second head, or [N, k] top-k inputs): test_distillation.py
    runs it against tests/python/distill_reference.py."""
    return fn.needs_teacher or bool(fn.topk_aux)


def per_token_functions(registry):
    functions = [f for f in registry.values()
                 if f.output_kind == "per_token" and not distillation(f)]
    assert functions, f"the server lists no per-token function; it lists {sorted(registry)}"
    return functions


def test_every_listed_function_has_a_reference(registry):
    """What the table must hold for the registry: a reference for every listed per-token
    function (and none for a function the server does not list), the common parameters'
    references, a maker for every aux input, and non-default values the server accepts."""
    problems = []
    for fn in per_token_functions(registry):
        reference = references.REFERENCES.get(fn.name)
        if reference is None:
            problems.append(f"{fn.name}: listed by the server (output_kind per_token) but has no "
                            f"reference in tests/python/references.py REFERENCES")
            continue
        listed = {p.name: p for p in fn.params}
        for p in fn.params:
            if p.common and p.name not in references.COMMON_PARAMS:
                problems.append(f"{fn.name}: common parameter {p.name!r} has no reference in "
                                f"references.COMMON_PARAMS")
        for name, value in reference.params.items():
            if name not in listed:
                problems.append(f"{fn.name}: REFERENCES names parameter {name!r}, which the "
                                f"server does not list (it lists {sorted(listed)})")
            elif not listed[name].min <= value <= listed[name].max:
                problems.append(f"{fn.name}: {name}={value} outside the listed "
                                f"[{listed[name].min}, {listed[name].max}]")
        for name in fn.required_aux + fn.optional_aux:
            if name not in references.AUX_INPUTS:
                problems.append(f"{fn.name}: aux input {name!r} has no maker in "
                                f"references.AUX_INPUTS")
    for fn in registry.values():
        if distillation(fn) and fn.name not in (distill_reference.TWO_HEAD
                                                + distill_reference.SPARSE):
            problems.append(f"{fn.name}: a distillation function (needs_teacher or topk_aux) "
                            f"with no reference in tests/python/distill_reference.py")
    for name in references.REFERENCES:
        if registry.get(name) is None or registry[name].output_kind != "per_token":
            problems.append(f"{name}: has a reference but the server lists no per-token function "
                            f"of that name")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def client(server_target):
    with remotehead.Client(server_target, chunk_bytes=2048) as c:  # many messages per step
        yield c


@pytest.fixture(scope="module")
def head(client):
    torch.manual_seed(3)
    weight = torch.randn(V, D) / D**0.5
    client.upload_head("functions", weight)
    yield "functions", weight
    client.drop_head("functions")


def cases(fn):
    """(label, params, aux names) to run `fn` with: the listed defaults with the required aux
    inputs and with every one, then every parameter the table gives a value other than its
    default."""
    defaults = {p.name: p.default for p in fn.params}
    varied = dict(defaults)
    varied.update({p.name: references.COMMON_PARAM_VALUES[p.name] for p in fn.params
                   if p.common and p.name in references.COMMON_PARAM_VALUES})
    varied.update(references.REFERENCES[fn.name].params)
    every_aux = fn.required_aux + fn.optional_aux
    if not every_aux:
        yield "defaults", defaults, ()
        yield f"params {varied}", varied, ()
        return
    yield "defaults, required aux", defaults, fn.required_aux
    if fn.optional_aux:
        yield "defaults, every aux", defaults, every_aux
    yield f"params {varied}, every aux", varied, every_aux


def check_case(client, head, fn, params, aux_names, seed, gradient_id):
    """The problems of one case, as text (empty: it matches its reference)."""
    head_id, weight = head
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    targets = None
    if fn.needs_targets:
        targets = torch.randint(0, V, (N,), generator=g)
        targets[::5] = -100  # ignored rows: no output, no gradient
    with torch.no_grad():  # the current policy's log-probabilities, for the aux makers
        z = references.logits(hidden, weight, params)
        safe = torch.zeros(N, dtype=torch.long) if targets is None else targets.clamp(min=0)
        logp = torch.log_softmax(z, 1).gather(1, safe[:, None])[:, 0]
    aux = {name: references.AUX_INPUTS[name](logp, g) for name in aux_names}
    aux = {name: t.float() if t.dtype.is_floating_point else t for name, t in aux.items()}

    x = hidden.to(torch.float64).requires_grad_()
    w = weight.to(torch.float64).requires_grad_()
    y = references.per_token(fn.name, x, w, targets, aux, params)
    loss = y.sum()
    loss.backward()

    problems = []

    def check(what, actual, expected, floor=0.0):
        error = numerics.relative_error(actual, expected, floor)
        if not error <= REL:
            problems.append(f"{what}: relative error {error:.3g} > {REL}")

    step = dict(function=fn.name, params=params, aux=aux or None)
    forward = client.forward(head_id, hidden, targets, reduction="none", **step)
    check("forward outputs", forward.outputs, y.detach())
    if fn.differentiable:
        fused = client.forward_backward(head_id, hidden, targets, reduction="sum",
                                        gradient_id=gradient_id, **step)
        check("fused loss", fused.loss, loss.item(), floor=y.detach().abs().sum().item())
        check("fused dX", fused.grad_hidden, x.grad)
        dw, _, _ = client.fetch_gradients(head_id)
        client.zero_gradients(head_id)
        check("dW", dw, w.grad)
    return problems


def test_every_listed_function_matches_its_reference(client, head, registry):
    failures = []
    checked = 0
    for fn in per_token_functions(registry):
        if fn.name not in references.REFERENCES:
            continue  # test_every_listed_function_has_a_reference names it
        for label, params, aux_names in cases(fn):
            try:
                problems = check_case(client, head, fn, params, aux_names, seed=checked,
                                      gradient_id=("functions", checked, 0))
            except Exception as e:  # a refusal, a missing aux maker: this case's failure
                problems = [f"{type(e).__name__}: {e}"]
            failures += [f"{fn.name} ({label}): {p}" for p in problems]
            checked += 1
    assert checked, "no listed function has a reference"
    assert not failures, "\n".join(failures)
