"""Distillation on the real server against TRL's own chunked loss: TRL's
trl.trainer.distillation_trainer._chunked_divergence_loss (fp32, its own CPU tiles) vs the route
remotehead.trl installs in its place (the server's functions): beta 0 / 0.5 / 1, temperature,
logit scale and softcap on either side, D_teacher ≠ D, num_items_in_batch or the mean, a fully
masked batch: loss, entropy sum, count, dX, dW to 1e-5. With biases on both heads:
RemoteHead.distill against TRL's function. (The server's functions against full logits:
test_distillation.py.)
"""

import pytest
import torch

import distill_reference as ref
import numerics
import remotehead
from test_distillation import D, DT, V


@pytest.fixture(scope="module")
def client(server_target):
    # Small messages: every step's rows (and the teacher's) travel in several row messages.
    with remotehead.Client(server_target, chunk_bytes=4096) as c:
        yield c


TRL_CASES = {
    "forward-kl": dict(beta=0.0),
    "jsd": dict(beta=0.5, temperature=0.8),
    "reverse-kl": dict(beta=1.0, num_items_in_batch=23.0),
    "jsd-student-scale-softcap": dict(beta=0.5, student_logit_scale=1.7,
                                      student_final_logit_softcapping=3.0, temperature=1.3),
    "kl-teacher-scale-softcap": dict(beta=0.0, teacher_logit_scale=0.6,
                                     teacher_final_logit_softcapping=2.5,
                                     num_items_in_batch=31.0),
    "reverse-both-sides": dict(beta=1.0, student_logit_scale=1.2, teacher_logit_scale=0.9,
                               student_final_logit_softcapping=5.0,
                               teacher_final_logit_softcapping=4.0, temperature=0.9),
    "jsd-beta-0.2-all-masked": dict(beta=0.2, all_masked=True),
}


def trl_inputs(seed, all_masked=False):
    g = torch.Generator().manual_seed(seed)
    batch, length = 3, 9
    student_hidden = torch.randn(batch, length, D, generator=g)
    teacher_hidden = torch.randn(batch, length, DT, generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, 6:] = mask[2, 3:] = 0  # completions that ended early
    if all_masked:
        mask.zero_()
    return student_hidden, teacher_hidden, mask


def trl_weights(seed, bias):
    g = torch.Generator().manual_seed(seed + 1000)
    ws = torch.randn(V, D, generator=g) / D**0.5
    wt = 1.5 * torch.randn(V, DT, generator=g) / DT**0.5
    bs = 0.3 * torch.randn(V, generator=g) if bias else None
    bt = 0.3 * torch.randn(V, generator=g) if bias else None
    return ws, wt, bs, bt


def trl_reference(student_hidden, teacher_hidden, ws, wt, mask, case, bs=None, bt=None):
    """TRL's function on local fp32 tensors: (loss, entropy sum, count, dX, dW)."""
    from trl.trainer import distillation_trainer
    original = getattr(distillation_trainer._chunked_divergence_loss, "__wrapped__",
                       distillation_trainer._chunked_divergence_loss)
    h = student_hidden.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    kwargs = {k: v for k, v in case.items() if k not in ("beta", "all_masked")}
    loss, entropy, n = original(h, teacher_hidden, w, wt, mask, case["beta"],
                                student_lm_head_bias=bs, teacher_lm_head_bias=bt, **kwargs)
    loss.backward()
    return loss.detach(), entropy, n, h.grad, w.grad


