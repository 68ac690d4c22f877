"""Rows that contribute nothing do not travel: for a function whose listing says a row with
target == ignore_index contributes nothing (FunctionInfo.ignored_rows_contribute_nothing), a step
sends only the other rows (StepOptions.compact_rows, on by default) and the results are put back
in place, zeros in the rows left out. The server drops such rows itself before it computes, so
the results are the same bits either way. The C++ client's twin is CompactRows
(client/cpp/src/prepare_step.cc): both leave out the same rows, so both send the same messages.
"""

from __future__ import annotations

import collections
import threading
from typing import Optional, Tuple, Union

import torch

from remotehead.functions import FunctionInfo
from remotehead.step_options import StepOptions


def may_compact(o: StepOptions, targets) -> bool:
    """Whether a step might leave rows out (then the function's listing is needed to decide)."""
    return o.compact_rows and targets is not None


def compacts(o: StepOptions, fn: Optional[FunctionInfo]) -> bool:
    """Whether a step leaves out the rows that contribute nothing: asked (compact_rows) and the
    function, as the server lists it, says they contribute nothing."""
    return o.compact_rows and fn is not None and fn.ignored_rows_contribute_nothing


# What a step leaves out: True (the rows whose target is ignore_index), False (nothing), or the
# rows to keep as its forward kept them ((index [k] int64, the caller's rows): a backward by the
# forward's inputs_handle).
Compaction = Union[bool, Tuple[torch.Tensor, int]]


def compact(p, ignore_index: int, rows: Compaction = True) -> None:
    """Leaves out of the prepared step `p` (a _steps.PreparedStep, before its row plan) the rows
    whose target is ignore_index (or, given `rows` (index, N), all but those rows): every per-row
    tensor that travels keeps only the other rows, the header says their number, and p.kept
    records which rows of the caller's they are. A step without targets, or that ignores no row,
    is left as it is."""
    if rows is False:
        return
    if rows is True:
        if p.targets is None:
            return
        keep = (p.targets != ignore_index).nonzero().reshape(-1)
    else:
        keep, caller_rows = rows
        if caller_rows != p.rows:
            return  # not the forward's rows: the server says what is wrong
    if keep.numel() == p.rows:
        return
    p.kept, p.caller_rows = keep, p.rows
    for name in ("hidden", "targets", "weights", "grad_output", "teacher_hidden"):
        t = getattr(p, name)
        if t is not None:
            setattr(p, name, t.index_select(0, keep))
    p.aux = [(name, t.index_select(0, keep)) for name, t in p.aux]
    p.rows = int(keep.numel())
    p.header.rows = p.rows


def expand(p, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A result of the rows sent ([rows sent, ...]) in the caller's rows ([N, ...]): zeros in the
    rows left out. As it is when nothing was left out."""
    if t is None or p.kept is None:
        return t
    full = t.new_zeros((p.caller_rows, *t.shape[1:]))
    full.index_copy_(0, p.kept, t)
    return full


class HandleRows:
    """The rows each forward that kept its inputs on the server (retain_inputs_seconds) left out,
    by its inputs_handle: a backward by that handle sends grad_output for the same rows — whether
    or not it is given the targets — and gets dX back in the caller's rows. Forgotten when the
    backward succeeds; at most `limit` handles are kept (the oldest go first)."""

    def __init__(self, limit: int = 4096):
        self._rows: "collections.OrderedDict[str, Tuple[torch.Tensor, int]]" = (
            collections.OrderedDict())
        self._limit = limit
        self._lock = threading.Lock()

    def for_step(self, backward_by_handle: str, o: StepOptions,
                 fn: Optional[FunctionInfo]) -> Compaction:
        """What a step leaves out: a backward by a handle what its forward left out (nothing if
        that forward left out nothing or was not this client's), any other step as compacts()."""
        if backward_by_handle:
            with self._lock:
                return self._rows.get(backward_by_handle, False)
        return compacts(o, fn)

    def after_step(self, p, handle: str, backward_by_handle: str) -> None:
        """Remembers what a forward that kept its inputs under `handle` left out; forgets a
        handle whose backward succeeded."""
        with self._lock:
            if backward_by_handle:
                self._rows.pop(backward_by_handle, None)
            if handle and p.kept is not None:
                self._rows[handle] = (p.kept, p.caller_rows)
                while len(self._rows) > self._limit:
                    self._rows.popitem(last=False)
