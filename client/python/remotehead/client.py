"""The Python client of a remotehead server: one method per RPC, torch tensors in and out.

Step calls stream: gRPC sends the header and X's row chunks from its own thread while this one
receives dX chunks as the server produces them. Server errors surface as RemoteheadError with
the gRPC status code and the server's message (which names the field, expected and actual).

The step calls follow the C++ client's rules (client/cpp/src/client.cc, PrepareStep) to the
byte: for the same call both clients send the same StepHeader and split the rows into the same
messages (tests/python/test_conformance.py runs one list of calls through both and compares
what reached the server).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import random
import time
from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import grpc
import torch

from remotehead import _safetensors, _wire
from remotehead import _errors
from remotehead._errors import InvalidArgumentError, RemoteheadError, ServerRestartedError
from remotehead.functions import FunctionInfo, function_info
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc

_REDUCTIONS = {
    "none": pb.REDUCTION_NONE,
    "sum": pb.REDUCTION_SUM,
    "mean": pb.REDUCTION_MEAN,
    "weighted_sum": pb.REDUCTION_WEIGHTED_SUM,
}


@dataclasses.dataclass
class HeadInfo:
    head_id: str
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    has_bias: bool
    device: str
    weight_version: int
    accumulated_micro_batches: int
    incarnation: str = ""  # the server process: a new one after every restart
    state_id: str = ""  # the saved training state last saved or restored ("" if none)
    # A head group: its processes, and each one's (offset, rows) of the vocabulary by rank.
    group_size: int = 1
    shards: Tuple[Tuple[int, int], ...] = ()


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
        function: the server's transformation function: "cross_entropy", "token_logprobs",
            "entropy", "grpo", "mse_onehot" or "sigmoid_sum"; or, for generation (forward,
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

    def __post_init__(self):
        if self.reduction not in _REDUCTIONS:
            raise InvalidArgumentError(f"reduction: expected one of {list(_REDUCTIONS)}; got "
                                       f"{self.reduction!r}")
        self.params = dict(self.params or {})
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


def _info(msg: pb.HeadInfo) -> HeadInfo:
    return HeadInfo(msg.head_id, msg.vocab_size, msg.hidden_size, _wire._FROM_WIRE[msg.dtype],
                    msg.has_bias, msg.device, msg.weight_version, msg.accumulated_micro_batches,
                    msg.incarnation, msg.state_id, max(1, msg.group_size),
                    tuple((r.offset, r.rows) for r in msg.shards))


def _summary(msg: pb.StepSummary) -> StepSummary:
    t = msg.timings
    return StepSummary(
        loss=msg.loss, valid_tokens=msg.valid_tokens, denominator=msg.denominator,
        extras=dict(msg.extras), weight_version=msg.weight_version, replayed=msg.replayed,
        chunk_rows=msg.chunk_rows, num_chunks=msg.num_chunks, inputs_handle=msg.inputs_handle,
        incarnation=msg.incarnation, timings=StepTimings(t.queue_seconds, t.receive_wait_seconds, t.compute_seconds,
                            t.send_wait_seconds, t.total_seconds))


def _assemble(pieces) -> Optional[torch.Tensor]:
    """Row chunks (offset, tensor) as one tensor, in row order; None if there were none."""
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]) if pieces else None


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))  # "[2, 3]", as the C++ client's c10::str(sizes)


# Protobuf framing of one request message beyond its tensor bytes (tags, lengths, dtype and
# shape fields, map keys); generous, so that chunk_bytes bounds the whole message. The C++
# client's FramingBytes: both clients must plan the same row messages.
def framing_bytes(tensors: int, name_bytes: int) -> int:
    return 64 + 64 * tensors + name_bytes


_FORWARD_BACKWARD, _FORWARD, _BACKWARD = "ForwardBackward", "Forward", "Backward"


@dataclasses.dataclass
class _PreparedStep:
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
    chunks: List[Tuple[int, int]] = dataclasses.field(default_factory=list)

    def messages(self) -> Iterator[pb.StepRequest]:
        yield pb.StepRequest(header=self.header)
        for offset, count in self.chunks:
            m = pb.StepRequest()
            r = m.rows
            r.row_offset = offset
            for name in ("hidden", "targets", "weights", "grad_output"):
                t = getattr(self, name)
                if t is not None:
                    _wire.encode(t[offset:offset + count], getattr(r, name))
            for name, t in self.aux:
                _wire.encode(t[offset:offset + count], r.aux[name])
            yield m


def _per_token(t, rows: int, field: str, integral: bool) -> torch.Tensor:
    """A per-token input checked against the rows (any shape of `rows` elements, flattened),
    converted to a wire dtype (integers to int64 unless int64/int32; floating kept) and laid
    out for the wire. The C++ client's PreparePerToken (which takes [N] only)."""
    if not isinstance(t, torch.Tensor) or t.numel() != rows:
        got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
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


