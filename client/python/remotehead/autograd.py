"""RemoteHead: the server's head as a differentiable function of the hidden states.

The fused path does the whole LM-head step in one round trip during the forward: the server
returns the loss and dX (and accumulates dW); backward() then only scales the saved dX. The
server's dW corresponds to the upstream gradient declared up front (`upstream_scale`, 1 by
default): while dW is accumulated, a backward with another dL/dloss is refused rather than
leaving dW inconsistent with dX (upstream_matches_declared: the rule the C++ client's
FusedLossFunction applies too).

Where the head's parameter lives in the trainer (`local_weight`), the server is a stateless
accelerator for it (_local_weight.py: the parameter pushed when it changed, dW pulled into its
.grad). The trainer's gradient identities, the head version it holds and its synchronous
optimizer steps are _step_state.py's; RemoteHead composes them with the calls below.

Distillation (`RemoteHead.distill`, or `loss` / `token_outputs` of a two-head function with a
`teacher` and `teacher_hidden`): the teacher's hidden states travel with the student's rows and
the frozen teacher head on the server turns them into logits; dX comes back for the student's
hidden states only, and dW accumulates on the student's head only — teacher_hidden is data,
never an input of the autograd graph (it gets no gradient, detached or not).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional, TypeVar

import grpc
import torch

from remotehead import cluster as cluster_lib
from remotehead._errors import ReplicaMovedError, ServerRestartedError
from remotehead._local_weight import LocalWeightMirror
from remotehead._replay_journal import ReplayJournal, host_copy
from remotehead._step_state import StepState
from remotehead.client import Client, HeadInfo, InvalidArgumentError, RemoteheadError, StepResult
from remotehead.step_options import StepOptions, check_option_names

T = TypeVar("T")

# Relative tolerance of the upstream-gradient check (the C++ client's kUpstreamTolerance).
UPSTREAM_RELATIVE_TOLERANCE = 1e-6


def upstream_matches_declared(declared: float, got: float) -> bool:
    """Whether a backward's dL/dloss `got` is the upstream gradient `declared` up front
    (upstream_scale), for which the server accumulated dW: equal, or within 1e-6 of |declared|
    (relative: a loss scale of 65536 and one of 1e-3 are held to the same precision). NaN
    matches nothing. `declared` is never 0 (RemoteHead refuses it up front).

    The C++ client's remotehead::client::UpstreamMatchesDeclared; both are tested against
    tests/data/upstream_scale_cases.json."""
    if got == declared:
        return True
    return abs(got - declared) <= UPSTREAM_RELATIVE_TOLERANCE * abs(declared)


def _check_declared_upstream(scale: float, field: str) -> None:
    """A declared upstream gradient must be finite and non-zero (dX is rescaled by
    dL/dloss / scale), as the C++ client's RemoteHead::Attach requires."""
    if not (math.isfinite(scale) and scale != 0):
        raise InvalidArgumentError(f"{field}: expected a finite non-zero value; got {scale}")


def _loss_tensor(loss: float, hidden: torch.Tensor) -> torch.Tensor:
    """The reduced loss as a 0-d float32 tensor (float64 for float64 hidden) on hidden's
    device, as the C++ RemoteHead: a bf16 loss would round away what the server summed in
    fp32."""
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return torch.tensor(loss, dtype=dtype, device=hidden.device)


def _check_plain_rows(t: Optional[torch.Tensor], field: str) -> None:
    """Refuses hidden states that are a DTensor (a tensor- or sequence-parallel body: each rank
    holds a shard or a replica of the rows): sending its local part would drop rows or count
    them twice. Refused with what to do rather than guessed."""
    if t is None or not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        raise InvalidArgumentError(
            f"{field}: expected a torch.Tensor; got a DTensor (placements {tuple(t.placements)} "
            f"on {t.device_mesh}: a tensor- or sequence-parallel body). The head takes plain "
            f"rows: call {field}.full_tensor() (or redistribute(placements=[Replicate()])"
            f".to_local()) before the head, or leave the last hidden states out of the "
            f"parallel plan (FSDP2 and DDP bodies give plain tensors)")


