"""The Python client of a remotehead server: one method per RPC, torch tensors in and out, and
the retries around them (`Client._call`).

Step calls stream: gRPC sends the header and X's row chunks from its own thread while this one
receives dX chunks as the server produces them. Server errors surface as RemoteheadError.

What a step computes is step_options.py's (StepOptions); what it sends and how its answer is
read, _steps.py's (StepResult, and the C++ client's PrepareStep to the byte); tensors on the
wire and the row-chunk rule, _wire.py's; the functions a server lists, functions.py's; the
exceptions, _errors.py's; a .safetensors file written from a server's stream, _safetensors.py's;
what the server says of a head (HeadInfo), _head_info.py's.
"""

from __future__ import annotations

import os
import random
import secrets
import time
from typing import (Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar,
                    Union)

import grpc
import torch

from remotehead import (_compaction, _embedding_calls, _errors, _mesh_fronts, _safetensors,
                        _steps, _wire)
from remotehead._head_info import HeadInfo, head_info as _info  # noqa: F401 (re-exported)
from remotehead._striping import merged_responses
# Re-exported: remotehead.client.X is where these have always been imported from.
from remotehead._errors import (InvalidArgumentError, RemoteheadError,  # noqa: F401
                                ServerRestartedError)
from remotehead._steps import StepResult, StepSummary, StepTimings  # noqa: F401
from remotehead.step_options import GradientId, StepOptions, check_option_names  # noqa: F401
from remotehead._wire import framing_bytes, shape_text
from remotehead.functions import FunctionInfo, function_info
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc

T = TypeVar("T")


def trainer_rank(rank: Optional[int] = None) -> int:
    """This trainer's rank: `rank` if given, else torch.distributed's (once initialised), else
    torchrun's RANK, else 0. A client given a mesh's fronts dials fronts[rank mod R]."""
    if rank is not None:
        return rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _assemble(pieces) -> Optional[torch.Tensor]:
    """Row chunks (offset, tensor) as one tensor, in row order; None if there were none."""
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]) if pieces else None