def _prepare_step(mode: str, head_id: str, hidden: torch.Tensor,
                  targets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                  aux: Optional[Mapping[str, torch.Tensor]], grad_output,
                  o: StepOptions, chunk_bytes: int) -> _PreparedStep:
    """The Python twin of the C++ client's PrepareStep: the same header fields, set under the
    same conditions, and the same row plan."""
    if (not isinstance(hidden, torch.Tensor) or hidden.dim() < 1
            or not hidden.dtype.is_floating_point):
        got = (f"{hidden.dtype} {_shape(hidden)}" if isinstance(hidden, torch.Tensor)
               else "none" if hidden is None else type(hidden).__name__)
        raise InvalidArgumentError(f"hidden: expected a floating [..., D] tensor; got {got}")
    x = hidden.detach().reshape(-1, hidden.shape[-1])
    n, d = x.shape
    send_dtype = o.wire_dtype if o.wire_dtype is not None else x.dtype
    _wire.wire_dtype(send_dtype, "wire_dtype")
    result_dtype = x.dtype
    p = _PreparedStep(pb.StepHeader(), n, d, result_dtype)
    wire_result_dtype = _wire.wire_dtype(result_dtype, "hidden")
    if targets is not None:
        p.targets = _per_token(targets, n, "targets", integral=True)
    # A backward by inputs handle sends none of the inputs: they are not even copied.
    by_handle = mode == _BACKWARD and bool(o.inputs_handle)
    if not by_handle:
        p.hidden = _wire.to_wire_layout(x, send_dtype)
        if weights is not None:
            p.weights = _per_token(weights, n, "weights", integral=False)
        for name, t in (aux or {}).items():
            p.aux.append((name, _per_token(t, n, f'aux["{name}"]', integral=False)))

    h = p.header
    h.head_id = head_id
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
    h.rows = n
    if o.expected_weight_version is not None:
        h.expected_weight_version = o.expected_weight_version
    if o.expected_incarnation:
        h.expected_incarnation = o.expected_incarnation
    if o.reduction == "mean" and o.normalizer is None:
        if by_handle and o.valid_tokens is None and p.targets is None:
            raise InvalidArgumentError(
                "targets: a backward by inputs_handle with reduction \"mean\" and no normalizer "
                "needs the targets (or the valid_tokens option) to count the valid tokens; got "
                "neither")
        # The server scales each chunk's dX by 1 / valid_tokens before the later rows arrive,
        # so it needs the count up front.
        h.valid_tokens = (o.valid_tokens if o.valid_tokens is not None
                          else int((p.targets != o.ignore_index).sum()) if p.targets is not None
                          else n)
    if mode != _FORWARD:
        h.accumulate_weight_grad = o.accumulate
        h.grad_hidden_dtype = wire_result_dtype
        if o.gradient_id is not None:
            h.gradient_id.trainer = o.gradient_id.trainer
            h.gradient_id.step = o.gradient_id.step
            h.gradient_id.micro_batch = o.gradient_id.micro_batch
    if mode == _FORWARD_BACKWARD:
        h.upstream_scale = o.upstream_scale
    if mode == _BACKWARD:
        if o.reduction == "none":
            if grad_output is None:
                raise InvalidArgumentError(
                    "grad_output: backward with reduction \"none\" needs dL/dy for every row; "
                    "got none")
            p.grad_output = _per_token(grad_output, n, "grad_output", integral=False)
        else:
            # A scalar reduction's dL/d(loss) travels as the header's upstream_scale; a
            # grad_output in the rows would be ignored by the server.
            h.upstream_scale = _scalar_upstream(grad_output)
    if o.output_dtype is not None:
        h.output_dtype = _wire.wire_dtype(o.output_dtype, "output_dtype")
    if mode == _FORWARD and o.retain_inputs_seconds > 0:
        h.retain_inputs_seconds = o.retain_inputs_seconds
    if by_handle:
        # The server has the inputs: only dL/dy goes with the rows, and a scalar reduction
        # sends no rows at all.
        h.inputs_handle = o.inputs_handle
        p.targets = None  # read above for the valid-token count only
        if p.grad_output is None:
            return p

    bytes_per_row = d * p.hidden.element_size() if p.hidden is not None else 0
    tensors = 1 if p.hidden is not None else 0
    name_bytes = 0
    for t in (p.targets, p.weights, p.grad_output):
        if t is not None:
            bytes_per_row += t.element_size()
            tensors += 1
    for name, t in p.aux:
        bytes_per_row += t.element_size()
        tensors += 1
        name_bytes += len(name.encode())
    p.chunks = _wire.plan_row_chunks(n, bytes_per_row, framing_bytes(tensors, name_bytes),
                                     chunk_bytes)
    return p


