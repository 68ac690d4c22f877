"""A step call without its transport: the messages it sends and what comes back (StepResult,
StepSummary, StepTimings). What it computes, StepOptions, is step_options.py's.

`prepare_step` is the Python twin of the C++ client's PrepareStep (client/cpp/src/prepare_step.cc):
for the same call both clients send the same StepHeader and split the rows into the same
messages (tests/python/test_conformance.py runs one list of calls through both and compares
what reached the server). `receive` reads one attempt's response stream into preallocated
results, checked as the C++ client's RowAssembler checks them. Client (client.py) sends and
retries; it is the only module here that talks gRPC.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import grpc
import torch

from remotehead import _compaction, _wire
from remotehead._errors import InvalidArgumentError, RemoteheadError, rename_field
from remotehead._wire import framing_bytes, shape_text
from remotehead.functions import FunctionInfo
from remotehead.step_options import _REDUCTIONS, StepOptions, check_option_names
from remotehead.v1 import head_service_pb2 as pb


@dataclasses.dataclass
class StepTimings:
    """Where a step's time went on the server (seconds). The phases overlap (rows arrive while
    earlier rows are computed and their results sent), so they need not add up to total."""

    queue_seconds: float = 0.0  # waiting for admission
    receive_wait_seconds: float = 0.0  # compute idle, waiting for rows from the client
    compute_seconds: float = 0.0  # engine time
    send_wait_seconds: float = 0.0  # compute paused: the client had not taken the results
    total_seconds: float = 0.0  # first message to summary, on the server


@dataclasses.dataclass
class StepSummary:
    """The server's summary of a step (the C++ client's StepSummary)."""

    loss: float = 0.0  # the reduced loss (fused, scalar forward); not × upstream_scale
    valid_tokens: int = 0
    denominator: float = 1.0
    extras: Dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. "nll", "kl"
    weight_version: int = 0  # the head version the result was computed against
    replayed: bool = False  # the gradient id had already been applied: nothing was added
    chunk_rows: int = 0
    num_chunks: int = 0
    inputs_handle: str = ""  # forward with retain_inputs_seconds: pass to backward
    incarnation: str = ""  # the server process that computed it (HeadInfo.incarnation)
    timings: StepTimings = dataclasses.field(default_factory=StepTimings)


@dataclasses.dataclass
class StepResult:
    loss: float  # the reduced loss (fused / scalar forward)
    # dX [N, D] in hidden's dtype (forward_backward, backward); × upstream_scale.
    grad_hidden: Optional[torch.Tensor]
    # forward: per-token outputs [N] for reduction "none" (float32; float64 for float64
    # hidden), else the 0-d float64 loss. Function "logits": [N, V] in output_dtype; "sample":
    # the drawn tokens' log-probabilities [N].
    outputs: Optional[torch.Tensor]
    summary: StepSummary
    token_ids: Optional[torch.Tensor] = None  # function "sample": the drawn tokens [N] int64
    # StepOptions.token_extras by name: [N] each (float32; float64 for float64 hidden), 0 at
    # ignored rows.
    token_extras: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def decode_summary(msg: pb.StepSummary) -> StepSummary:
    t = msg.timings
    return StepSummary(
        loss=msg.loss, valid_tokens=msg.valid_tokens, denominator=msg.denominator,
        extras=dict(msg.extras), weight_version=msg.weight_version, replayed=msg.replayed,
        chunk_rows=msg.chunk_rows, num_chunks=msg.num_chunks, inputs_handle=msg.inputs_handle,
        incarnation=msg.incarnation,
        timings=StepTimings(t.queue_seconds, t.receive_wait_seconds, t.compute_seconds,
                            t.send_wait_seconds, t.total_seconds))


FORWARD_BACKWARD, FORWARD, BACKWARD = "ForwardBackward", "Forward", "Backward"


@dataclasses.dataclass
class PreparedStep:
    """A step's header, its inputs in wire layout (CPU, contiguous, wire dtypes) and its row
    plan: built once, sent by every attempt."""

    header: pb.StepHeader
    rows: int
    hidden_size: int
    result_dtype: torch.dtype  # the caller's hidden dtype: dX comes back in it
    # What travels with the rows; all None but grad_output for a backward by inputs handle.
    hidden: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    grad_output: Optional[torch.Tensor] = None
    aux: List[Tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    teacher_hidden: Optional[torch.Tensor] = None  # [N, D_teacher], two-head functions
    chunks: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
    # Rows that contribute nothing left out (_compaction.py): which of the caller's rows
    # travel ([rows] int64), and how many the caller gave; None when every row travels.
    kept: Optional[torch.Tensor] = None
    caller_rows: int = 0
    # The shape each input's rows had in the caller's hands, by the name the server's errors
    # give it ("targets", 'aux["advantages"]', "hidden"...): [B, T] for a [B, T] input, so that
    # an error names row 12 as [1, 6] (caller_error).
    row_shapes: Dict[str, Tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def messages(self, stripe: Optional[Tuple[str, int, int]] = None
                 ) -> Iterator[pb.StepRequest]:
        """One stream's messages (as frames() sends them, parsed). `stripe` (key, count, index):
        stream `index` of a step striped over `count` streams (StepHeader.stripe) — stream 0
        sends the header, the others a header stating only their stripe (with the number of
        rows messages each carries), and row message j goes on stream j mod count."""
        for m in self.frames(stripe):
            yield m if isinstance(m, pb.StepRequest) else pb.StepRequest.FromString(m)

    def frames(self, stripe: Optional[Tuple[str, int, int]] = None
               ) -> Iterator[Union[pb.StepRequest, bytes]]:
        """What one stream sends: its header message, then each rows message serialized around
        its tensors' bytes (one copy, into the bytes gRPC sends: _wire.data_frame)."""
        key, count, index = stripe if stripe is not None else ("", 1, 0)
        mine = self.chunks[index::count]
        if count == 1:
            yield pb.StepRequest(header=self.header)
        else:
            header = pb.StepHeader()
            if index == 0:
                header.CopyFrom(self.header)
            header.stripe.key, header.stripe.count, header.stripe.index = key, count, index
            # How many rows messages follow: a stream that ends before them was cancelled.
            header.stripe.messages = len(mine)
            yield pb.StepRequest(header=header)
        for offset, rows in mine:
            yield self._rows_frame(offset, rows)

    def _rows_frame(self, offset: int, count: int) -> bytes:
        m = pb.StepRequest()
        r = m.rows
        r.row_offset = offset
        rows_path = [pb.StepRequest.DESCRIPTOR.fields_by_name["rows"].number]
        number = pb.StepRows.DESCRIPTOR.fields_by_name
        data = []
        for name in ("hidden", "targets", "weights", "grad_output", "teacher_hidden"):
            t = getattr(self, name)
            if t is not None:
                view = _wire.encode_head(t[offset:offset + count], getattr(r, name))
                data += _wire.data_frame([*rows_path, number[name].number], view)
        for name, t in self.aux:
            head = pb.Tensor()
            view = _wire.encode_head(t[offset:offset + count], head)
            data += _wire.map_tensor_frame(rows_path, number["aux"].number, name, head, view)
        return b"".join([m.SerializeToString(), *data])


