"""The functions a server computes, as it lists them (the ListFunctions RPC): names, parameters
with their defaults and ranges, aux inputs, what a Forward with reduction "none" returns and in
which dtype, whether a head group runs it, whether it compares two heads (a distillation's
teacher), which aux inputs are [N, k] or integral, and the per-token diagnostics it reports. Clients decide from this data, never from a
function's name (`Client.functions()`, `remotehead functions`)."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from remotehead import _wire
from remotehead.v1 import head_service_pb2 as pb

_OUTPUT_KINDS = {
    pb.OUTPUT_KIND_PER_TOKEN: "per_token",  # outputs [N]
    pb.OUTPUT_KIND_LOGITS: "logits",  # outputs [N, V]
    pb.OUTPUT_KIND_SAMPLE: "sample",  # token_ids [N] int64 and outputs [N] their log-probs
}


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str
    default: float
    min: float  # inclusive
    max: float  # inclusive (may be inf)
    help: str
    common: bool  # accepted by every function (temperature, softcap)


@dataclasses.dataclass(frozen=True)
class ExtraInfo:
    """A per-token diagnostic a function reports: summed in StepSummary.extras, and returned per
    token when a step names it (StepOptions.token_extras)."""

    name: str
    help: str
    when_param: str = ""  # reported only when this param is > 0 ("": always)
    when_aux: str = ""  # reported only when this aux input is sent ("": always)


@dataclasses.dataclass(frozen=True)
class FunctionInfo:
    name: str
    help: str
    needs_targets: bool
    required_aux: Tuple[str, ...]
    optional_aux: Tuple[str, ...]
    params: Tuple[ParamInfo, ...]
    output_kind: str  # "per_token", "logits" or "sample"
    output_dtype: torch.dtype  # of the outputs on a head of any dtype but float64
    output_float64_on_float64_heads: bool
    differentiable: bool  # False: a generation output (Forward, reduction "none" only)
    vocab_decomposable: bool  # True: runs on a head group
    # A two-head (distillation) function: the step names a frozen teacher head
    # (StepOptions.teacher) and sends the teacher's hidden states (teacher_hidden).
    needs_teacher: bool = False
    topk_aux: Tuple[str, ...] = ()  # aux inputs that are [N, k] (k per token), not [N]
    integral_aux: Tuple[str, ...] = ()  # aux inputs of an integer dtype (e.g. token ids)
    extras: Tuple[ExtraInfo, ...] = ()  # its per-token diagnostics (StepOptions.token_extras)
    # True: a row whose target is ignore_index contributes nothing (no output, dX, dW, nor a
    # place in a mean's count): the client leaves such rows out (StepOptions.compact_rows) and
    # puts zeros in their place in dX, per-token outputs and token extras.
    ignored_rows_contribute_nothing: bool = False

    def outputs_dtype(self, head_dtype: torch.dtype,
                      requested: Optional[torch.dtype] = None) -> torch.dtype:
        """The dtype of a Forward's outputs with reduction "none" on a head of `head_dtype`
        (`requested`: StepOptions.output_dtype, which overrides a logits function's)."""
        if self.output_kind == "logits" and requested is not None:
            return requested
        if self.output_float64_on_float64_heads and head_dtype == torch.float64:
            return torch.float64
        return self.output_dtype

    def to_dict(self) -> Dict[str, object]:
        d = dataclasses.asdict(self)
        d["output_dtype"] = str(self.output_dtype).replace("torch.", "")
        return d


def function_info(msg: pb.FunctionDescription) -> FunctionInfo:
    return FunctionInfo(
        name=msg.name, help=msg.help, needs_targets=msg.needs_targets,
        required_aux=tuple(msg.required_aux), optional_aux=tuple(msg.optional_aux),
        params=tuple(ParamInfo(p.name, p.default_value, p.min_value, p.max_value, p.help,
                               p.common) for p in msg.params),
        output_kind=_OUTPUT_KINDS.get(msg.output_kind, "per_token"),
        output_dtype=_wire._FROM_WIRE[msg.output_dtype],
        output_float64_on_float64_heads=msg.output_float64_on_float64_heads,
        differentiable=msg.differentiable, vocab_decomposable=msg.vocab_decomposable,
        needs_teacher=msg.needs_teacher, topk_aux=tuple(msg.topk_aux),
        integral_aux=tuple(msg.integral_aux),
        extras=tuple(ExtraInfo(e.name, e.help, e.when_param, e.when_aux) for e in msg.extras),
        ignored_rows_contribute_nothing=msg.ignored_rows_contribute_nothing)