def _scalar_upstream(g) -> float:
    """dL/d(loss) of a scalar-reduction backward: one floating value (a number, or a tensor of
    one element)."""
    if isinstance(g, numbers.Real) and not isinstance(g, bool):
        return float(g)
    if isinstance(g, torch.Tensor) and g.numel() == 1 and g.dtype.is_floating_point:
        return float(g.detach().reshape(()).item())
    got = _shape(g) if isinstance(g, torch.Tensor) else "none" if g is None else type(g).__name__
    raise InvalidArgumentError(
        f"grad_output: expected one floating value (dL/d(loss)) for a scalar reduction; got "
        f"{got}")


class _RowAssembler:
    """Streamed rows of one result, checked and copied into a preallocated tensor as they
    arrive (in order, no gaps, dst's trailing shape; converted to dst's dtype). Anything else
    is a broken server response: INTERNAL naming the field, as the C++ client's RowAssembler.
    `trailing_from_first`: dst is [rows] now and takes the first chunk's trailing shape (rows
    of logits, whose V the caller need not know)."""

    def __init__(self, dst: torch.Tensor, field: str, trailing_from_first: bool = False):
        self.dst, self.field, self.next_row = dst, field, 0
        self.trailing_from_first = trailing_from_first

    def add(self, chunk: pb.TensorChunk) -> None:
        values = _wire.decode(chunk.values)
        if self.trailing_from_first and values.dim() >= 1:
            self.dst = self.dst.new_empty((self.dst.shape[0], *values.shape[1:]))
            self.trailing_from_first = False
        rows = values.shape[0] if values.dim() else -1
        if (chunk.row_offset != self.next_row or rows < 0
                or tuple(values.shape[1:]) != tuple(self.dst.shape[1:])
                or self.next_row + rows > self.dst.shape[0]):
            trailing = "".join(f", {s}" for s in self.dst.shape[1:])
            raise RemoteheadError(
                grpc.StatusCode.INTERNAL,
                f"{self.field}: expected rows from {self.next_row} shaped [rows{trailing}] "
                f"within {self.dst.shape[0]} rows; the server sent {_shape(values)} at row "
                f"{chunk.row_offset}")
        self.dst[self.next_row:self.next_row + rows] = values
        self.next_row += rows

    def check_complete(self) -> None:
        if self.next_row != self.dst.shape[0]:
            raise RemoteheadError(grpc.StatusCode.INTERNAL,
                                  f"{self.field}: expected {self.dst.shape[0]} rows; the server "
                                  f"sent {self.next_row}")


def _resolve(options: Optional[StepOptions], overrides, default: StepOptions) -> StepOptions:
    check_option_names(overrides)
    base = options if options is not None else default
    return dataclasses.replace(base, **overrides) if overrides else base