def step_rpc(channel: grpc.Channel, mode: str) -> grpc.StreamStreamMultiCallable:
    """HeadService's step RPC `mode` ("ForwardBackward", "Forward" or "Backward") on `channel`,
    as the generated stub's, sending what PreparedStep.frames() yields as it is."""
    service = pb.DESCRIPTOR.services_by_name["HeadService"].full_name
    return channel.stream_stream(
        f"/{service}/{mode}",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=decode_response)


_DX_PATH = (pb.StepResponse.DESCRIPTOR.fields_by_name["grad_hidden"].number,
            pb.TensorChunk.DESCRIPTOR.fields_by_name["values"].number)


def decode_response(raw: bytes) -> Tuple[pb.StepResponse, Optional[memoryview]]:
    """A step response as received: a dX chunk's message without its rows' bytes, and those
    bytes as a view of what gRPC handed over (copied once, into dX: RowAssembler); any other
    response parsed whole, with None."""
    split = _wire.split_tensor_data(raw, _DX_PATH)
    if split is not None:
        response = pb.StepResponse.FromString(split[0])
        if response.WhichOneof("part") == "grad_hidden":
            return response, split[1]
    return pb.StepResponse.FromString(raw), None


def caller_error(p: PreparedStep, error: RemoteheadError) -> RemoteheadError:
    """`error` naming a row as the caller gave it. The server names a row by its index among the
    rows sent ("targets[12]", the ErrorInfo metadata "field" and the message's leading field):
    with rows left out (PreparedStep.kept) that is not the caller's row, and for an input of
    shape [B, T] the caller looks for [b, t]. Rewritten from the metadata (data, never the
    message's text): the field becomes the caller's — "targets[1, 6]" — in the metadata and in
    the message it leads; the same error object is returned, its class and code kept."""
    field = error.metadata.get("field", "")
    name, bracket, index = field[:-1].rpartition("[") if field.endswith("]") else ("", "", "")
    if not bracket or not index.isdigit() or name not in p.row_shapes:
        return error
    row = int(index)
    if p.kept is not None:
        if row >= p.kept.numel():
            return error  # not a row this client sent: left as the server said it
        row = int(p.kept[row])
    shape = p.row_shapes[name]
    position = []
    for size in reversed(shape):
        position.append(row % size if size else row)
        row = row // size if size else 0
    return rename_field(error, f"{name}[{', '.join(str(i) for i in reversed(position))}]")


