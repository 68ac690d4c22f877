"""The client's exceptions (apart from client.py so that _wire.py can raise them too).

A failed call's kind travels as data: the server sends a google.rpc.ErrorInfo (reason, domain
"remotehead.dev", metadata such as the field, the head, the missing ranks) in the status
details, and `from_rpc_error` raises the exception class registered for that reason. Programs
catch the class or read `error.reason` / `error.metadata`; none matches message text."""

from typing import Dict, Optional

import grpc

# The trailer gRPC's richer error model uses, and the type URL of the detail we read from it.
_DETAILS_KEY = "grpc-status-details-bin"
_ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"
ERROR_DOMAIN = "remotehead.dev"


class RemoteheadError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message (or the
    client's, for a call it refused before sending anything), `reason` and `metadata` the
    machine-readable kind the server sent (google.rpc.ErrorInfo; the code's name when none)."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: Optional[str] = None,
                 metadata: Optional[Dict[str, str]] = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason or code.name
        self.metadata = dict(metadata or {})


def rename_field(error: RemoteheadError, field: str) -> RemoteheadError:
    """`error` naming `field` instead of the field its metadata names (a client translating the
    server's name for an input into its caller's): the metadata "field" and the message's
    leading field both, in place; the error itself returned (class, code and reason kept)."""
    old = error.metadata.get("field", "")
    if not old or old == field:
        return error
    error.metadata["field"] = field
    error.details = error.details.replace(f"{old}: ", f"{field}: ", 1)
    error.args = (f"{error.code.name}: {error.details}",)
    return error


class InvalidArgumentError(RemoteheadError, ValueError):
    """A bad argument (code INVALID_ARGUMENT, reason INVALID_FIELD; metadata "field" names it):
    refused by the client before sending, or by the server. Also a ValueError, Python's name for
    a bad argument."""

    def __init__(self, details: str, reason: Optional[str] = None,
                 metadata: Optional[Dict[str, str]] = None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, details, reason or "INVALID_FIELD",
                         metadata)


class ServerRestartedError(RemoteheadError):
    """The server restarted since this client learned its incarnation (reason SERVER_RESTARTED,
    code FAILED_PRECONDITION): the dW accumulated and the gradient ids sent before are gone, and
    the head is at the version restored from its saved state (metadata "weight_version"). Resume
    from the trainer checkpoint of that version (with transformers' Trainer:
    resume_from_checkpoint, and RemoteHeadCallback restores the head's state saved with it)."""


class HeadNotFoundError(RemoteheadError, KeyError):
    """No head of that id on the server (reason HEAD_NOT_FOUND; metadata "head")."""

    __str__ = Exception.__str__  # KeyError's would quote the message


class HeadExistsError(RemoteheadError):
    """A head of that id exists already (reason HEAD_EXISTS; metadata "head")."""


class WeightVersionMismatchError(RemoteheadError):
    """The head is at another weight version than the caller holds (reason
    WEIGHT_VERSION_MISMATCH; metadata "expected", "actual")."""


class RanksMissingError(RemoteheadError):
    """A synchronous optimizer step timed out waiting for ranks (reason RANKS_MISSING; metadata
    "missing_ranks", comma-separated): nothing was applied, the dW is kept."""


class RanksDisagreeError(RemoteheadError, ValueError):
    """The ranks of a synchronous optimizer step disagree (reason RANKS_DISAGREE; metadata
    "field"): nothing was applied."""


class GroupUnavailableError(RemoteheadError):
    """A head group is down or timed out (reason GROUP_UNAVAILABLE or GROUP_TIMEOUT; metadata
    "rank"): restart the group's ranks."""


class NotTheFrontError(RemoteheadError):
    """The call reached a rank of a head group that is not its front (reason NOT_THE_FRONT, code
    FAILED_PRECONDITION): only the front serves the head calls. `front` is the address to dial
    instead (metadata "front"; "" while the front has not announced it yet)."""

    @property
    def front(self) -> str:
        return self.metadata.get("front", "")


class NotTheLeaderError(RemoteheadError):
    """An operation that changes every replica of a mesh (create, upload, drop, zero, an
    unsynchronized optimizer step, restore) reached a replica's front other than the mesh's
    leader (reason NOT_THE_LEADER, code FAILED_PRECONDITION). `leader` is the address to dial
    (metadata "leader"; "" while the leader has not announced it). The Client follows it by
    itself once."""

    @property
    def leader(self) -> str:
        return self.metadata.get("leader", "")


class WrongReplicaError(RemoteheadError, ValueError):
    """A synchronous step's trainer dialled another replica's front than its own (reason
    WRONG_REPLICA; metadata "replica": the one to dial, rank mod R)."""


class MeshReconfiguringError(RemoteheadError):
    """A mesh lost a replica and changes epochs (reason MESH_RECONFIGURING, code UNAVAILABLE;
    metadata "epoch", "evicted"): nothing of the call was applied. The Client asks again by
    itself for up to `reconfigure_timeout` seconds."""


class ReplicaMovedError(RemoteheadError):
    """This trainer's replica of a mesh was evicted (or its front is gone) and the Client now
    dials the front of the replica that serves it in the mesh's new epoch (raised by the client,
    reason REPLICA_MOVED, code UNAVAILABLE). The dW its calls added since its last optimizer step
    went with the old replica: resend those calls (RemoteHead replays them by itself), with the
    new front's incarnation (`info.incarnation`). `info`: the head as the new front describes it
    (a weight_version past the trainer's means the step in flight was applied after all).
    `kept`: the old front still serves and keeps that dW (it answered WRONG_REPLICA: the mesh
    admitted this trainer's replica again, or reassigned it): nothing to resend."""

    def __init__(self, details: str, from_replica: int, to_replica: int, info,
                 kept: bool = False):
        super().__init__(grpc.StatusCode.UNAVAILABLE, details, "REPLICA_MOVED",
                         {"from_replica": str(from_replica), "to_replica": str(to_replica),
                          "kept": "true" if kept else "false"})
        self.from_replica = from_replica
        self.to_replica = to_replica
        self.info = info
        self.kept = kept


class ReplicasDivergedError(RemoteheadError):
    """A mesh's replicas hold different weights or versions (reason REPLICAS_DIVERGED, metadata
    "replicas"): restore every replica from one state."""


class HeadFrozenError(RemoteheadError):
    """A frozen head (created or uploaded with frozen=True: a distillation teacher, a
    reference) was asked to accumulate dW or to take an optimizer step (reason HEAD_FROZEN;
    metadata "head"). Step it with accumulate=False, or use a head that is not frozen."""


class TeacherIncompatibleError(RemoteheadError):
    """A step's teacher head (StepOptions.teacher) cannot be its student's teacher (reason
    TEACHER_INCOMPATIBLE): not frozen, another vocabulary size or layout, or the student itself.
    metadata "teacher", "field" ("frozen", "vocab_size", "shards", "teacher_head_id"),
    "expected", "actual"."""


# The one table from a reason to its exception class; any other reason is a RemoteheadError
# carrying it.
_BY_REASON = {
    "INVALID_FIELD": InvalidArgumentError,
    "SERVER_RESTARTED": ServerRestartedError,
    "HEAD_NOT_FOUND": HeadNotFoundError,
    "HEAD_EXISTS": HeadExistsError,
    "WEIGHT_VERSION_MISMATCH": WeightVersionMismatchError,
    "RANKS_MISSING": RanksMissingError,
    "RANKS_DISAGREE": RanksDisagreeError,
    "GROUP_UNAVAILABLE": GroupUnavailableError,
    "GROUP_TIMEOUT": GroupUnavailableError,
    "NOT_THE_FRONT": NotTheFrontError,
    "NOT_THE_LEADER": NotTheLeaderError,
    "WRONG_REPLICA": WrongReplicaError,
    "MESH_RECONFIGURING": MeshReconfiguringError,
    "REPLICAS_DIVERGED": ReplicasDivergedError,
    "HEAD_FROZEN": HeadFrozenError,
    "TEACHER_INCOMPATIBLE": TeacherIncompatibleError,
}


def error_info(error: grpc.RpcError):
    """The (reason, metadata) of a failed call's google.rpc.ErrorInfo; (None, {}) without one
    (a status made by gRPC itself, e.g. a deadline or an unreachable server)."""
    from remotehead.v1 import head_service_pb2 as pb
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key != _DETAILS_KEY:
            continue
        status = pb.RpcStatus.FromString(value)
        for detail in status.details:
            if detail.type_url == _ERROR_INFO_TYPE:
                info = pb.ErrorInfo.FromString(detail.value)
                if info.domain == ERROR_DOMAIN:
                    return info.reason, dict(info.metadata)
    return None, {}


def from_rpc_error(error: grpc.RpcError) -> RemoteheadError:
    """The exception for a failed call, typed by its reason."""
    reason, metadata = error_info(error)
    cls = _BY_REASON.get(reason, RemoteheadError)
    if cls is InvalidArgumentError:
        return InvalidArgumentError(error.details() or "", reason, metadata)
    return cls(error.code(), error.details() or "", reason, metadata)