class Client:
    """A connection to one remotehead server. Thread-safe, like the gRPC channel under it.

    TLS: pass `root_certificates` (PEM bytes; plus `private_key` and `certificate_chain` for
    mTLS). `token` is sent as `authorization: Bearer <token>`, only over TLS.
    `chunk_bytes` (>= 1024): the largest request message; rows of X (with their targets,
    weights, aux, grad_output) and uploaded weight rows are split so that no message exceeds
    it, by the same rule as the C++ client (same chunk_bytes, same row messages).
    """

    def __init__(self, target: str, *, root_certificates: Optional[bytes] = None,
                 private_key: Optional[bytes] = None, certificate_chain: Optional[bytes] = None,
                 token: Optional[str] = None, chunk_bytes: int = 1 << 20,
                 max_message_bytes: int = 64 << 20, timeout: Optional[float] = None,
                 max_attempts: int = 5, initial_backoff: float = 0.05,
                 max_backoff: float = 2.0):
        if chunk_bytes < 1024:
            raise InvalidArgumentError(f"chunk_bytes: expected >= 1024; got {chunk_bytes}")
        # Reconnect as fast as calls are retried (gRPC's default first reconnect waits 1 s).
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.initial_reconnect_backoff_ms", int(initial_backoff * 1000)),
                   ("grpc.min_reconnect_backoff_ms", int(initial_backoff * 1000)),
                   ("grpc.max_reconnect_backoff_ms", int(max_backoff * 1000))]
        if root_certificates is not None or token is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)
            if token is not None:
                credentials = grpc.composite_channel_credentials(
                    credentials, grpc.access_token_call_credentials(token))
            self._channel = grpc.secure_channel(target, credentials, options)
        else:
            self._channel = grpc.insecure_channel(target, options)
        self._stub = pb_grpc.HeadServiceStub(self._channel)
        self._chunk_bytes = chunk_bytes
        self._timeout = timeout
        self._max_attempts = max(1, max_attempts)
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self.retries = 0  # attempts repeated after UNAVAILABLE, over this client's life
        self._functions: Optional[Dict[str, FunctionInfo]] = None  # functions(), once

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, attempt, retry: bool = True):
        """Runs `attempt()` (one whole RPC), again after UNAVAILABLE (no server yet, a restart,
        a dropped connection) with exponential backoff and jitter; never on another code. Step
        calls keep their gradient id across attempts, so the server's exactly-once ledger makes
        a replay of work that did reach it add nothing (summary.replayed)."""
        backoff = self._initial_backoff
        for attempt_number in range(1, self._max_attempts + 1):
            try:
                return attempt()
            except grpc.RpcError as e:
                # A reason says what no retry fixes (a group that is down, a draining server
                # is retried: another attempt may reach a healthy process).
                if (not retry or e.code() != grpc.StatusCode.UNAVAILABLE
                        or attempt_number == self._max_attempts):
                    raise _errors.from_rpc_error(e) from None
            self.retries += 1
            time.sleep(backoff * random.uniform(0.9, 1.1))
            backoff = min(backoff * 2, self._max_backoff)

    def _unary(self, method, request, retry: bool = True):
        return self._call(lambda: method(request, timeout=self._timeout), retry)

    # ----- heads -----

    def create_head(self, head_id: str, vocab_size: int, hidden_size: int, *,
                    dtype: torch.dtype = torch.float32, bias: bool = False, seed: int = 0,
                    init_std: float = 0.02) -> HeadInfo:
        request = pb.CreateHeadRequest(head_id=head_id, dtype=_wire.wire_dtype(dtype))
        request.init.vocab_size = vocab_size
        request.init.hidden_size = hidden_size
        request.init.bias = bias
        request.init.seed = seed
        request.init.init_std = init_std
        return _info(self._unary(self._stub.CreateHead, request))

    def upload_head(self, head_id: str, weight: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, *, replace: bool = False) -> HeadInfo:
        """Streams W [V, D] (and b [V]) to the server as head `head_id`, in W's dtype.
        replace=True: new weights for an existing head of the same shape, dtype and bias (its
        gradients must be zero; its optimizer state is reset; its version goes up by one), or a
        new head if there is none."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            got = _shape(weight) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise InvalidArgumentError(f"weight: expected a floating [V, D] tensor; got {got}")
        w = _wire.to_wire_layout(weight)
        vocab, hidden_size = w.shape
        # The server stores the bias in the head's (weight's) dtype.
        b = _wire.to_wire_layout(bias, w.dtype) if bias is not None else None
        if b is not None and tuple(b.shape) != (vocab,):
            raise InvalidArgumentError(f"bias: expected shape [{vocab}]; got {_shape(b)}")
        # Planned before anything is sent, by the C++ client's rule (one tensor per message).
        parts = [("weight_rows", w, _wire.plan_row_chunks(
            vocab, hidden_size * w.element_size(), framing_bytes(1, 0), self._chunk_bytes))]
        if b is not None:
            parts.append(("bias_rows", b, _wire.plan_row_chunks(
                vocab, b.element_size(), framing_bytes(1, 0), self._chunk_bytes)))

        def requests() -> Iterator[pb.UploadHeadRequest]:
            header = pb.UploadHeadRequest()
            header.header.head_id = head_id
            header.header.vocab_size, header.header.hidden_size = vocab, hidden_size
            header.header.dtype = _wire.wire_dtype(w.dtype, "weight")
            header.header.has_bias = b is not None
            header.header.replace = replace
            yield header
            for name, t, chunks in parts:
                for offset, n in chunks:
                    m = pb.UploadHeadRequest()
                    chunk = getattr(m, name)
                    chunk.row_offset = offset
                    _wire.encode(t[offset:offset + n], chunk.values)
                    yield m

        return _info(self._call(lambda: self._stub.UploadHead(requests(), timeout=self._timeout)))

    def describe_head(self, head_id: str) -> HeadInfo:
        return _info(self._unary(self._stub.DescribeHead, pb.HeadRef(head_id=head_id)))

    def functions(self) -> Dict[str, FunctionInfo]:
        """Every function the server computes, by name (ListFunctions), asked once per
        Client."""
        if self._functions is None:
            response = self._unary(self._stub.ListFunctions, pb.ListFunctionsRequest())
            self._functions = {f.name: function_info(f) for f in response.functions}
        return self._functions

    def list_heads(self) -> List[HeadInfo]:
        return [_info(h) for h in self._unary(self._stub.ListHeads, pb.ListHeadsRequest()).heads]

    def drop_head(self, head_id: str) -> None:
        self._unary(self._stub.DropHead, pb.HeadRef(head_id=head_id))

    def save_weights(self, head_id: str, path: str, *, weight_name: str = "",
                     bias_name: str = "") -> int:
        """Writes the head's weights to a safetensors file on the server (`path` relative to
        its --checkpoint_dir; empty names: lm_head.weight / lm_head.bias); the bytes written."""
        request = pb.SaveWeightsRequest(head_id=head_id, path=path, weight_name=weight_name,
                                        bias_name=bias_name)
        return self._unary(self._stub.SaveWeights, request).bytes_written

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check of `service` ("" = the whole server): "SERVING", "NOT_SERVING",
        "UNKNOWN" or "SERVICE_UNKNOWN". Read without generated health stubs (field 1 of the
        reply); not retried, so an unreachable server is a RemoteheadError (UNAVAILABLE)."""
        name = service.encode()
        request = (b"\x0a" + bytes([len(name)]) + name) if name else b""
        check = self._channel.unary_unary("/grpc.health.v1.Health/Check",
                                          request_serializer=lambda r: r,
                                          response_deserializer=lambda r: r)
        reply = self._call(lambda: check(request, timeout=self._timeout or 10), retry=False)
        status = reply[1] if len(reply) >= 2 and reply[0] == 0x08 else 0
        return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(
            status, "UNKNOWN")

    def export_weights(self, head_id: str, dtype: Optional[torch.dtype] = None
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The head's W [V, D] and b [V] (None without bias), in `dtype` (default: its own)."""
        request = pb.ExportWeightsRequest(head_id=head_id)
        if dtype is not None:
            request.dtype = _wire.wire_dtype(dtype)
        parts = self._read_row_stream(self._stub.ExportWeights, request)
        return _assemble(parts.get("weight_rows")), _assemble(parts.get("bias_rows"))

    def _read_row_stream(self, rpc, request) -> Dict[str, list]:
        """The row chunks of a server stream, by field name (plus "info" if sent)."""
        def attempt() -> Dict[str, list]:
            parts: Dict[str, list] = {}
            for response in rpc(request, timeout=self._timeout):
                part = response.WhichOneof("part")
                if part == "info":
                    parts["info"] = _info(response.info)
                else:
                    chunk = getattr(response, part)
                    parts.setdefault(part, []).append((chunk.row_offset,
                                                       _wire.decode(chunk.values)))
            return parts

        return self._call(attempt)

    # ----- gradients and optimizer -----

    def fetch_gradients(self, head_id: str, dtype: Optional[torch.dtype] = None
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], HeadInfo]:
        """The accumulated dW [V, D] and db [V] (None without bias), and the head's state.
        dtype None: the accumulator's (float32)."""
        request = pb.FetchGradientsRequest(head_id=head_id)
        if dtype is not None:
            request.dtype = _wire.wire_dtype(dtype)
        parts = self._read_row_stream(self._stub.FetchGradients, request)
        return (_assemble(parts.get("weight_grad_rows")), _assemble(parts.get("bias_grad_rows")),
                parts.get("info"))

    def zero_gradients(self, head_id: str) -> HeadInfo:
        return _info(self._unary(self._stub.ZeroGradients, pb.HeadRef(head_id=head_id)).info)

    def optimizer_step(self, head_id: str, *, sgd: Optional[dict] = None,
                       adamw: Optional[dict] = None, grad_scale: Optional[float] = None,
                       zero_gradients: bool = False, expected_incarnation: str = "",
                       expected_weight_version: Optional[int] = None,
                       synchronous: Optional[Tuple[int, int, int]] = None) -> HeadInfo:
        """One server-side step: sgd=dict(lr=, momentum=, weight_decay=) or
        adamw=dict(lr=, beta1=, beta2=, eps=, weight_decay=). expected_incarnation: as
        StepOptions.expected_incarnation (ServerRestartedError once the server restarted).
        expected_weight_version: refused (FAILED_PRECONDITION) if the head is at another.

        synchronous=(step, rank, world_size): this trainer's part of the step of `world_size`
        data-parallel trainers (proto SynchronousStep): the call returns once every rank asked
        for `step`, with the same HeadInfo for all; the summed dW is scaled by
        grad_scale / world_size. Retried after UNAVAILABLE (the server answers a step it applied
        again); ABORTED when a rank does not come within the server's timeout."""
        request = pb.OptimizerStepRequest(head_id=head_id, zero_gradients=zero_gradients,
                                          expected_incarnation=expected_incarnation)
        if grad_scale is not None:
            request.grad_scale = grad_scale
        if expected_weight_version is not None:
            request.expected_weight_version = expected_weight_version
        if synchronous is not None:
            step, rank, world_size = synchronous
            request.synchronous.CopyFrom(
                pb.SynchronousStep(step=step, rank=rank, world_size=world_size))
        if (sgd is None) == (adamw is None):
            raise ValueError("optimizer: expected exactly one of sgd or adamw")
        if sgd is not None:
            request.sgd.CopyFrom(pb.OptimizerStepRequest.Sgd(**sgd))
        else:
            request.adamw.CopyFrom(pb.OptimizerStepRequest.AdamW(**adamw))
        # A single caller's step is not idempotent: never retried (a lost answer may hide a step
        # that happened). A synchronous one is: the server answers a retry of an applied step.
        return _info(self._unary(self._stub.OptimizerStep, request,
                                 retry=synchronous is not None).info)

    # ----- durable training state (a server started with --state_dir) -----

    def save_head_state(self, head_id: str) -> HeadInfo:
        """Writes the head's whole training state (weights, optimizer state, version) on the
        server now; the returned info's state_id names it for restore_head_state."""
        return _info(self._unary(self._stub.SaveHeadState, pb.HeadRef(head_id=head_id)).info)

    def restore_head_state(self, head_id: str, state_id: str) -> HeadInfo:
        """Puts the head back to a saved state (weights, optimizer state, version); its
        gradients are zeroed."""
        return _info(self._unary(self._stub.RestoreHeadState,
                                 pb.RestoreHeadStateRequest(head_id=head_id, state_id=state_id)))

    # ----- steps -----
    #
    # hidden is [..., D] (flattened to N rows); targets, weights, aux and grad_output hold one
    # value per row, in any shape of N elements. Tensors may live on any device.

    def forward_backward(self, head_id: str, hidden: torch.Tensor,
                         targets: Optional[torch.Tensor], options: Optional[StepOptions] = None,
                         *, weights: Optional[torch.Tensor] = None,
                         aux: Optional[Mapping[str, torch.Tensor]] = None,
                         **overrides) -> StepResult:
        """Fused step: the loss, dX [N, D] (× upstream_scale) and, with accumulate, dW added on
        the server, in one pass. Needs a scalar reduction and, when accumulating, a
        gradient_id.

        options: a StepOptions (default StepOptions()); any of its fields may also be passed
        as a keyword argument (function, params, reduction, ignore_index, normalizer,
        valid_tokens, chunk_rows, memory_budget_bytes, upstream_scale, accumulate,
        gradient_id, expected_weight_version, wire_dtype), applied over it; an unknown
        keyword is a TypeError listing the valid ones. help(remotehead.StepOptions) explains
        each. weights [N]: per-token weights ("weighted_sum"); aux: extra per-token inputs by
        name, e.g. GRPO's {"advantages": ..., "old_logprobs": ..., "ref_logprobs": ...}.
        """
        o = _resolve(options, overrides, StepOptions())
        return self._step(_FORWARD_BACKWARD, head_id, hidden, targets, weights, aux, None, o)

    def forward(self, head_id: str, hidden: torch.Tensor, targets: Optional[torch.Tensor],
                options: Optional[StepOptions] = None, *,
                weights: Optional[torch.Tensor] = None,
                aux: Optional[Mapping[str, torch.Tensor]] = None, **overrides) -> StepResult:
        """Outputs only, nothing accumulated (the accumulate and gradient_id options are not
        sent): per-token outputs [N] for reduction "none", else the reduced loss.

        options: a StepOptions, default StepOptions(reduction="none"); keyword overrides as in
        forward_backward. retain_inputs_seconds > 0 keeps the rows on the server for a
        backward by summary.inputs_handle.
        """
        o = _resolve(options, overrides, StepOptions(reduction="none"))
        return self._step(_FORWARD, head_id, hidden, targets, weights, aux, None, o)

    def backward(self, head_id: str, hidden: torch.Tensor, targets: Optional[torch.Tensor],
                 grad_output: Union[torch.Tensor, float], options: Optional[StepOptions] = None,
                 *, weights: Optional[torch.Tensor] = None,
                 aux: Optional[Mapping[str, torch.Tensor]] = None,
                 **overrides) -> StepResult:
        """Two-phase backward: the server recomputes the logits, returns dX [N, D] and (with
        accumulate) adds dW, exactly once per gradient_id.

        grad_output: dL/dy per row [N] for reduction "none"; for a scalar reduction ("sum",
        "mean", "weighted_sum") one value, dL/d(loss) (a number or a one-element floating
        tensor), which travels as the header's upstream_scale: anything else is refused
        (InvalidArgumentError naming grad_output).

        options: a StepOptions, default StepOptions(reduction="none"); keyword overrides as in
        forward_backward. inputs_handle: a forward's summary.inputs_handle (X is then not
        sent; hidden still gives N, D and dX's dtype).
        """
        o = _resolve(options, overrides, StepOptions(reduction="none"))
        return self._step(_BACKWARD, head_id, hidden, targets, weights, aux, grad_output, o)

    # ----- generation -----

    def logits(self, head_id: str, hidden: torch.Tensor, *, dtype: torch.dtype = torch.float32,
               params: Optional[Mapping[str, float]] = None, **overrides) -> torch.Tensor:
        """The logits of the rows of `hidden` [..., D]: [..., V] in `dtype`, streamed from the
        server a few rows at a time (a Forward of the function "logits"). Ask only for the rows
        you need (e.g. the last position of each sequence when decoding): the result is V values
        per row. params: the common "temperature" and "softcap" (default: the raw logits)."""
        o = _resolve(None, {**overrides, "function": "logits", "reduction": "none",
                            "params": dict(params or {}), "output_dtype": dtype},
                     StepOptions())
        result = self._step(_FORWARD, head_id, hidden, None, None, None, None, o)
        return result.outputs.to(hidden.device).reshape(*hidden.shape[:-1], -1)

    def sample(self, head_id: str, hidden: torch.Tensor, *, greedy: bool = False,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               softcap: float = 0.0, **overrides) -> Tuple[torch.Tensor, torch.Tensor]:
        """One token drawn on the server for each row of `hidden` [..., D] (function "sample"):
        returns (token ids [...] int64, their log-probabilities [...] float32), so a decode step
        moves B·D up and B ids down instead of [B, V] logits.

        Hugging Face's sampling pipeline: softcap, temperature, top_k (0: off), top_p (1: off),
        then row r of the request draws torch.multinomial(p, 1) with a CPU generator seeded with
        seed + r. greedy: the argmax instead. The log-probability is the token's under
        softmax(logits / temperature) before top-k / top-p (token_logprobs' value for it)."""
        o = _resolve(None, {**overrides, "function": "sample", "reduction": "none", "params": {
            "greedy": 1.0 if greedy else 0.0, "temperature": float(temperature),
            "top_k": float(top_k), "top_p": float(top_p), "seed": float(seed),
            "softcap": float(softcap)}}, StepOptions())
        result = self._step(_FORWARD, head_id, hidden, None, None, None, None, o)
        shape = hidden.shape[:-1]
        return (result.token_ids.to(hidden.device).reshape(shape),
                result.outputs.to(hidden.device).reshape(shape))

    def export_weights_to_safetensors(self, head_id: str, path: str, *,
                                      name: str = "lm_head.weight",
                                      dtype: Optional[torch.dtype] = None,
                                      expected_incarnation: str = "",
                                      expected_weight_version: Optional[int] = None) -> int:
        """Writes the head's W [V, D] (in `dtype`, default its own) into a new .safetensors file
        on this machine as `name`, streamed: each row chunk goes from the server's stream to the
        file, so W is never held here whole. Written to `path`.tmp, then renamed; a failed
        export removes `path`.tmp. Returns the bytes written.

        expected_incarnation / expected_weight_version pin the export to the server process
        and the head version the caller holds (a trainer saving what it trained): once the
        server restarted, ServerRestartedError (a retry that reaches the new process too); a
        head at another version, FAILED_PRECONDITION naming both; nothing is written then.
        "" / None: unchecked."""
        info = self.describe_head(head_id)
        if info.has_bias:
            raise InvalidArgumentError(f"head {head_id!r}: expected no bias for a causal LM's "
                                       f"lm_head file; got one")
        dtype = dtype or info.dtype
        request = pb.ExportWeightsRequest(head_id=head_id, dtype=_wire.wire_dtype(dtype),
                                          expected_incarnation=expected_incarnation)
        if expected_weight_version is not None:
            request.expected_weight_version = expected_weight_version
        shape = (info.vocab_size, info.hidden_size)
        partial = f"{path}.tmp"

        def attempt() -> int:
            # Every attempt writes the file from its start: a failed one may have written rows.
            rows = (r.weight_rows for r in self._stub.ExportWeights(request, timeout=self._timeout)
                    if r.WhichOneof("part") == "weight_rows")
            return _safetensors.write_rows(partial, name, dtype, shape, rows)

        try:
            written = self._call(attempt)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial)
            raise
        os.replace(partial, path)
        return written

    def _step(self, mode: str, head_id: str, hidden, targets, weights, aux, grad_output,
              o: StepOptions) -> StepResult:
        p = _prepare_step(mode, head_id, hidden, targets, weights, aux, grad_output, o,
                          self._chunk_bytes)
        rpc = {_FORWARD_BACKWARD: self._stub.ForwardBackward, _FORWARD: self._stub.Forward,
               _BACKWARD: self._stub.Backward}[mode]
        per_token = mode == _FORWARD and o.reduction == "none"
        # What the rows come back as is the function's, as the server lists it.
        fn = self.functions().get(o.function) if per_token else None

        def attempt():
            # Every attempt fills fresh results: a failed one may have sent some rows.
            grad_hidden = outputs = None
            if mode != _FORWARD:
                grad_hidden = _RowAssembler(
                    torch.empty((p.rows, p.hidden_size), dtype=p.result_dtype), "grad_hidden")
            token_ids = None
            if fn is not None:  # (an unknown function: the server refuses it, naming it)
                outputs = _RowAssembler(
                    torch.empty((p.rows,), dtype=fn.outputs_dtype(p.result_dtype, o.output_dtype)),
                    "outputs", trailing_from_first=fn.output_kind == "logits")
                if fn.output_kind == "sample":
                    token_ids = _RowAssembler(torch.empty((p.rows,), dtype=torch.int64),
                                              "token_ids")
            summary = None
            for response in rpc(p.messages(), timeout=self._timeout):
                part = response.WhichOneof("part")
                if part == "summary":
                    summary = response.summary
                    continue
                target = {"grad_hidden": grad_hidden, "outputs": outputs,
                          "token_ids": token_ids}.get(part)
                if target is None:
                    raise RemoteheadError(grpc.StatusCode.INTERNAL,
                                          f"{part}: not expected from {mode}")
                target.add(getattr(response, part))
            if summary is None:
                raise RemoteheadError(grpc.StatusCode.INTERNAL,
                                      "summary: the stream ended without one")
            for assembler in (grad_hidden, outputs, token_ids):
                if assembler is not None:
                    assembler.check_complete()
            return grad_hidden, outputs, token_ids, summary

        grad_hidden, outputs, token_ids, summary = self._call(attempt)
        result_outputs = (outputs.dst if per_token
                          else torch.tensor(summary.loss, dtype=torch.float64)
                          if mode == _FORWARD else None)
        return StepResult(summary.loss, grad_hidden.dst if grad_hidden is not None else None,
                          result_outputs, _summary(summary),
                          token_ids.dst if token_ids is not None else None)