def in_callers_rows(p: PreparedStep, call):
    """call()'s result; an error it raises about one row named as the caller gave the row
    (caller_error): the server names a row among the rows sent, the caller knows its own."""
    try:
        return call()
    except RemoteheadError as e:
        raise caller_error(p, e) from None


def _per_token(t, rows: int, field: str, integral: bool) -> torch.Tensor:
    """A per-token input checked against the rows (any shape of `rows` elements, flattened),
    converted to a wire dtype (integers to int64 unless int64/int32; floating kept) and laid
    out for the wire. The C++ client's PreparePerToken (which takes [N] only)."""
    if not isinstance(t, torch.Tensor) or t.numel() != rows:
        got = shape_text(t) if isinstance(t, torch.Tensor) else type(t).__name__
        raise InvalidArgumentError(f"{field}: expected shape [{rows}]; got {got}")
    t = t.detach().reshape(-1)
    if integral:
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise InvalidArgumentError(f"{field}: expected integer token ids; got {t.dtype}")
        dtype = t.dtype if t.dtype in (torch.int64, torch.int32) else torch.int64
        return _wire.to_wire_layout(t, dtype)
    if not t.dtype.is_floating_point:
        raise InvalidArgumentError(f"{field}: expected a floating tensor; got {t.dtype}")
    _wire.wire_dtype(t.dtype, field)
    return _wire.to_wire_layout(t)


def _aux_input(t, hidden: torch.Tensor, rows: int, field: str) -> torch.Tensor:
    """An aux input laid out for the wire: [rows, k] when shaped like hidden with k in place of
    D ([..., k]: k values per row, a function's topk_aux), else one value per row ([rows], any
    shape of `rows` elements). Floating, or integer (int64 / int32 kept, other integers sent as
    int64: a function's integral_aux, e.g. token ids)."""
    where = {"field": field}
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{field}: expected a tensor of shape [{rows}] or "
                                   f"[{rows}, k]; got {type(t).__name__}", None, where)
    if t.dtype.is_floating_point:
        dtype = t.dtype
        _wire.wire_dtype(dtype, field)
    elif t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidArgumentError(f"{field}: expected a floating or integer tensor; got "
                                   f"{t.dtype}", None, where)
    else:
        dtype = t.dtype if t.dtype in (torch.int64, torch.int32) else torch.int64
    t = t.detach()
    if hidden.dim() >= 1 and t.dim() == hidden.dim() and t.shape[:-1] == hidden.shape[:-1]:
        return _wire.to_wire_layout(t.reshape(rows, t.shape[-1]), dtype)
    if t.numel() != rows:
        raise InvalidArgumentError(f"{field}: expected shape [{rows}] or [{rows}, k]; got "
                                   f"{shape_text(t)}", None, where)
    return _wire.to_wire_layout(t.reshape(-1), dtype)