@pytest.mark.parametrize("case", TRL_CASES)
def test_trl_route_matches_trls_chunked_divergence_loss(client, case):
    """What RemoteHeadDistillationTrainer runs: TRL's module-level function, replaced by
    remotehead.trl's route for offloaded weights, against TRL's own."""
    from trl.trainer import distillation_trainer

    import remotehead.trl as rtrl
    spec = TRL_CASES[case]
    seed = list(TRL_CASES).index(case)
    student_hidden, teacher_hidden, mask = trl_inputs(seed, spec.get("all_masked", False))
    ws, wt, _, _ = trl_weights(seed, bias=False)
    expected = trl_reference(student_hidden, teacher_hidden, ws, wt, mask, spec)

    student_id, teacher_id = f"trl-student-{case}", f"trl-teacher-{case}"
    client.upload_head(student_id, ws)
    client.upload_head(teacher_id, wt, frozen=True)
    try:
        student = remotehead.RemoteHead(client, student_id, trainer="trl-route")
        teacher = remotehead.RemoteHead(client, teacher_id, accumulate=False)
        # Placeholders for the released lm_head weights, marked as offload_distillation_heads
        # marks them.
        sw, tw = torch.nn.Parameter(torch.zeros(())), torch.nn.Parameter(torch.zeros(()))
        setattr(sw, rtrl._ROUTE, rtrl._DistillationRoute(student, teacher))
        setattr(tw, rtrl._TEACHER, teacher)
        rtrl._install_divergence_route()
        h = student_hidden.clone().requires_grad_()
        kwargs = {k: v for k, v in spec.items() if k not in ("beta", "all_masked")}
        loss, entropy, n = distillation_trainer._chunked_divergence_loss(
            h, teacher_hidden, sw, tw, mask, spec["beta"], **kwargs)
        loss.backward()
        e_loss, e_entropy, e_n, e_dx, e_dw = expected
        assert int(n) == int(e_n)
        assert numerics.close(loss.item(), e_loss.item(), 1e-5, floor=1e-6), (loss, e_loss)
        assert numerics.close(float(entropy), float(e_entropy), 1e-5, floor=1e-6)
        assert numerics.close(h.grad, e_dx, 1e-5, floor=1e-7)
        dw, _, info = client.fetch_gradients(student_id)
        if int(e_n):
            assert info.accumulated_micro_batches == 1
            assert numerics.close(dw, e_dw, 1e-5)
        else:  # nothing sent: nothing accumulated
            assert info.accumulated_micro_batches == 0
        # The same through the float64 reference of the formula in TRL's docstring.
        f64 = ref.trl_loss(student_hidden, teacher_hidden, ws, wt, mask, spec["beta"],
                           **{k.replace("_lm_head", "").replace("_final_logit_softcapping",
                                                                "_softcap")
                              .replace("_logit_scale", "_scale"): v
                              for k, v in kwargs.items()})
        assert numerics.close(loss.item(), f64[0].item(), 1e-5, floor=1e-6)
        # A weight that was not offloaded still goes to TRL's own function.
        local = distillation_trainer._chunked_divergence_loss(
            student_hidden, teacher_hidden, ws, wt, mask, spec["beta"], **kwargs)
        assert numerics.close(local[0].item(), e_loss.item(), 1e-6, floor=1e-6)
    finally:
        client.drop_head(student_id)
        client.drop_head(teacher_id)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_biased_heads_match_trl(client, beta):
    """Both heads with a bias, through RemoteHead.distill, against TRL's function with the
    biases: loss, dX, dW, db, the entropy."""
    spec = dict(beta=beta, temperature=0.9, student_logit_scale=1.1,
                teacher_final_logit_softcapping=6.0)
    student_hidden, teacher_hidden, mask = trl_inputs(40)
    ws, wt, bs, bt = trl_weights(40, bias=True)
    b = bs.clone().requires_grad_()
    from trl.trainer import distillation_trainer
    original = getattr(distillation_trainer._chunked_divergence_loss, "__wrapped__",
                       distillation_trainer._chunked_divergence_loss)
    h = student_hidden.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    e_loss, e_entropy, _ = original(h, teacher_hidden, w, wt, mask, beta, None, b, bt, 1.1, 1.0,
                                    None, 6.0, 0.9)
    e_loss.backward()
    sid, tid = f"bias-student-{beta}", f"bias-teacher-{beta}"
    client.upload_head(sid, ws, bs)
    client.upload_head(tid, wt, bt, frozen=True)
    try:
        head = remotehead.RemoteHead(client, sid, teacher=tid)
        x = student_hidden.clone().requires_grad_()
        function = {0.0: "distill_kl", 1.0: "distill_reverse_kl"}.get(beta, "distill_jsd")
        params = {"temperature": 0.9, "logit_scale": 1.1, "teacher_softcap": 6.0}
        if function == "distill_jsd":
            params["beta"] = beta
        loss = head.distill(x, teacher_hidden, mask=mask, function=function, params=params)
        loss.backward()
        assert numerics.close(loss.item(), e_loss.item(), 1e-5)
        assert numerics.close(x.grad, h.grad, 1e-5)
        assert numerics.close(head.last_result.summary.extras["entropy"], e_entropy.item(), 1e-5)
        dw, db, _ = client.fetch_gradients(sid)
        assert numerics.close(dw, w.grad, 1e-5)
        assert numerics.close(db, b.grad, 1e-5)
    finally:
        client.drop_head(sid)
        client.drop_head(tid)