@dataclasses.dataclass
class _Inputs:
    """The per-token inputs of one call, besides hidden and targets."""

    weights: Optional[torch.Tensor] = None
    aux: Optional[Mapping[str, torch.Tensor]] = None
    teacher_hidden: Optional[torch.Tensor] = None  # a two-head function's teacher rows


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, head, options, inputs, pull):
        result = head._resilient(lambda: head.client.forward_backward(
            head.head_id, hidden, targets, head._current(options), weights=inputs.weights,
            aux=inputs.aux, teacher_hidden=inputs.teacher_hidden))
        head._journal_call(hidden, targets, options, inputs)
        head.last_result = result
        ctx.save_for_backward(result.grad_hidden.to(hidden.device, hidden.dtype)
                              .reshape(hidden.shape))
        ctx.upstream_scale = options.upstream_scale
        ctx.accumulated = options.accumulate
        ctx.head, ctx.pull = head, pull
        return _loss_tensor(result.loss, hidden)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_hidden,) = ctx.saved_tensors
        scale = ctx.upstream_scale
        upstream = float(grad_loss)
        if ctx.accumulated and not upstream_matches_declared(scale, upstream):
            raise RemoteheadError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"RemoteHead.loss: backward got dL/dloss = {upstream}, but the server "
                f"accumulated dW for upstream_scale = {scale} in the forward; declare the factor "
                f"up front (upstream_scale, or the normalizer for gradient accumulation), or "
                f"pass accumulate=False for a frozen head")
        if ctx.pull:
            ctx.head.pull_gradients()
        if upstream == scale:
            return grad_hidden, None, None, None, None, None  # dX as the server sent it
        # dX is linear in the upstream scalar: the server computed it for `scale`.
        return grad_hidden * (grad_loss / scale), None, None, None, None, None


class _TwoPhaseOutputs(torch.autograd.Function):
    """Per-token outputs now (a Forward, which keeps its rows on the server), dL/dy later (a
    Backward by handle: only dL/dy travels; X is re-sent if the handle has expired). The
    Backward is pinned to the weight version the Forward saw: after an optimizer step in
    between it fails with FAILED_PRECONDITION instead of mixing two versions (as the C++
    client's TokenOutputsFunction)."""

    @staticmethod
    def forward(ctx, hidden, targets, head, options, inputs, pull):
        result = head._resilient(lambda: head.client.forward(
            head.head_id, hidden, targets, head._current(options), weights=inputs.weights,
            aux=inputs.aux, teacher_hidden=inputs.teacher_hidden))
        head.last_result = result
        ctx.head, ctx.options, ctx.inputs, ctx.targets, ctx.pull = (head, options, inputs,
                                                                    targets, pull)
        ctx.handle = result.summary.inputs_handle
        ctx.forward_version = result.summary.weight_version
        ctx.save_for_backward(hidden)
        return result.outputs.to(hidden.device).reshape(hidden.shape[:-1])

    @staticmethod
    def backward(ctx, grad_outputs):
        (hidden,) = ctx.saved_tensors
        head, inputs = ctx.head, ctx.inputs
        options = ctx.options.replace(retain_inputs_seconds=0.0)
        # The gradient belongs to the weights the outputs were computed with.
        if options.expected_weight_version is None:
            options = options.replace(expected_weight_version=ctx.forward_version)
        grad = grad_outputs.detach().float().reshape(-1)

        def backward(o):
            return head.client.backward(head.head_id, hidden, ctx.targets, grad,
                                        head._current(o), weights=inputs.weights, aux=inputs.aux,
                                        teacher_hidden=inputs.teacher_hidden)

        def call():
            if not ctx.handle:
                return backward(options)
            try:
                return backward(options.replace(inputs_handle=ctx.handle))
            except RemoteheadError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
                # The server no longer has the rows (they expired, a Backward whose answer was
                # lost released them, the trainer moved to another replica): send them again,
                # same identity, same version.
                return backward(options)

        result = head._resilient(call)
        head._journal_call(hidden, ctx.targets, options, inputs, grad_output=grad)
        head.last_result = result
        if ctx.pull:
            head.pull_gradients()
        return result.grad_hidden.to(hidden.device, hidden.dtype).reshape(hidden.shape), None, \
            None, None, None, None


def _kept_by(part: str, name: str, doc: str) -> property:
    """A RemoteHead attribute that its part `part` keeps: read and set through the head, as
    a plain attribute."""
    return property(lambda head: getattr(getattr(head, part), name),
                    lambda head, value: setattr(getattr(head, part), name, value), doc=doc)