def _teacher_rows(t, rows: int) -> torch.Tensor:
    """The teacher's hidden states [..., D_teacher] as [rows, D_teacher] (the rows must match
    hidden's, to travel with them), floating, sent in their own dtype."""
    if (not isinstance(t, torch.Tensor) or t.dim() < 1 or not t.dtype.is_floating_point
            or t.shape[-1] == 0 or t.numel() != rows * t.shape[-1]):
        got = (f"{t.dtype} {shape_text(t)}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise InvalidArgumentError(f"teacher_hidden: expected a floating [..., D_teacher] "
                                   f"tensor of {rows} rows (hidden's); got {got}", None,
                                   {"field": "teacher_hidden"})
    _wire.wire_dtype(t.dtype, "teacher_hidden")
    return _wire.to_wire_layout(t.detach().reshape(rows, t.shape[-1]))


def prepare_step(mode: str, head_id: str, hidden: torch.Tensor,
                 targets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                 aux: Optional[Mapping[str, torch.Tensor]], grad_output,
                 o: StepOptions, chunk_bytes: int,
                 teacher_hidden: Optional[torch.Tensor] = None,
                 compact: _compaction.Compaction = False) -> PreparedStep:
    """The Python twin of the C++ client's PrepareStep: the same header fields, set under the
    same conditions, and the same row plan. `compact`: which rows to leave out
    (_compaction.compact; the client's HandleRows decides it from the function's listing)."""
    x = _hidden_rows(hidden)
    n, d = x.shape
    send_dtype = o.wire_dtype if o.wire_dtype is not None else x.dtype
    _wire.wire_dtype(send_dtype, "wire_dtype")
    p = PreparedStep(pb.StepHeader(), n, d, x.dtype)
    wire_result_dtype = _wire.wire_dtype(x.dtype, "hidden")
    # A backward by inputs handle sends none of the inputs: they are not even copied.
    by_handle = mode == BACKWARD and bool(o.inputs_handle)
    _add_inputs(p, x, send_dtype, hidden, targets, weights, aux, teacher_hidden, by_handle)
    p.header.head_id = head_id
    _set_computation(p.header, o, n)
    _set_valid_tokens(p, o, by_handle)
    _set_gradients(p, mode, o, wire_result_dtype, grad_output)
    _compaction.compact(p, o.ignore_index, compact)
    h = p.header
    if o.output_dtype is not None:
        h.output_dtype = _wire.wire_dtype(o.output_dtype, "output_dtype")
    if o.logits_dtype is not None:
        h.logits_dtype = _wire.wire_dtype(o.logits_dtype, "logits_dtype")
    if mode == FORWARD and o.retain_inputs_seconds > 0:
        h.retain_inputs_seconds = o.retain_inputs_seconds
    if by_handle:
        # The server has the inputs: only dL/dy goes with the rows, and a scalar reduction
        # sends no rows at all.
        h.inputs_handle = o.inputs_handle
        p.targets = None  # read above for the valid-token count only
        if p.grad_output is None:
            return p
    p.chunks = _row_plan(p, chunk_bytes)
    return p


def _hidden_rows(hidden) -> torch.Tensor:
    """hidden [..., D] as its rows [N, D] (detached); refused unless a floating tensor."""
    if (not isinstance(hidden, torch.Tensor) or hidden.dim() < 1
            or not hidden.dtype.is_floating_point):
        got = (f"{hidden.dtype} {shape_text(hidden)}" if isinstance(hidden, torch.Tensor)
               else "none" if hidden is None else type(hidden).__name__)
        raise InvalidArgumentError(f"hidden: expected a floating [..., D] tensor; got {got}")
    return hidden.detach().reshape(-1, hidden.shape[-1])