class Client:
    """A connection to one remotehead server. Thread-safe, like the gRPC channel under it.

    `target`: the server's (or a head group's front's) address, or the list of a mesh's
    replica fronts [replica 0's, replica 1's, …]: this trainer then dials fronts[rank mod R]
    (`rank`, else torch.distributed's, else RANK; `self.target` says which) for its steps, and
    the operations that change every replica (create, upload, drop, zero, an unsynchronized
    optimizer step, restore) go to the leader, fronts[0]. Given one front that is not the
    leader, the client follows the leader's address that the front names (NotTheLeaderError).
    On a mesh that evicts a lost replica (--mesh_min_replicas), a call at a front that changes
    epochs is asked again for up to `reconfigure_timeout` seconds; when this trainer's replica is
    evicted, the client finds the front that serves it now and raises ReplicaMovedError (its dW
    since the last step went with the replica: RemoteHead replays it by itself). `moves` counts
    those moves, `replays` the calls replayed after them.

    TLS: pass `root_certificates` (PEM bytes; plus `private_key` and `certificate_chain` for
    mTLS). `token` is sent as `authorization: Bearer <token>`, only over TLS.
    `chunk_bytes` (>= 1024): the largest request message; rows of X (with their targets,
    weights, aux, grad_output) and uploaded weight rows are split so that no message exceeds
    it, by the same rule as the C++ client (same chunk_bytes, same row messages).
    `streams` (1 to 64): the parallel streams each step call is striped over
    (StepHeader.stripe): row message i goes on stream i mod `streams`, each stream after the
    first on a connection of its own, and results come back on all of them — exactly those of
    one stream. A failed or cancelled stream fails the attempt, which is retried as a whole.
    """

    def __init__(self, target: Union[str, Sequence[str]], *, rank: Optional[int] = None,
                 root_certificates: Optional[bytes] = None,
                 private_key: Optional[bytes] = None, certificate_chain: Optional[bytes] = None,
                 token: Optional[str] = None, chunk_bytes: int = 1 << 20,
                 max_message_bytes: int = 64 << 20, timeout: Optional[float] = None,
                 max_attempts: int = 5, initial_backoff: float = 0.05,
                 max_backoff: float = 2.0, streams: int = 1, reconfigure_timeout: float = 120.0):
        if chunk_bytes < 1024:
            raise InvalidArgumentError(f"chunk_bytes: expected >= 1024; got {chunk_bytes}")
        if not 1 <= streams <= 64:
            raise InvalidArgumentError(f"streams: expected 1 to 64; got {streams}")
        # Reconnect as fast as calls are retried (gRPC's default first reconnect waits 1 s).
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.initial_reconnect_backoff_ms", int(initial_backoff * 1000)),
                   ("grpc.min_reconnect_backoff_ms", int(initial_backoff * 1000)),
                   ("grpc.max_reconnect_backoff_ms", int(max_backoff * 1000))]
        credentials = None
        if root_certificates is not None or token is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)
            if token is not None:
                credentials = grpc.composite_channel_credentials(
                    credentials, grpc.access_token_call_credentials(token))
        self._open = lambda address, extra=(): (
            grpc.secure_channel(address, credentials, options + list(extra))
            if credentials is not None else grpc.insecure_channel(address, options + list(extra)))
        fronts = [target] if isinstance(target, str) else list(target)
        if not fronts:
            raise InvalidArgumentError("target: expected an address or a list of replica fronts")
        # A mesh's replica fronts: this trainer dials fronts[rank mod R] (until its replica is
        # evicted); what changes every replica goes to the leader, fronts[0].
        self._fronts = _mesh_fronts.Fronts(fronts, trainer_rank(rank))
        self._streams = streams
        self._dial_front()
        self._leader_channel = None
        self._leader_stub = None
        self._leader_target = ""
        if self.target != fronts[0]:
            self._connect_leader(fronts[0])
        self._reconfigure_timeout = reconfigure_timeout
        self.moves = 0    # times this trainer moved to another replica's front
        self.replays = 0  # calls replayed after a move (RemoteHead's journal)
        self._chunk_bytes = chunk_bytes
        self._timeout = timeout
        self._max_attempts = max(1, max_attempts)
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self.retries = 0  # attempts repeated after UNAVAILABLE, over this client's life
        self._functions: Optional[Dict[str, FunctionInfo]] = None  # functions(), once
        self._handle_rows = _compaction.HandleRows()  # what forwards that kept inputs left out

    def _dial_front(self) -> None:
        """Channels to this trainer's front (Fronts.target)."""
        self.target = self._fronts.target
        self._channel = self._open(self.target)
        self._stub = pb_grpc.HeadServiceStub(self._channel)
        # A striped step's streams after the first, each on a connection of its own (a channel
        # that shares no subchannel), so that they do not queue behind one another on one socket.
        self._stripe_channels = [self._open(self.target, [("grpc.use_local_subchannel_pool", 1)])
                                 for _ in range(self._streams - 1)]

    def _close_front(self) -> None:
        self._channel.close()
        for channel in self._stripe_channels:
            channel.close()

    @property
    def replica(self) -> int:
        """The mesh replica whose front this trainer dials (0 off a mesh)."""
        return self._fronts.replica

    @property
    def meshed(self) -> bool:
        """Whether this client knows a mesh's fronts (a list of addresses)."""
        return self._fronts.meshed

    def close(self) -> None:
        self._close_front()
        if self._leader_channel is not None:
            self._leader_channel.close()

    def _connect_leader(self, address: str) -> None:
        if self._leader_channel is not None:
            self._leader_channel.close()
        self._leader_channel = self._open(address)
        self._leader_stub = pb_grpc.HeadServiceStub(self._leader_channel)
        self._leader_target = address

    def _to_leader(self, call):
        """`call(stub)` for an operation that changes every replica of a mesh: on the leader's
        stub once known; a replica's front that says it is not the leader names it
        (NotTheLeaderError), and the call goes there once. A leader that is gone (UNAVAILABLE
        once the retries are spent) may have been evicted — with its store in a process of its
        own (--group_store_external) a mesh survives that, led by its next serving replica — so
        the other fronts are asked in order, each of which serves the call or names the leader."""
        try:
            return self._on_leader(call)
        except _errors.RemoteheadError as e:
            if not self.meshed or e.code != grpc.StatusCode.UNAVAILABLE \
                    or e.reason == "SERVER_DRAINING":
                raise
            gone = e
        tried = self._leader_address()
        for address in self._fronts.addresses:
            if address == tried:
                continue
            self._connect_leader(address)
            try:
                return self._on_leader(call)
            except _errors.RemoteheadError as e:  # gone too, or it names no leader yet
                if e.code != grpc.StatusCode.UNAVAILABLE and e.reason != "NOT_THE_LEADER":
                    raise
        raise gone

    def _leader_address(self) -> str:
        """Where this client asks the leader now: the leader's stub's address, else its front's."""
        return self._leader_target if self._leader_stub is not None else self.target

    def _on_leader(self, call):
        """`call` on the leader as known (its stub, else this trainer's front's), following a
        NOT_THE_LEADER's address once."""
        try:
            return call(self._leader_stub or self._stub)
        except _errors.NotTheLeaderError as e:
            if not e.leader or e.leader == self._leader_address():
                raise
            self._connect_leader(e.leader)
            return call(self._leader_stub)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, attempt, retry: bool = True, head_id: Optional[str] = None):
        """Runs `attempt()` (one whole RPC), again after UNAVAILABLE (no server yet, a restart,
        a dropped connection) with exponential backoff and jitter; never on another code. Step
        calls keep their gradient id across attempts, so the server's exactly-once ledger makes
        a replay of work that did reach it add nothing (summary.replayed). A mesh changing
        epochs (MESH_RECONFIGURING) is asked again for up to reconfigure_timeout. `head_id`: a
        call at this trainer's own front, which follows the mesh when its replica is evicted
        (_mesh_fronts.py): ReplicaMovedError once it dials another replica's front."""
        backoff = self._initial_backoff
        attempt_number, reconfiguring_until, followed = 0, None, False
        while True:
            attempt_number += 1
            try:
                return attempt()
            except grpc.RpcError as e:
                reason, _ = _errors.error_info(e)
                if reason == "MESH_RECONFIGURING" and e.code() == grpc.StatusCode.UNAVAILABLE:
                    reconfiguring_until = reconfiguring_until or (time.monotonic()
                                                                  + self._reconfigure_timeout)
                    if time.monotonic() < reconfiguring_until:
                        attempt_number -= 1  # the mesh's change is waited out, not counted
                        error = None
                    else:
                        error = e
                else:
                    error = e
                # A reason says what no retry fixes (a group that is down, a draining server
                # is retried: another attempt may reach a healthy process).
                if error is not None and (not retry or e.code() != grpc.StatusCode.UNAVAILABLE
                                          or attempt_number >= self._max_attempts):
                    if head_id is None or followed or not self._fronts.may_follow(e):
                        raise _errors.from_rpc_error(e) from None
                    followed = True
                    self._follow_mesh(head_id, e)  # this front serves it still: once more
                    attempt_number = 0
                    continue
            self.retries += 1
            time.sleep(backoff * random.uniform(0.9, 1.1))
            backoff = min(backoff * 2, self._max_backoff)

    def _follow_mesh(self, head_id: str, error: grpc.RpcError) -> None:
        """After `error` at this trainer's front: returns if that front still serves it;
        ReplicaMovedError once the client dials the front that does; `error` if none says so."""
        found = self._fronts.follow(head_id, self._open, self._reconfigure_timeout,
                                    self._initial_backoff, self._max_backoff)
        if found is None:
            raise _errors.from_rpc_error(error) from None
        replica, info = found
        old = self._fronts.replica
        if replica == old:
            return
        self._close_front()
        self._fronts.replica = replica
        self._dial_front()
        self.moves += 1
        reason, _ = _errors.error_info(error)
        if reason == "WRONG_REPLICA":  # the old front answered: it serves, and keeps its dW
            raise _errors.ReplicaMovedError(
                f"replica {old}'s front serves this trainer no more ({error.details()}); this "
                f"trainer (rank {self._fronts.trainer}) now dials replica {replica}'s front at "
                f"{self.target}; the dW its calls added at replica {old} stays there",
                old, replica, _info(info), kept=True)
        raise _errors.ReplicaMovedError(
            f"replica {old}'s front is gone or evicted ({error.details()}); this trainer "
            f"(rank {self._fronts.trainer}) now dials replica {replica}'s front at "
            f"{self.target}: the dW its calls added since its last optimizer step went with "
            f"replica {old}; resend them (RemoteHead replays them by itself)",
            old, replica, _info(info))

    def _unary(self, method, request, retry: bool = True):
        return self._call(lambda: method(request, timeout=self._timeout), retry)

    def _at_own_front(self, method: str, request, retry: bool = True, head_id: str = ""):
        """A unary call at this trainer's front, which follows the mesh (_call's head_id)."""
        return self._call(lambda: getattr(self._stub, method)(request, timeout=self._timeout),
                          retry, head_id)

    # ----- heads -----

    def create_head(self, head_id: str, vocab_size: int, hidden_size: int, *,
                    dtype: torch.dtype = torch.float32, bias: bool = False, seed: int = 0,
                    init_std: float = 0.02, frozen: bool = False,
                    grad_dtype: Optional[torch.dtype] = None) -> HeadInfo:
        """A new head initialised on the server (normal(0, init_std) from `seed`). frozen=True:
        no dW, no optimizer step (HeadInfo.frozen; a distillation teacher). grad_dtype: the dW
        accumulators' dtype — None, float32 (float64 for a float64 head); the head's own bf16 /
        fp16, the memory mode: half the gradient memory, each chunk's dW computed in fp32 and
        rounded once as it is added (docs/engine.md gives its accuracy)."""
        request = pb.CreateHeadRequest(head_id=head_id, dtype=_wire.wire_dtype(dtype),
                                       frozen=frozen)
        if grad_dtype is not None:
            request.grad_dtype = _wire.wire_dtype(grad_dtype, "grad_dtype")
        request.init.vocab_size = vocab_size
        request.init.hidden_size = hidden_size
        request.init.bias = bias
        request.init.seed = seed
        request.init.init_std = init_std
        return _info(self._to_leader(lambda stub: self._unary(stub.CreateHead, request)))

    def upload_head(self, head_id: str, weight: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, *, replace: bool = False,
                    frozen: bool = False, grad_dtype: Optional[torch.dtype] = None) -> HeadInfo:
        """Streams W [V, D] (and b [V]) to the server as head `head_id`, in W's dtype.
        replace=True: new weights for an existing head of the same shape, dtype, bias and
        frozen flag (its gradients must be zero; its optimizer state is reset; its version goes
        up by one), or a new head if there is none. frozen=True: a head that never accumulates
        dW nor takes an optimizer step (HeadInfo.frozen): a distillation teacher, a reference
        model. grad_dtype: as create_head's (with replace: None or the head's)."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            got = shape_text(weight) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise InvalidArgumentError(f"weight: expected a floating [V, D] tensor; got {got}")
        w = _wire.to_wire_layout(weight)
        vocab, hidden_size = w.shape
        # The server stores the bias in the head's (weight's) dtype.
        b = _wire.to_wire_layout(bias, w.dtype) if bias is not None else None
        if b is not None and tuple(b.shape) != (vocab,):
            raise InvalidArgumentError(f"bias: expected shape [{vocab}]; got {shape_text(b)}")
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
            header.header.frozen = frozen
            if grad_dtype is not None:
                header.header.grad_dtype = _wire.wire_dtype(grad_dtype, "grad_dtype")
            yield header
            for name, t, chunks in parts:
                for offset, n in chunks:
                    m = pb.UploadHeadRequest()
                    chunk = getattr(m, name)
                    chunk.row_offset = offset
                    _wire.encode(t[offset:offset + n], chunk.values)
                    yield m

        return _info(self._to_leader(lambda stub: self._call(
            lambda: stub.UploadHead(requests(), timeout=self._timeout))))

    def describe_head(self, head_id: str) -> HeadInfo:
        return _info(self._at_own_front("DescribeHead", pb.HeadRef(head_id=head_id),
                                        head_id=head_id))

    def functions(self) -> Dict[str, FunctionInfo]:
        """Every function the server computes, by name (ListFunctions), asked once per
        Client (on a mesh, where the leader's calls go: any front that is there answers)."""
        if self._functions is None:
            response = self._to_leader(
                lambda stub: self._unary(stub.ListFunctions, pb.ListFunctionsRequest()))
            self._functions = {f.name: function_info(f) for f in response.functions}
        return self._functions

    def list_heads(self) -> List[HeadInfo]:
        """Every head of the server (on a mesh, of every replica alike: asked where the leader's
        calls go, and of the other fronts while that one is gone, as functions() is)."""
        response = self._to_leader(lambda stub: self._unary(stub.ListHeads,
                                                            pb.ListHeadsRequest()))
        return [_info(h) for h in response.heads]

    def drop_head(self, head_id: str) -> None:
        self._to_leader(lambda stub: self._unary(stub.DropHead, pb.HeadRef(head_id=head_id)))

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
        try:
            parts = self._read_row_stream(self._stub.ExportWeights, request, head_id=head_id)
        except _errors.ReplicaMovedError:  # a read: nothing to resend at the front that serves
            parts = self._read_row_stream(self._stub.ExportWeights, request, head_id=head_id)
        return _assemble(parts.get("weight_rows")), _assemble(parts.get("bias_rows"))

    def _read_row_stream(self, rpc, request, head_id: Optional[str] = None) -> Dict[str, list]:
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

        return self._call(attempt, head_id=head_id)

    # ----- gradients and optimizer -----

    def fetch_gradients(self, head_id: str, dtype: Optional[torch.dtype] = None
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], HeadInfo]:
        """The accumulated dW [V, D] and db [V] (None without bias), and the head's state.
        dtype None: the accumulator's (float32). On a mesh: every replica's, summed by the
        leader (the dW its next step applies)."""
        request = pb.FetchGradientsRequest(head_id=head_id)
        if dtype is not None:
            request.dtype = _wire.wire_dtype(dtype)
        parts = self._to_leader(
            lambda stub: self._read_row_stream(stub.FetchGradients, request))
        return (_assemble(parts.get("weight_grad_rows")), _assemble(parts.get("bias_grad_rows")),
                parts.get("info"))

    def zero_gradients(self, head_id: str) -> HeadInfo:
        return _info(self._to_leader(
            lambda stub: self._unary(stub.ZeroGradients, pb.HeadRef(head_id=head_id))).info)

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
        if synchronous is not None:  # at this trainer's own replica
            return _info(self._at_own_front("OptimizerStep", request, head_id=head_id).info)
        return _info(self._to_leader(
            lambda stub: self._unary(stub.OptimizerStep, request, retry=False)).info)

    # ----- tied embeddings (remotehead.RemoteEmbedding; _embedding_calls.py) -----

    def embedding_lookup(self, head_id: str, ids, *, dtype: Optional[torch.dtype] = None,
                         expected_incarnation: str = "",
                         expected_weight_version: Optional[int] = None
                         ) -> Tuple[torch.Tensor, int]:
        """(W[ids] [n, D] in `dtype` (default the head's), the weight version they are of).
        ids: int [n], repeats allowed. Pins as read_weight_rows'."""
        request = _embedding_calls.lookup_request(head_id, ids, dtype, expected_incarnation,
                                                  expected_weight_version)
        parts = self._read_row_stream(self._stub.EmbeddingLookup, request, head_id)
        info = parts["info"]
        return (_embedding_calls.lookup_rows(parts.get("rows"), len(request.ids), info, dtype),
                info.weight_version)

    def embedding_gradient(self, head_id: str, ids, grad: torch.Tensor, *, gradient_id,
                           expected_incarnation: str = "",
                           expected_weight_version: Optional[int] = None
                           ) -> "_embedding_calls.EmbeddingGradientResult":
        """dW[ids] += grad [n, D] (any float dtype; repeats add up), exactly once per
        gradient_id (kept apart from the head steps' under the same id); expected_weight_version:
        the lookup's. Retried after UNAVAILABLE, same id. Returns (replayed, info)."""
        messages = _embedding_calls.gradient_messages(
            head_id, ids, grad, gradient_id, expected_incarnation, expected_weight_version,
            self._chunk_bytes)
        response = self._call(lambda: self._stub.EmbeddingGradient(messages(),
                                                                   timeout=self._timeout),
                              head_id=head_id)
        return _embedding_calls.EmbeddingGradientResult(response.replayed, _info(response.info))

    # ----- durable training state (a server started with --state_dir) -----

    def save_head_state(self, head_id: str) -> HeadInfo:
        """Writes the head's whole training state (weights, optimizer state, version) on the
        server now (on a head group or a mesh: every rank its shard, under one state id); the
        returned info's state_id names it for restore_head_state."""
        return _info(self._to_leader(
            lambda stub: self._unary(stub.SaveHeadState, pb.HeadRef(head_id=head_id))).info)

    def restore_head_state(self, head_id: str, state_id: str) -> HeadInfo:
        """Puts the head back to a saved state (weights, optimizer state, version); its
        gradients are zeroed."""
        request = pb.RestoreHeadStateRequest(head_id=head_id, state_id=state_id)
        return _info(self._to_leader(lambda stub: self._unary(stub.RestoreHeadState, request)))

    # ----- steps -----
    #
    # hidden is [..., D] (flattened to N rows); targets, weights, aux and grad_output hold one
    # value per row, in any shape of N elements; an aux input shaped [..., k] like hidden
    # (hidden's leading dimensions, then k) holds k values per row (a function's topk_aux).
    # teacher_hidden ([..., D_teacher], N rows) goes with a two-head function's rows: the
    # hidden states of the teacher head named by the `teacher` option, sent as they are (the
    # server expects the teacher head's dtype). Tensors may live on any device.

    def forward_backward(self, head_id: str, hidden: torch.Tensor,
                         targets: Optional[torch.Tensor], options: Optional[StepOptions] = None,
                         *, weights: Optional[torch.Tensor] = None,
                         aux: Optional[Mapping[str, torch.Tensor]] = None,
                         teacher_hidden: Optional[torch.Tensor] = None,
                         **overrides) -> StepResult:
        """Fused step: the loss, dX [N, D] (× upstream_scale) and, with accumulate, dW added on
        the server, in one pass. Needs a scalar reduction and, when accumulating, a
        gradient_id.

        options: a StepOptions (default StepOptions()); any of its fields may also be passed
        as a keyword argument (function, params, reduction, ignore_index, normalizer,
        valid_tokens, chunk_rows, memory_budget_bytes, upstream_scale, accumulate,
        gradient_id, expected_weight_version, wire_dtype, teacher), applied over it; an
        unknown keyword is a TypeError listing the valid ones. help(remotehead.StepOptions)
        explains each. weights [N]: per-token weights ("weighted_sum"); aux: extra per-token
        inputs by name, e.g. GRPO's {"advantages": ..., "old_logprobs": ..., "ref_logprobs":
        ...}, a sparse teacher's {"teacher_topk_ids": [N, k] int64, "teacher_topk_logprobs":
        [N, k]}; teacher_hidden: the teacher's hidden states for a two-head function
        (function="distill_kl", teacher="<frozen head>").
        """
        o = _steps.resolve(options, overrides, StepOptions())
        return self._step(_steps.FORWARD_BACKWARD, head_id, hidden, targets, weights, aux, None, o,
                          teacher_hidden)

    def forward(self, head_id: str, hidden: torch.Tensor, targets: Optional[torch.Tensor],
                options: Optional[StepOptions] = None, *,
                weights: Optional[torch.Tensor] = None,
                aux: Optional[Mapping[str, torch.Tensor]] = None,
                teacher_hidden: Optional[torch.Tensor] = None, **overrides) -> StepResult:
        """Outputs only, nothing accumulated (the accumulate and gradient_id options are not
        sent): per-token outputs [N] for reduction "none", else the reduced loss.

        options: a StepOptions, default StepOptions(reduction="none"); keyword overrides as in
        forward_backward. retain_inputs_seconds > 0 keeps the rows on the server for a
        backward by summary.inputs_handle.
        """
        o = _steps.resolve(options, overrides, StepOptions(reduction="none"))
        return self._step(_steps.FORWARD, head_id, hidden, targets, weights, aux, None, o,
                          teacher_hidden)

    def backward(self, head_id: str, hidden: torch.Tensor, targets: Optional[torch.Tensor],
                 grad_output: Union[torch.Tensor, float], options: Optional[StepOptions] = None,
                 *, weights: Optional[torch.Tensor] = None,
                 aux: Optional[Mapping[str, torch.Tensor]] = None,
                 teacher_hidden: Optional[torch.Tensor] = None,
                 **overrides) -> StepResult:
        """Two-phase backward: the server recomputes the logits, returns dX [N, D] and (with
        accumulate) adds dW, exactly once per gradient_id.

        grad_output: dL/dy per row [N] for reduction "none"; for a scalar reduction ("sum",
        "mean", "weighted_sum") one value, dL/d(loss) (a number or a one-element floating
        tensor), which travels as the header's upstream_scale: anything else is refused
        (InvalidArgumentError naming grad_output).

        options: a StepOptions, default StepOptions(reduction="none"); keyword overrides as in
        forward_backward. inputs_handle: a forward's summary.inputs_handle (X is then not
        sent, nor teacher_hidden; hidden still gives N, D and dX's dtype).
        """
        o = _steps.resolve(options, overrides, StepOptions(reduction="none"))
        return self._step(_steps.BACKWARD, head_id, hidden, targets, weights, aux, grad_output, o,
                          teacher_hidden)

    # ----- generation -----

    def logits(self, head_id: str, hidden: torch.Tensor, *, dtype: torch.dtype = torch.float32,
               params: Optional[Mapping[str, float]] = None, **overrides) -> torch.Tensor:
        """The logits of the rows of `hidden` [..., D]: [..., V] in `dtype`, streamed from the
        server a few rows at a time (a Forward of the function "logits"). Ask only for the rows
        you need (e.g. the last position of each sequence when decoding): the result is V values
        per row. params: the common "temperature" and "softcap" (default: the raw logits)."""
        o = _steps.resolve(None, {**overrides, "function": "logits", "reduction": "none",
                            "params": dict(params or {}), "output_dtype": dtype},
                     StepOptions())
        result = self._step(_steps.FORWARD, head_id, hidden, None, None, None, None, o)
        return result.outputs.to(hidden.device).reshape(*hidden.shape[:-1], -1)

    def sample(self, head_id: str, hidden: torch.Tensor, *, greedy: bool = False,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               softcap: float = 0.0, min_p: float = 0.0, min_p_first: bool = False,
               **overrides) -> Tuple[torch.Tensor, torch.Tensor]:
        """One token drawn on the server for each row of `hidden` [..., D] (function "sample"):
        (token ids [...] int64, their log-probabilities [...] float32): B·D up, B ids down.
        Hugging Face's pipeline: softcap, temperature, top_k (0: off), top_p (1: off), min_p (0:
        off; min_p_first: first, vLLM's order); row r draws torch.multinomial(p, 1) with a CPU
        generator seeded with seed + r; greedy: the argmax. The log-probability is under the full
        softmax(logits / temperature); token_logprobs with the same top_k / top_p / min_p /
        min_p_first gives it under the distribution drawn from (docs/engine.md)."""
        params = {"greedy": 1.0 if greedy else 0.0, "temperature": float(temperature),
                  "top_k": float(top_k), "top_p": float(top_p), "min_p": float(min_p),
                  "min_p_first": 1.0 if min_p_first else 0.0, "seed": float(seed),
                  "softcap": float(softcap)}
        o = _steps.resolve(None, {**overrides, "function": "sample", "reduction": "none",
                                  "params": params}, StepOptions())
        result = self._step(_steps.FORWARD, head_id, hidden, None, None, None, None, o)
        shape = hidden.shape[:-1]
        return (result.token_ids.to(hidden.device).reshape(shape),
                result.outputs.to(hidden.device).reshape(shape))

    def read_weight_rows(self, head_id: str, read: Callable[[Iterator], T], *,
                         dtype: Optional[torch.dtype] = None, expected_incarnation: str = "",
                         expected_weight_version: Optional[int] = None) -> T:
        """Streams the head's W [V, D] (in `dtype`, default its own) as its row chunks
        (remotehead.v1.TensorChunk messages, in order) into `read(chunks)`, under the retry
        policy: after UNAVAILABLE, `read` is called again with a new stream from the first row
        (it starts over). W is never held here whole. expected_incarnation /
        expected_weight_version pin the export to the server process and the head version the
        caller holds: once the server restarted, ServerRestartedError (a retry that reaches the
        new process too); a head at another version, FAILED_PRECONDITION naming both. "" / None:
        unchecked. Returns what `read` returned."""
        request = pb.ExportWeightsRequest(head_id=head_id,
                                          expected_incarnation=expected_incarnation)
        if dtype is not None:
            request.dtype = _wire.wire_dtype(dtype)
        if expected_weight_version is not None:
            request.expected_weight_version = expected_weight_version

        def attempt():
            return read(r.weight_rows for r in self._stub.ExportWeights(request,
                                                                        timeout=self._timeout)
                        if r.WhichOneof("part") == "weight_rows")

        return self._call(attempt)

    def _step(self, mode: str, head_id: str, hidden, targets, weights, aux, grad_output,
              o: StepOptions, teacher_hidden=None) -> StepResult:
        per_token = mode == _steps.FORWARD and o.reduction == "none"
        # What the rows come back as, and whether its ignored rows travel, is the function's, as
        # the server lists it.
        listed = (self.functions().get(o.function)
                  if per_token or _compaction.may_compact(o, targets) else None)
        fn = listed if per_token else None
        by_handle = o.inputs_handle if mode == _steps.BACKWARD else ""
        p = _steps.prepare_step(mode, head_id, hidden, targets, weights, aux, grad_output, o,
                                self._chunk_bytes, teacher_hidden,
                                self._handle_rows.for_step(by_handle, o, listed))
        rpcs = [_steps.step_rpc(c, mode) for c in (self._channel, *self._stripe_channels)]

        def attempt():
            # Every attempt fills fresh results (a failed one may have sent some rows), a striped
            # one under a key of its own.
            if len(rpcs) == 1:
                call = rpcs[0](p.frames(), timeout=self._timeout)
                return _steps.receive(p, mode, fn, o.output_dtype, call)
            key = secrets.token_hex(16)
            calls = [rpc(p.frames((key, len(rpcs), i)), timeout=self._timeout)
                     for i, rpc in enumerate(rpcs)]
            return _steps.receive(p, mode, fn, o.output_dtype, merged_responses(calls), any_order=True)

        received = _steps.in_callers_rows(p, lambda: self._call(attempt, head_id=head_id))
        result = _steps.step_result(mode, per_token, received, p)
        self._handle_rows.after_step(p, result.summary.inputs_handle, by_handle)
        return result
