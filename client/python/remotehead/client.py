"""The Python client of a remotehead server: one method per RPC, torch tensors in and out.

Step calls stream: gRPC sends the header and X's row chunks from its own thread while this one
receives dX chunks as the server produces them. Server errors surface as RemoteheadError with
the gRPC status code and the server's message (which names the field, expected and actual).
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from typing import Dict, Iterator, Optional, Tuple

import grpc
import torch

from remotehead import _wire
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc

_REDUCTIONS = {
    "none": pb.REDUCTION_NONE,
    "sum": pb.REDUCTION_SUM,
    "mean": pb.REDUCTION_MEAN,
    "weighted_sum": pb.REDUCTION_WEIGHTED_SUM,
}


class RemoteheadError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


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


@dataclasses.dataclass
class StepResult:
    loss: float  # the reduced loss (fused / scalar Forward)
    grad_hidden: Optional[torch.Tensor]  # dX [N, D] (ForwardBackward, Backward)
    outputs: Optional[torch.Tensor]  # per-token outputs [N] (Forward with reduction "none")
    summary: pb.StepSummary  # valid_tokens, extras, replayed, weight_version, timings, ...


def _info(msg: pb.HeadInfo) -> HeadInfo:
    return HeadInfo(msg.head_id, msg.vocab_size, msg.hidden_size, _wire._FROM_WIRE[msg.dtype],
                    msg.has_bias, msg.device, msg.weight_version, msg.accumulated_micro_batches)


def _assemble(pieces) -> Optional[torch.Tensor]:
    """Row chunks (offset, tensor) as one tensor, in row order; None if there were none."""
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]) if pieces else None


class Client:
    """A connection to one remotehead server. Thread-safe, like the gRPC channel under it.

    TLS: pass `root_certificates` (PEM bytes; plus `private_key` and `certificate_chain` for
    mTLS). `token` is sent as `authorization: Bearer <token>`, only over TLS.
    """

    def __init__(self, target: str, *, root_certificates: Optional[bytes] = None,
                 private_key: Optional[bytes] = None, certificate_chain: Optional[bytes] = None,
                 token: Optional[str] = None, chunk_bytes: int = 1 << 20,
                 max_message_bytes: int = 64 << 20, timeout: Optional[float] = None,
                 max_attempts: int = 5, initial_backoff: float = 0.05,
                 max_backoff: float = 2.0):
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
                if (not retry or e.code() != grpc.StatusCode.UNAVAILABLE
                        or attempt_number == self._max_attempts):
                    raise RemoteheadError(e.code(), e.details()) from None
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
        weight = weight.detach()

        def requests() -> Iterator[pb.UploadHeadRequest]:
            header = pb.UploadHeadRequest()
            header.header.head_id = head_id
            header.header.vocab_size, header.header.hidden_size = weight.shape
            header.header.dtype = _wire.wire_dtype(weight.dtype)
            header.header.has_bias = bias is not None
            header.header.replace = replace
            yield header
            for name, t in (("weight_rows", weight), ("bias_rows", bias)):
                if t is None:
                    continue
                t = t.detach().to(weight.dtype)
                row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 1
                for offset, n in _wire.row_chunks(t.shape[0], row_bytes, self._chunk_bytes):
                    m = pb.UploadHeadRequest()
                    chunk = getattr(m, name)
                    chunk.row_offset = offset
                    _wire.encode(t[offset:offset + n], chunk.values)
                    yield m

        return _info(self._call(lambda: self._stub.UploadHead(requests(), timeout=self._timeout)))

    def describe_head(self, head_id: str) -> HeadInfo:
        return _info(self._unary(self._stub.DescribeHead, pb.HeadRef(head_id=head_id)))

    def drop_head(self, head_id: str) -> None:
        self._unary(self._stub.DropHead, pb.HeadRef(head_id=head_id))

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

    def fetch_gradients(self, head_id: str, dtype: torch.dtype = torch.float32
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], HeadInfo]:
        """The accumulated dW [V, D] and db [V] (None without bias), and the head's state."""
        request = pb.FetchGradientsRequest(head_id=head_id, dtype=_wire.wire_dtype(dtype))
        parts = self._read_row_stream(self._stub.FetchGradients, request)
        return (_assemble(parts.get("weight_grad_rows")), _assemble(parts.get("bias_grad_rows")),
                parts.get("info"))

    def zero_gradients(self, head_id: str) -> HeadInfo:
        return _info(self._unary(self._stub.ZeroGradients, pb.HeadRef(head_id=head_id)).info)

    def optimizer_step(self, head_id: str, *, sgd: Optional[dict] = None,
                       adamw: Optional[dict] = None, grad_scale: Optional[float] = None,
                       zero_gradients: bool = False) -> HeadInfo:
        """One server-side step: sgd=dict(lr=, momentum=, weight_decay=) or
        adamw=dict(lr=, beta1=, beta2=, eps=, weight_decay=)."""
        request = pb.OptimizerStepRequest(head_id=head_id, zero_gradients=zero_gradients)
        if grad_scale is not None:
            request.grad_scale = grad_scale
        if (sgd is None) == (adamw is None):
            raise ValueError("optimizer: expected exactly one of sgd or adamw")
        if sgd is not None:
            request.sgd.CopyFrom(pb.OptimizerStepRequest.Sgd(**sgd))
        else:
            request.adamw.CopyFrom(pb.OptimizerStepRequest.AdamW(**adamw))
        # Not idempotent: never retried (a lost answer may hide a step that happened).
        return _info(self._unary(self._stub.OptimizerStep, request, retry=False).info)

    # ----- steps -----

    def forward_backward(self, head_id: str, hidden: torch.Tensor, targets: torch.Tensor,
                         **spec) -> StepResult:
        """Fused step: loss, dX and (accumulate=True) dW on the server in one pass.

        Keyword arguments: function ("cross_entropy"), params (dict), reduction ("mean", "sum",
        "weighted_sum"), ignore_index (-100), normalizer, weights [N], aux (dict of [N]),
        upstream_scale (1.0), accumulate (True), gradient_id ((trainer, step, micro_batch);
        required when accumulating), expected_weight_version.
        """
        return self._step(self._stub.ForwardBackward, head_id, hidden, targets, **spec)

    def forward(self, head_id: str, hidden: torch.Tensor, targets: Optional[torch.Tensor],
                **spec) -> StepResult:
        """Outputs only (nothing accumulated): per-token outputs for reduction "none".
        retain_inputs_seconds > 0 keeps the rows on the server for a Backward by
        summary.inputs_handle."""
        spec.setdefault("reduction", "none")
        spec["accumulate"] = False
        return self._step(self._stub.Forward, head_id, hidden, targets, **spec)

    def backward(self, head_id: str, hidden: torch.Tensor, targets: Optional[torch.Tensor],
                 grad_output: torch.Tensor, **spec) -> StepResult:
        """Two-phase backward: dL/dy per token [N] (reduction "none") → dX; dW accumulated.
        inputs_handle: a Forward's retained rows (X is then not sent)."""
        spec.setdefault("reduction", "none")
        return self._step(self._stub.Backward, head_id, hidden, targets,
                          grad_output=grad_output, **spec)

    def _step(self, rpc, head_id, hidden, targets, *, function="cross_entropy", params=None,
              reduction="mean", ignore_index=-100, normalizer=None, weights=None, aux=None,
              upstream_scale=1.0, accumulate=True, gradient_id=None,
              expected_weight_version=None, grad_output=None, retain_inputs_seconds=0.0,
              inputs_handle=None) -> StepResult:
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        n, d = hidden.shape
        if targets is not None:
            targets = targets.detach().reshape(-1)
        header = pb.StepHeader(head_id=head_id, rows=n, accumulate_weight_grad=accumulate,
                               upstream_scale=upstream_scale)
        header.function.name = function
        header.function.reduction = _REDUCTIONS[reduction]
        header.function.ignore_index = ignore_index
        for k, v in (params or {}).items():
            header.function.params[k] = float(v)
        if normalizer is not None:
            header.function.normalizer = float(normalizer)
        elif reduction == "mean":
            header.valid_tokens = (int((targets != ignore_index).sum()) if targets is not None
                                   else n)
        if accumulate:
            trainer, step, micro_batch = gradient_id or (f"py-{uuid.uuid4().hex[:12]}", 0, 0)
            header.gradient_id.trainer = trainer
            header.gradient_id.step = step
            header.gradient_id.micro_batch = micro_batch
        if expected_weight_version is not None:
            header.expected_weight_version = expected_weight_version
        header.retain_inputs_seconds = retain_inputs_seconds
        if inputs_handle:
            header.inputs_handle = inputs_handle
        row_bytes = d * hidden.element_size()

        def requests() -> Iterator[pb.StepRequest]:
            yield pb.StepRequest(header=header)
            for offset, count in _wire.row_chunks(n, row_bytes, self._chunk_bytes):
                m = pb.StepRequest()
                rows = m.rows
                rows.row_offset = offset
                if inputs_handle:
                    # The server kept the Forward's rows: only dL/dy travels (none for a scalar).
                    if grad_output is None:
                        return
                    _wire.encode(grad_output.detach().reshape(-1)[offset:offset + count],
                                 rows.grad_output)
                    yield m
                    continue
                _wire.encode(hidden[offset:offset + count], rows.hidden)
                if targets is not None:
                    _wire.encode(targets[offset:offset + count], rows.targets)
                if weights is not None:
                    _wire.encode(weights.detach().reshape(-1)[offset:offset + count], rows.weights)
                for name, t in (aux or {}).items():
                    _wire.encode(t.detach().reshape(-1)[offset:offset + count], rows.aux[name])
                if grad_output is not None:
                    _wire.encode(grad_output.detach().reshape(-1)[offset:offset + count],
                                 rows.grad_output)
                yield m

        def attempt():
            grad_hidden = outputs = summary = None
            for response in rpc(requests(), timeout=self._timeout):
                part = response.WhichOneof("part")
                if part == "summary":
                    summary = response.summary
                    continue
                chunk = getattr(response, part)
                values = _wire.decode(chunk.values)
                if part == "grad_hidden":
                    if grad_hidden is None:
                        grad_hidden = torch.empty((n, d), dtype=values.dtype)
                    grad_hidden[chunk.row_offset:chunk.row_offset + values.shape[0]] = values
                else:
                    if outputs is None:
                        outputs = torch.empty((n,), dtype=values.dtype)
                    outputs[chunk.row_offset:chunk.row_offset + values.shape[0]] = values
            return grad_hidden, outputs, summary

        grad_hidden, outputs, summary = self._call(attempt)
        if summary is None:
            raise RemoteheadError(grpc.StatusCode.INTERNAL, "summary: the stream ended without one")
        return StepResult(summary.loss, grad_hidden, outputs, summary)