def _add_inputs(p: PreparedStep, x: torch.Tensor, send_dtype: torch.dtype,
                hidden: torch.Tensor, targets, weights, aux, teacher_hidden,
                by_handle: bool) -> None:
    """The row inputs in wire layout, checked against the rows: the targets always (a "mean"
    counts its valid tokens from them), the rest unless a backward by inputs handle."""
    n = p.rows
    rows_of_hidden = tuple(hidden.shape[:-1])
    if targets is not None:
        p.targets = _per_token(targets, n, "targets", integral=True)
        p.row_shapes["targets"] = tuple(targets.shape)
    if by_handle:
        return
    p.hidden = _wire.to_wire_layout(x, send_dtype)
    p.row_shapes["hidden"] = rows_of_hidden
    if weights is not None:
        p.weights = _per_token(weights, n, "weights", integral=False)
        p.row_shapes["weights"] = tuple(weights.shape)
    for name, t in (aux or {}).items():
        field = f'aux["{name}"]'
        p.aux.append((name, _aux_input(t, hidden, n, field)))
        # [..., k] like hidden: k values per row, the rows are hidden's.
        p.row_shapes[field] = (rows_of_hidden if p.aux[-1][1].dim() == 2
                               else tuple(t.shape))
    if teacher_hidden is not None:
        p.teacher_hidden = _teacher_rows(teacher_hidden, n)
        p.row_shapes["teacher_hidden"] = tuple(teacher_hidden.shape[:-1])


def _set_computation(h: pb.StepHeader, o: StepOptions, rows: int) -> None:
    """What every step's header says whatever its mode: the function and its reduction, the
    chunking, the rows, what the step is pinned to, the teacher and the extras asked for."""
    h.function.name = o.function
    for k, v in o.params.items():
        h.function.params[k] = float(v)
    h.function.reduction = _REDUCTIONS[o.reduction]
    h.function.ignore_index = o.ignore_index
    if o.normalizer is not None:
        h.function.normalizer = float(o.normalizer)
    h.chunking.chunk_rows = o.chunk_rows
    h.chunking.memory_budget_bytes = o.memory_budget_bytes
    h.chunking.SetInParent()  # always present, as the C++ client's mutable_chunking()
    h.rows = rows
    if o.expected_weight_version is not None:
        h.expected_weight_version = o.expected_weight_version
    if o.expected_incarnation:
        h.expected_incarnation = o.expected_incarnation
    if o.teacher:
        h.teacher_head_id = o.teacher
    h.token_extras.extend(o.token_extras)


def _set_valid_tokens(p: PreparedStep, o: StepOptions, by_handle: bool) -> None:
    """The valid-token count of a "mean" without normalizer (header.valid_tokens)."""
    if o.reduction != "mean" or o.normalizer is not None:
        return
    if by_handle and o.valid_tokens is None and p.targets is None:
        raise InvalidArgumentError(
            "targets: a backward by inputs_handle with reduction \"mean\" and no normalizer "
            "needs the targets (or the valid_tokens option) to count the valid tokens; got "
            "neither")
    # The server scales each chunk's dX by 1 / valid_tokens before the later rows arrive,
    # so it needs the count up front.
    p.header.valid_tokens = (o.valid_tokens if o.valid_tokens is not None
                             else int((p.targets != o.ignore_index).sum())
                             if p.targets is not None else p.rows)


def _set_gradients(p: PreparedStep, mode: str, o: StepOptions, wire_result_dtype,
                   grad_output) -> None:
    """What a step with a gradient adds: dW's accumulation and identity, dX's dtype, and the
    upstream gradient (a ForwardBackward's upstream_scale, a Backward's dL/dy or dL/d(loss))."""
    h = p.header
    if mode != FORWARD:
        h.accumulate_weight_grad = o.accumulate
        h.grad_hidden_dtype = wire_result_dtype
        if o.gradient_id is not None:
            h.gradient_id.trainer = o.gradient_id.trainer
            h.gradient_id.step = o.gradient_id.step
            h.gradient_id.micro_batch = o.gradient_id.micro_batch
    if mode == FORWARD_BACKWARD:
        h.upstream_scale = o.upstream_scale
    if mode != BACKWARD:
        return
    if o.reduction == "none":
        if grad_output is None:
            raise InvalidArgumentError(
                "grad_output: backward with reduction \"none\" needs dL/dy for every row; "
                "got none")
        p.grad_output = _per_token(grad_output, p.rows, "grad_output", integral=False)
        p.row_shapes["grad_output"] = tuple(grad_output.shape)
    else:
        # A scalar reduction's dL/d(loss) travels as the header's upstream_scale; a
        # grad_output in the rows would be ignored by the server.
        h.upstream_scale = _scalar_upstream(grad_output)


