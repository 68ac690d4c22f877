"""Which of a mesh's replica fronts this trainer dials, and how it follows the mesh when its
replica is evicted (docs/meshes.md, "A mesh that survives a lost replica").

Trainer t dials fronts[t mod R]. With --mesh_min_replicas below R, a mesh whose replica r lost a
process evicts r and goes on in its next epoch, where trainer t is served by replica t mod R if
that serves, else by the serving replica live[t mod |live|] — the server's rule (mesh_epoch.h),
which the client never computes: it asks. When a call at its front fails for good (the front
refuses connections, answers that its replica is down or evicted, or that this trainer belongs
elsewhere), `follow` probes the fronts in order from the next one, each with a DescribeHead
naming the trainer (HeadRef.trainer_rank): a front that serves it answers; another names the
replica that does (WRONG_REPLICA), which is probed next; a mesh still changing epochs
(MESH_RECONFIGURING) is asked again. The probes go on for up to `patience` seconds, and stop at
once when a front says that the mesh is down (GROUP_UNAVAILABLE, not an evicted replica's: a mesh
without --mesh_min_replicas, or one that lost its leader's replica, goes down as a whole).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import grpc

from remotehead import _errors
from remotehead.v1 import head_service_pb2 as pb
from remotehead.v1 import head_service_pb2_grpc as pb_grpc

# How long one probe of a front may take (a front that is gone refuses at once).
_PROBE_SECONDS = 5.0


class Fronts:
    """A mesh's replica fronts (one address: a server or a group's front) and the one this
    trainer dials now (`replica`)."""

    def __init__(self, addresses: List[str], trainer: int):
        self.addresses = list(addresses)
        self.trainer = trainer
        self.replica = trainer % len(self.addresses)

    @property
    def meshed(self) -> bool:
        return len(self.addresses) > 1

    @property
    def target(self) -> str:
        return self.addresses[self.replica]

    def may_follow(self, error: grpc.RpcError) -> bool:
        """Whether `error` (a call at this trainer's front that failed for good) may mean that
        the mesh moved this trainer: the front is gone or down (UNAVAILABLE), or it names
        another replica (WRONG_REPLICA)."""
        if not self.meshed:
            return False
        reason, _ = _errors.error_info(error)
        if reason == "SERVER_DRAINING":
            return False
        return error.code() == grpc.StatusCode.UNAVAILABLE or reason == "WRONG_REPLICA"

    def follow(self, head_id: str, open_channel: Callable[[str], grpc.Channel],
               patience: float, initial_backoff: float, max_backoff: float
               ) -> Optional[Tuple[int, pb.HeadInfo]]:
        """The replica whose front serves this trainer now, and the head as that front describes
        it; None if no front said so within `patience` seconds."""
        r_count = len(self.addresses)
        order = [(self.replica + i) % r_count for i in range(1, r_count)] + [self.replica]
        deadline = time.monotonic() + patience
        pause = initial_backoff
        while True:
            queue, probed = list(order), set()
            while queue:
                replica = queue.pop(0)
                if replica in probed:
                    continue
                probed.add(replica)
                try:
                    return replica, self._probe(replica, head_id, open_channel)
                except grpc.RpcError as e:
                    reason, metadata = _errors.error_info(e)
                    named = metadata.get("replica", "")
                    if reason == "WRONG_REPLICA" and named.isdigit() and int(named) < r_count:
                        queue.insert(0, int(named))
                    elif reason == "GROUP_UNAVAILABLE" and "evicted" not in metadata:
                        return None  # the mesh is down (it does not evict): nothing to follow
            if time.monotonic() + pause > deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 2, max_backoff)

    def _probe(self, replica: int, head_id: str,
               open_channel: Callable[[str], grpc.Channel]) -> pb.HeadInfo:
        channel = open_channel(self.addresses[replica])
        try:
            stub = pb_grpc.HeadServiceStub(channel)
            return stub.DescribeHead(pb.HeadRef(head_id=head_id, trainer_rank=self.trainer),
                                     timeout=_PROBE_SECONDS)
        finally:
            channel.close()