class RemoteHead:
    """The LM head `head_id` on a server, used as `loss = head.loss(hidden, labels)`.

    `options` (a StepOptions) and keyword overrides of its fields are the defaults of every
    call (help(remotehead.StepOptions) lists them); each call may override them again, its
    `params` merged over these. The head is described once here: hidden states are sent in
    the head's dtype (wire_dtype) and dX comes back in the caller's. upstream_scale must be
    finite and non-zero.

    Each call is one micro-batch of gradient identity (trainer, step, micro_batch): replays
    (client retries) are recognised by the server and not added twice. `next_step()` (called by
    `optimizer_step()`) moves to the next step. The trainer is `trainer`, else
    options.gradient_id's, else a random one — among several data-parallel processes
    suffixed with the rank (Cluster.rank_trainer), since each rank's dW must keep its own
    identity; options.gradient_id also gives the first step and micro-batch.

    `cluster` (default: remotehead.cluster.detect(): torch.distributed, else torchrun's
    environment) is the data-parallel trainer processes this one is a rank of: with more than
    one, optimizer_step() is the synchronous step of all of them (applied once, dW averaged
    over the ranks as DDP does).
    """

    info = _kept_by("_state", "info", "HeadInfo: the head as this trainer last left it (its "
                    "weight_version is the version the trainer holds).")
    incarnation = _kept_by("_state", "incarnation",
                           "The server process (HeadInfo.incarnation) this trainer's steps "
                           "belong to.")
    cluster = _kept_by("_state", "cluster", "The data-parallel processes this one is a rank of.")
    trainer = _kept_by("_state", "trainer", "The trainer of this process's gradient identities.")
    step = _kept_by("_state", "step", "The step of the next gradient identity.")
    micro_batch = _kept_by("_state", "micro_batch",
                           "The micro-batch of the next gradient identity.")
    local_weight = _kept_by("_local", "weight",
                            "The trainer's parameter the server mirrors (None: the head is "
                            "trained by server-side optimizer steps).")

    def __init__(self, client: Client, head_id: str, options: Optional[StepOptions] = None, *,
                 trainer: Optional[str] = None,
                 local_weight: Optional[torch.nn.Parameter] = None,
                 cluster: Optional[cluster_lib.Cluster] = None, journal: bool = True,
                 **overrides):
        explicit_retain = options is not None or "retain_inputs_seconds" in overrides
        options = (options if options is not None else StepOptions()).replace(**overrides)
        _check_declared_upstream(options.upstream_scale, "upstream_scale")
        self.client = client
        self.head_id = head_id
        info = client.describe_head(head_id)
        cluster = cluster if cluster is not None else cluster_lib.detect()
        self._local = LocalWeightMirror(local_weight, cluster)
        self._state = StepState(info, cluster, trainer, options.gradient_id)
        # Identities are handed out per call; the server computes in the head's dtype.
        self.options = options.replace(
            gradient_id=None,
            wire_dtype=options.wire_dtype if options.wire_dtype is not None else info.dtype)
        self.last_result: Optional[StepResult] = None
        # How long a two-phase Forward's rows wait on the server for the Backward: the options'
        # retain_inputs_seconds when given (0: the Backward sends X again), else 600 s.
        self.retain_seconds = options.retain_inputs_seconds if explicit_retain else 600.0
        self._teacher_dtypes = {}  # teacher head id -> its dtype (teacher_hidden is sent in it)
        # What this trainer resends after a move to another replica of a mesh (_replay_journal).
        self.journal: Optional[ReplayJournal] = ReplayJournal() if journal else None
        self._left_incarnations = set()  # the fronts this trainer moved away from
        self._replica = client.replica  # the replica holding this trainer's dW since its step

    @property
    def accumulate(self) -> bool:
        """Whether calls with gradients add dW on the server (False: a frozen head)."""
        return self.options.accumulate

    def _call_options(self, overrides: dict, gradients: bool, two_phase: bool) -> StepOptions:
        """The options of one call (the C++ client's MakeCall): the head's, the call's
        overrides over them (params merged), a fresh gradient identity when it accumulates,
        and retained inputs only for a two-phase Forward with a Backward to come."""
        check_option_names(overrides)
        retain = overrides.get("retain_inputs_seconds", self.retain_seconds)
        o = self.options.replace(**{
            "valid_tokens": None, "inputs_handle": "", **overrides,
            "params": {**self.options.params, **(overrides.get("params") or {})}})
        _check_declared_upstream(o.upstream_scale, "upstream_scale")
        accumulate = o.accumulate and gradients
        gradient_id = None
        if accumulate:
            gradient_id = o.gradient_id or self._state.next_gradient_id()
        return o.replace(accumulate=accumulate, gradient_id=gradient_id,
                         retain_inputs_seconds=retain if two_phase and gradients else 0.0,
                         expected_incarnation=overrides.get("expected_incarnation",
                                                            self.incarnation))

    def _teacher_rows(self, options: StepOptions,
                      teacher_hidden: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """teacher_hidden in the dtype of the teacher head the options name (described once per
        teacher), detached: the server computes the teacher's logits in its head's dtype."""
        if teacher_hidden is None or not options.teacher:
            return teacher_hidden
        dtype = self._teacher_dtypes.get(options.teacher)
        if dtype is None:
            dtype = self.client.describe_head(options.teacher).dtype
            self._teacher_dtypes[options.teacher] = dtype
        if not teacher_hidden.dtype.is_floating_point:
            return teacher_hidden  # refused by the client, naming teacher_hidden
        return teacher_hidden.detach().to(dtype)

    def loss(self, hidden: torch.Tensor, labels: Optional[torch.Tensor], *,
             weights: Optional[torch.Tensor] = None,
             aux: Optional[Mapping[str, torch.Tensor]] = None,
             teacher_hidden: Optional[torch.Tensor] = None, pull_gradients: bool = True,
             **overrides) -> torch.Tensor:
        """The reduced loss of the head's function over `hidden` [..., D] and `labels` [...]
        (one ForwardBackward; a Forward, nothing accumulated, under torch.no_grad() or when
        hidden does not require grad). weights / aux: per-token inputs shaped like labels;
        teacher_hidden: a two-head function's teacher rows (see distill()); overrides:
        StepOptions fields for this call. With a local_weight, pull_gradients=False defers the
        pull of dW into local_weight.grad (e.g. until the last micro-batch of a
        gradient-accumulation window). labels None: a function that needs no targets, every
        row counted."""
        _check_plain_rows(hidden, "hidden")
        _check_plain_rows(teacher_hidden, "teacher_hidden")
        self.push_weights()
        gradients = torch.is_grad_enabled() and hidden.requires_grad
        options = self._call_options(overrides, gradients, two_phase=False)
        teacher_hidden = self._teacher_rows(options, teacher_hidden)
        if options.reduction == "none":
            raise InvalidArgumentError(
                'reduction: loss() needs a scalar reduction ("sum", "mean" or "weighted_sum"); '
                'got "none" — use token_outputs() for per-token outputs')
        if not gradients:
            result = self._resilient(lambda: self.client.forward(
                self.head_id, hidden, labels, self._current(options), weights=weights, aux=aux,
                teacher_hidden=teacher_hidden))
            self.last_result = result
            return _loss_tensor(result.loss, hidden)
        return _FusedHeadLoss.apply(hidden, labels, self, options,
                                    _Inputs(weights, aux, teacher_hidden),
                                    self._local.pulls_after_backward(options.accumulate,
                                                                     pull_gradients))

    def distill(self, hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                targets: Optional[torch.Tensor] = None, *, mask: Optional[torch.Tensor] = None,
                function: Optional[str] = None, teacher: Optional[str] = None,
                pull_gradients: bool = True, **overrides) -> torch.Tensor:
        """A distillation loss of this (student) head against a frozen teacher head on the same
        server: the reduced divergence between the two heads' next-token distributions over
        the rows of `hidden` [..., D] (the student's last hidden states) and `teacher_hidden`
        [..., D_teacher] (the teacher's, for the same tokens; D_teacher may differ from D, the
        vocabulary must not). One ForwardBackward (a Forward under no_grad): loss.backward()
        gives hidden its dX; dW accumulates on this head only.

        function: a two-head function the server lists (FunctionInfo.needs_teacher):
            "distill_kl" (forward KL(teacher ‖ student)), "distill_reverse_kl", "distill_jsd"
            (params beta); default: the head's function if it is one, else "distill_kl".
        teacher: the teacher head's id (default: the head's `teacher` option).
        targets [...]: token ids, needed with params alpha > 0 (the CE mix); ignore_index rows
            are left out. mask [...] (1 = in the loss, e.g. a completion mask): rows where it is 0
            are left out (targets set to ignore_index there; 0 elsewhere when targets is None).
        overrides: StepOptions fields (params: alpha, beta, temperature, logit_scale, softcap,
            teacher_logit_scale, teacher_softcap; reduction, normalizer, …). The summary of the
            call (self.last_result.summary.extras: "divergence", "entropy", "nll") holds the
            sums over the valid rows.
        """
        if function is None:
            current = self.client.functions().get(self.options.function)
            function = (self.options.function if current is not None and current.needs_teacher
                        else "distill_kl")
        if teacher is not None:
            overrides["teacher"] = teacher
        if mask is not None:
            ignore = overrides.get("ignore_index", self.options.ignore_index)
            keep = mask.to(hidden.device if targets is None else targets.device) != 0
            base = targets if targets is not None else torch.zeros(keep.shape, dtype=torch.long,
                                                                    device=keep.device)
            targets = base.masked_fill(~keep, ignore)
        return self.loss(hidden, targets, teacher_hidden=teacher_hidden,
                         pull_gradients=pull_gradients, function=function, **overrides)

    def token_outputs(self, hidden: torch.Tensor, targets: Optional[torch.Tensor], *,
                      function: str = "token_logprobs",
                      weights: Optional[torch.Tensor] = None,
                      aux: Optional[Mapping[str, torch.Tensor]] = None,
                      teacher_hidden: Optional[torch.Tensor] = None,
                      pull_gradients: bool = True, **overrides) -> torch.Tensor:
        """Per-token outputs of `function` (default token_logprobs, whatever the head's
        function for loss() is; [...] like targets), differentiable on the two-phase path: the
        trainer combines them as it likes and backward() sends dL/dy to the server (dW
        accumulated there). The Forward keeps its rows on the server (retain_inputs_seconds,
        default `retain_seconds`) so that the Backward sends only dL/dy."""
        _check_plain_rows(hidden, "hidden")
        _check_plain_rows(teacher_hidden, "teacher_hidden")
        self.push_weights()
        gradients = torch.is_grad_enabled() and hidden.requires_grad
        overrides = {**overrides, "function": function, "reduction": "none"}
        options = self._call_options(overrides, gradients, two_phase=True)
        teacher_hidden = self._teacher_rows(options, teacher_hidden)
        if not gradients:
            result = self._resilient(lambda: self.client.forward(
                self.head_id, hidden, targets, self._current(options), weights=weights, aux=aux,
                teacher_hidden=teacher_hidden))
            self.last_result = result
            return result.outputs.to(hidden.device).reshape(hidden.shape[:-1])
        return _TwoPhaseOutputs.apply(hidden, targets, self, options,
                                      _Inputs(weights, aux, teacher_hidden),
                                      self._local.pulls_after_backward(options.accumulate,
                                                                       pull_gradients))

    def next_step(self) -> None:
        self._state.next_step()

    def optimizer_step(self, **optimizer) -> None:
        """A server-side optimizer step on the accumulated dW (then zeroed), e.g.
        optimizer_step(adamw=dict(lr=1e-3, weight_decay=0.0)). Among several data-parallel
        processes it is their synchronous step `self.step`, pinned to the version this trainer
        holds: it returns once every rank asked for it, and dW is averaged over the ranks as DDP
        averages gradients."""
        self.info = self._resilient(lambda: self.client.optimizer_step(
            self.head_id, **self._state.optimizer_step_arguments(dict(optimizer))))
        if self.journal is not None:
            self.journal.clear()  # applied: nothing of it is resent
        self.next_step()

    # ----- durable training state (a server started with --state_dir) -----

    def save_state(self) -> HeadInfo:
        """Saves the head's whole training state on the server; info.state_id names it (keep it
        with the trainer's checkpoint)."""
        self.info = self.client.save_head_state(self.head_id)
        return self.info

    def restore_state(self, state_id: str, step: Optional[int] = None) -> HeadInfo:
        """Puts the head back to a saved state (weights, optimizer state, version) — e.g. when
        the trainer resumes from the checkpoint that state was saved with, after a server
        restart — and continues with this server process. `step`: the trainer's step to
        continue gradient identities from."""
        self._state.restored(self.client.restore_head_state(self.head_id, state_id), step)
        return self.info

    # ----- a head whose parameter lives in the trainer (local_weight) -----

    def push_weights(self) -> None:
        """Sends local_weight to the server if it may have changed since the last push (a pull
        of its gradient, hence an optimizer step; an in-place edit): the server then computes
        with exactly the trainer's parameter."""
        info = self._local.push(self.client, self.head_id)
        if info is not None:
            self.info = info

    def pull_gradients(self) -> None:
        """Adds the server's accumulated dW into local_weight.grad and zeroes it on the server,
        so the local optimizer (and gradient clipping) sees the head's gradient like any other.
        """
        if self._local.pull(self.client, self.head_id):
            if self.journal is not None:
                self.journal.clear()  # dW taken into local_weight.grad
            self.next_step()

    # ----- a trainer that moves to another replica of a mesh (docs/meshes.md) -----

    def _current(self, options: StepOptions) -> StepOptions:
        """`options` pinned to the front this trainer dials now (its incarnation, after a
        move)."""
        if options.expected_incarnation in self._left_incarnations:
            return options.replace(expected_incarnation=self.incarnation)
        return options

    def _resilient(self, call: Callable[[], T]) -> T:
        """`call()`, again after the trainer moved to another replica's front
        (ReplicaMovedError): first what the journal holds is sent there."""
        if self.client.replica != self._replica:  # another call of the client noticed the move
            info = self.client.describe_head(self.head_id)
            self._moved(ReplicaMovedError("moved before this call", self._replica,
                                          self.client.replica, info))
        for _ in range(8):  # one move per replica lost while the call runs
            try:
                return call()
            except ReplicaMovedError as moved:
                self._moved(moved)
            except ServerRestartedError as restarted:
                self._moved(self._healed(restarted))
        return call()

    def _healed(self, restarted: ServerRestartedError) -> ReplicaMovedError:
        """This trainer's front restarted (`restarted`): on a mesh whose replica was evicted
        and then admitted again and healed (docs/meshes.md), its new process holds the mesh's
        weights at this trainer's version (or past it, the step in flight applied) and what the
        old process took is to be sent again — a move to the same replica. Anything else
        (a server on its own, a mesh restarted from an older state) is `restarted` itself."""
        if not self.client.meshed:
            raise restarted
        info = self.client.describe_head(self.head_id)
        if info.incarnation == self.incarnation or info.weight_version < self.info.weight_version:
            raise restarted
        return ReplicaMovedError(f"replica {self._replica}'s front restarted and was healed "
                                 f"({restarted.details})", self._replica, self._replica, info)

    def _moved(self, moved: ReplicaMovedError) -> None:
        lost = self.incarnation
        self._replica = moved.to_replica
        self._left_incarnations.add(self.incarnation)
        self._state.incarnation = moved.info.incarnation
        if moved.info.weight_version > self.info.weight_version:
            # The step in flight was applied after all (with this trainer's dW): nothing to
            # resend; the step asked again gets its answer.
            if self.journal is not None:
                self.journal.clear()
            return
        if moved.kept:  # the front left still serves, with this trainer's dW
            return
        if self.journal is None:
            raise moved
        self.client.replays += self.journal.replay(lost, self.incarnation)

    def _journal_call(self, hidden: torch.Tensor, targets: Optional[torch.Tensor],
                      options: StepOptions, inputs: _Inputs,
                      grad_output: Optional[torch.Tensor] = None) -> None:
        """A call that added dW kept for a move (a Backward when grad_output is given)."""
        if self.journal is None or not options.accumulate:
            return
        h, t, g = host_copy(hidden), host_copy(targets), host_copy(grad_output)
        w, th = host_copy(inputs.weights), host_copy(inputs.teacher_hidden)
        aux = {k: host_copy(v) for k, v in inputs.aux.items()} if inputs.aux else None
        kept = options.replace(inputs_handle="", retain_inputs_seconds=0.0)
        client, head_id = self.client, self.head_id

        def resend(incarnation: str) -> None:
            o = kept.replace(expected_incarnation=incarnation)
            if g is None:
                client.forward_backward(head_id, h, t, o, weights=w, aux=aux, teacher_hidden=th)
            else:
                client.backward(head_id, h, t, g, o, weights=w, aux=aux, teacher_hidden=th)

        self.journal.record(resend, self.incarnation, h, t, g, w, th, *(aux or {}).values())

    def _journal_embedding(self, ids: torch.Tensor, rows: torch.Tensor, gradient_id,
                           version: int) -> None:
        """A tied embedding's gradient (RemoteEmbedding) kept for a move."""
        if self.journal is None:
            return
        i, r = host_copy(ids), host_copy(rows)
        client, head_id = self.client, self.head_id
        self.journal.record(lambda incarnation: client.embedding_gradient(
            head_id, i, r, gradient_id=gradient_id, expected_incarnation=incarnation,
            expected_weight_version=version), self.incarnation, i, r)