def _row_plan(p: PreparedStep, chunk_bytes: int) -> List[Tuple[int, int]]:
    """The rows' split into messages of at most chunk_bytes: the bytes of one row of every
    input that travels, and the framing of their tensors (the C++ client's rule)."""
    bytes_per_row = p.hidden_size * p.hidden.element_size() if p.hidden is not None else 0
    tensors = 1 if p.hidden is not None else 0
    name_bytes = 0
    for t in (p.targets, p.weights, p.grad_output):
        if t is not None:
            bytes_per_row += t.element_size()
            tensors += 1
    for name, t in p.aux:
        bytes_per_row += t.element_size() * (t.shape[1] if t.dim() == 2 else 1)
        tensors += 1
        name_bytes += len(name.encode())
    if p.teacher_hidden is not None:
        bytes_per_row += p.teacher_hidden.shape[1] * p.teacher_hidden.element_size()
        tensors += 1
    return _wire.plan_row_chunks(p.rows, bytes_per_row, framing_bytes(tensors, name_bytes),
                                 chunk_bytes)


def _scalar_upstream(g) -> float:
    """dL/d(loss) of a scalar-reduction backward: one floating value (a number, or a tensor of
    one element)."""
    if isinstance(g, numbers.Real) and not isinstance(g, bool):
        return float(g)
    if isinstance(g, torch.Tensor) and g.numel() == 1 and g.dtype.is_floating_point:
        return float(g.detach().reshape(()).item())
    got = (shape_text(g) if isinstance(g, torch.Tensor) else "none" if g is None
           else type(g).__name__)
    raise InvalidArgumentError(
        f"grad_output: expected one floating value (dL/d(loss)) for a scalar reduction; got "
        f"{got}")


class RowAssembler:
    """Streamed rows of one result, checked and copied into a preallocated tensor as they
    arrive (dst's trailing shape, within its rows, none twice; converted to dst's dtype): in
    order without gaps, or with `any_order` in any order (a step striped over several streams,
    whose results come back on any of them). Anything else is a broken server response:
    INTERNAL naming the field, as the C++ client's RowAssembler. `trailing_from_first`: dst is
    [rows] now and takes the first chunk's trailing shape (rows of logits, whose V the caller
    need not know)."""

    def __init__(self, dst: torch.Tensor, field: str, trailing_from_first: bool = False,
                 any_order: bool = False):
        self.dst, self.field, self.received = dst, field, 0
        self.trailing_from_first = trailing_from_first
        self.seen = torch.zeros(dst.shape[0], dtype=torch.bool) if any_order else None

    def add(self, chunk: pb.TensorChunk, data: Optional[memoryview] = None) -> None:
        """`data`: the chunk's values' bytes where they were received (decode_response)."""
        values = _wire.decode_view(chunk.values, data)
        if self.trailing_from_first and values.dim() >= 1:
            self.dst = self.dst.new_empty((self.dst.shape[0], *values.shape[1:]))
            self.trailing_from_first = False
        rows = values.shape[0] if values.dim() else -1
        offset, total = chunk.row_offset, self.dst.shape[0]
        if self.seen is None:
            placed = offset == self.received
            expected = f"rows from {self.received}"
        else:
            placed = (0 <= offset <= total and rows >= 0
                      and not bool(self.seen[offset:offset + rows].any()))
            expected = "rows not received yet"
        if (not placed or rows < 0 or tuple(values.shape[1:]) != tuple(self.dst.shape[1:])
                or offset + rows > total):
            trailing = "".join(f", {s}" for s in self.dst.shape[1:])
            raise RemoteheadError(
                grpc.StatusCode.INTERNAL,
                f"{self.field}: expected {expected} shaped [rows{trailing}] within {total} "
                f"rows; the server sent {shape_text(values)} at row {offset}")
        self.dst[offset:offset + rows] = values
        if self.seen is not None:
            self.seen[offset:offset + rows] = True
        self.received += rows

    def check_complete(self) -> None:
        if self.received != self.dst.shape[0]:
            raise RemoteheadError(grpc.StatusCode.INTERNAL,
                                  f"{self.field}: expected {self.dst.shape[0]} rows; the server "
                                  f"sent {self.received}")


