"""What a step call computes: StepOptions (the StepHeader of the wire contract), and the
GradientId of the contribution an accumulating step adds.

Every step call (Client.forward_backward / forward / backward, RemoteHead.loss / distill /
token_outputs) takes a StepOptions or its fields as keyword arguments. How options become a
step's header and messages is _steps.py's (prepare_step).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from remotehead._errors import InvalidArgumentError
from remotehead.v1 import head_service_pb2 as pb

# The reductions a step may ask for, and their wire values (prepare_step writes them).
_REDUCTIONS = {
    "none": pb.REDUCTION_NONE,
    "sum": pb.REDUCTION_SUM,
    "mean": pb.REDUCTION_MEAN,
    "weighted_sum": pb.REDUCTION_WEIGHTED_SUM,
}


class GradientId(NamedTuple):
    """Identity of one gradient contribution: the server adds a given identity's dW at most once
    between two zeroings of the head's gradients. A plain (trainer, step, micro_batch) tuple is
    accepted wherever a GradientId is."""

    trainer: str  # e.g. "run-7/rank-3"
    step: int = 0  # optimizer step
    micro_batch: int = 0  # micro-batch within the step


@dataclasses.dataclass
class StepOptions:
    """What a step computes: the StepHeader of the wire contract (the C++ client's StepSpec).

    Per-token inputs (weights, aux, grad_output) are arguments of the step calls, not options.
    The step calls also take any of these fields as keyword arguments, applied over `options`.

    Attributes:
        function: the server's transformation function by name, one that Client.functions()
            lists (e.g. "cross_entropy", "token_logprobs", "grpo"); for generation (forward,
            reduction "none", no targets), "logits" or "sample" (Client.logits, Client.sample).
        params: the function's scalar options by name, e.g. {"label_smoothing": 0.1},
            {"temperature": 0.7}, GRPO's {"beta": 0.04, "epsilon_low": 0.2}.
        reduction: "none" (per-token outputs: Forward and Backward only), "sum", "mean" (over
            targets != ignore_index) or "weighted_sum" (Σ weight·y; needs per-token weights).
        ignore_index: targets equal to it are ignored (no loss, no gradient).
        normalizer: divides the reduced sum when set, e.g. the valid tokens of a whole
            accumulated batch across micro-batches and ranks (num_items_in_batch).
        valid_tokens: for a "mean" without normalizer the server needs the number of
            targets != ignore_index over all rows up front. None: the client counts it from the
            targets (all rows when there are none).
        chunk_rows: rows per chunk inside the server. 0 (with memory_budget_bytes 0): the
            server's default memory budget.
        memory_budget_bytes: the server sizes its chunks to this many bytes (0: its default).
        upstream_scale: forward_backward: dL/d(loss), e.g. a loss scale; dX and dW come back
            multiplied by it. (backward takes dL/d(loss) as its grad_output instead.)
        accumulate: forward_backward / backward: add dW on the server (False: dX only, e.g. a
            frozen head). forward never accumulates.
        gradient_id: (trainer, step, micro_batch) of this contribution; required when
            accumulating (the server refuses an accumulating step without one). Retries of one
            call keep it, so the server adds the contribution at most once.
        expected_weight_version: the step fails with FAILED_PRECONDITION unless the head is at
            this version (None: any version).
        wire_dtype: hidden is converted to this dtype before it is sent: the head's dtype, in
            which the server computes. None: sent as it is. dX comes back in hidden's own dtype.
        retain_inputs_seconds: forward only: the server keeps the rows (hidden, targets,
            weights, aux) for at most this many seconds, so that backward can name them by
            summary.inputs_handle instead of sending X again. 0: keep nothing.
        inputs_handle: backward only: a forward's summary.inputs_handle. Only grad_output then
            travels (nothing at all for a scalar reduction); hidden still gives N, D and dX's
            dtype, and targets (or valid_tokens) the count a "mean" without normalizer needs.
            The handle is refused once the head's weights moved on, and forgotten after a
            successful backward (NOT_FOUND).
        expected_incarnation: the server process (HeadInfo.incarnation) this step belongs to;
            a restarted server refuses it (ServerRestartedError) instead of adding dW to a
            window it no longer has. "": unchecked. RemoteHead sets it.
        output_dtype: forward with function "logits" only: the dtype of the returned logits
            rows (None: float32). Client.logits() sets it.
        logits_dtype: the dtype the server's GEMM forms the logits z = X·Wᵀ in, for any
            function (a two-head function's teacher alike). None: the head's dtype (a bfloat16
            head's logits are rounded to bfloat16 before the function upcasts them).
            torch.float32: fp32 logits from the head's bfloat16 / float16 weights, with no
            half-precision rounding of the logits or their gradient, e.g. RL log-probs that
            must agree with a trainer's fp32 logits, or a distillation loss to match TRL's;
            changes nothing on a float32 / float64 head. Anything else is refused by the
            server (InvalidArgumentError). Costs: docs/engine.md, "fp32 logits from bf16
            weights".
        teacher: a two-head (distillation) function's teacher (FunctionInfo.needs_teacher,
            e.g. "distill_kl"): the id of a frozen head on the same server (or group) with the
            student's vocabulary (StepHeader.teacher_head_id); the step call's teacher_hidden
            are its hidden states. The teacher gets no gradient. "": none (refused by the
            server for a function that needs one, and for every other function when set).
        token_extras: names of the function's extras (FunctionInfo.extras, e.g. a
            distillation's "entropy") to return per token as well as summed, in any call:
            StepResult.token_extras[name] is [N] (0 at ignored rows). Only extras the call
            reports (their condition met) may be named; the server refuses any other.
        compact_rows: leave out the rows whose target is ignore_index when the function says
            they contribute nothing (FunctionInfo.ignored_rows_contribute_nothing, from the
            server's listing): only the other rows travel, and dX, per-token outputs and token
            extras come back with zeros in the rows left out. The results are the same bits as
            sending every row (the server drops those rows itself before it computes); False
            sends every row (e.g. to measure the difference). A backward by inputs_handle
            leaves out of its grad_output the rows its forward left out (the client remembers
            them by handle, targets given or not).
    """

    function: str = "cross_entropy"
    params: Dict[str, float] = dataclasses.field(default_factory=dict)
    reduction: str = "mean"
    ignore_index: int = -100
    normalizer: Optional[float] = None
    valid_tokens: Optional[int] = None
    chunk_rows: int = 0
    memory_budget_bytes: int = 0
    upstream_scale: float = 1.0
    accumulate: bool = True
    gradient_id: Optional[GradientId] = None
    expected_weight_version: Optional[int] = None
    wire_dtype: Optional[torch.dtype] = None
    retain_inputs_seconds: float = 0.0
    inputs_handle: str = ""
    expected_incarnation: str = ""
    output_dtype: Optional[torch.dtype] = None
    logits_dtype: Optional[torch.dtype] = None
    teacher: str = ""
    token_extras: Tuple[str, ...] = ()
    compact_rows: bool = True

    def __post_init__(self):
        if self.reduction not in _REDUCTIONS:
            raise InvalidArgumentError(f"reduction: expected one of {list(_REDUCTIONS)}; got "
                                       f"{self.reduction!r}")
        self.params = dict(self.params or {})
        if isinstance(self.token_extras, str):
            self.token_extras = (self.token_extras,)
        self.token_extras = tuple(self.token_extras or ())
        if self.gradient_id is not None and not isinstance(self.gradient_id, GradientId):
            self.gradient_id = GradientId(*self.gradient_id)

    def replace(self, **overrides) -> "StepOptions":
        """A copy with `overrides` applied; TypeError for a name that is not an option."""
        check_option_names(overrides)
        return dataclasses.replace(self, **overrides) if overrides else self


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(StepOptions))


def check_option_names(names) -> None:
    """TypeError naming the first of `names` that is not a StepOptions field."""
    unknown = [n for n in names if n not in _OPTION_NAMES]
    if unknown:
        raise TypeError(f"unknown step option {unknown[0]!r}; expected one of: "
                        f"{', '.join(_OPTION_NAMES)} (per-token inputs weights, aux and "
                        f"grad_output are arguments of their own)")