def resolve(options: Optional[StepOptions], overrides, default: StepOptions) -> StepOptions:
    check_option_names(overrides)
    base = options if options is not None else default
    return dataclasses.replace(base, **overrides) if overrides else base


def receive(p: PreparedStep, mode: str, fn: Optional[FunctionInfo],
            output_dtype: Optional[torch.dtype],
            responses: Iterable[Tuple[pb.StepResponse, Optional[memoryview]]],
            any_order: bool = False):
    """One attempt's response stream read into fresh results: (grad_hidden, outputs, token_ids)
    as RowAssemblers (None where the call returns none), the wire summary and the token extras
    the header asked for (RowAssemblers by name). `fn`: the
    function as the server lists it, for a Forward with reduction "none" (what its rows are and
    in which dtype); None otherwise, or for a function the server does not list (it refuses
    it, naming it). `any_order`: the responses of several streams, merged (rows in any order;
    a summary from each). Each response comes as decode_response gives it."""
    grad_hidden = outputs = token_ids = None
    if mode != FORWARD:
        grad_hidden = RowAssembler(
            torch.empty((p.rows, p.hidden_size), dtype=p.result_dtype), "grad_hidden",
            any_order=any_order)
    if fn is not None:
        outputs = RowAssembler(
            torch.empty((p.rows,), dtype=fn.outputs_dtype(p.result_dtype, output_dtype)),
            "outputs", trailing_from_first=fn.output_kind == "logits", any_order=any_order)
        if fn.output_kind == "sample":
            token_ids = RowAssembler(torch.empty((p.rows,), dtype=torch.int64), "token_ids",
                                     any_order=any_order)
    extras_dtype = torch.float64 if p.result_dtype == torch.float64 else torch.float32
    extras = {name: RowAssembler(torch.empty((p.rows,), dtype=extras_dtype),
                                 f'token_extras["{name}"]', any_order=any_order)
              for name in p.header.token_extras}
    summary = None
    for response, data in responses:
        part = response.WhichOneof("part")
        if part == "summary":
            summary = response.summary
            continue
        if part == "token_extra":
            target = extras.get(response.token_extra.name)
            if target is None:
                raise RemoteheadError(grpc.StatusCode.INTERNAL,
                                      f'token_extra: "{response.token_extra.name}" was not '
                                      f'asked for (token_extras {list(extras)})')
            target.add(response.token_extra)
            continue
        target = {"grad_hidden": grad_hidden, "outputs": outputs,
                  "token_ids": token_ids}.get(part)
        if target is None:
            raise RemoteheadError(grpc.StatusCode.INTERNAL, f"{part}: not expected from {mode}")
        target.add(getattr(response, part), data)
    if summary is None:
        raise RemoteheadError(grpc.StatusCode.INTERNAL, "summary: the stream ended without one")
    for assembler in (grad_hidden, outputs, token_ids, *extras.values()):
        if assembler is not None:
            assembler.check_complete()
    return grad_hidden, outputs, token_ids, summary, extras


def step_result(mode: str, per_token: bool, received, p: Optional[PreparedStep] = None
                ) -> StepResult:
    """The StepResult of what `receive` read: per-token outputs for a Forward with reduction
    "none", a Forward's reduced loss as a 0-d float64 tensor. `p`: the step, whose rows left out
    (PreparedStep.kept) get zeros in the caller's rows."""
    grad_hidden, outputs, token_ids, summary, extras = received

    def rows(a):
        return None if a is None else a.dst if p is None else _compaction.expand(p, a.dst)

    result_outputs = (rows(outputs) if per_token
                      else torch.tensor(summary.loss, dtype=torch.float64)
                      if mode == FORWARD else None)
    return StepResult(summary.loss, rows(grad_hidden), result_outputs, decode_summary(summary),
                      rows(token_ids), {name: rows(a) for name, a in extras.items()})
