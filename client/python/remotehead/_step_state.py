"""Where a RemoteHead's trainer stands: the head as it last left it (its HeadInfo and the
server process it belongs to), the data-parallel processes it is a rank of, and the identity
of its next gradient contribution (trainer, step, micro_batch) — what each accumulating call
and each (synchronous) optimizer step carries.
"""

from __future__ import annotations

from typing import Optional

from remotehead.client import GradientId, HeadInfo
from remotehead.cluster import Cluster


class StepState:
    """One trainer process's position in training. `trainer`: its name, else `start`'s, else
    a random one — among several processes suffixed with the rank (Cluster.rank_trainer);
    `start` also gives the first step and micro-batch."""

    def __init__(self, info: HeadInfo, cluster: Cluster, trainer: Optional[str],
                 start: Optional[GradientId]):
        # The head as this trainer last left it: info.weight_version is the version it holds
        # (kept by every call that moves it; a checkpoint's export is pinned to it).
        self.info = info
        # Steps and optimizer steps carry the server process they belong to: once it restarted
        # they fail with ServerRestartedError instead of adding dW to a window that is gone.
        self.incarnation = info.incarnation
        self.cluster = cluster
        self.trainer = cluster.rank_trainer(
            trainer or (start.trainer if start is not None and start.trainer else None))
        self.step = start.step if start is not None else 0
        self.micro_batch = start.micro_batch if start is not None else 0
        # Whether a tied embedding's lookup took the current micro-batch's identity (its head
        # step not made yet): embedding_gradient_id.
        self._embedding_took_micro_batch = False

    def next_gradient_id(self) -> GradientId:
        """The identity of this micro-batch's contribution; the next call gets the next one."""
        gradient_id = GradientId(self.trainer, self.step, self.micro_batch)
        self.micro_batch += 1
        self._embedding_took_micro_batch = False
        return gradient_id

    def embedding_gradient_id(self) -> GradientId:
        """The identity of a tied embedding's gradient (remotehead.RemoteEmbedding), taken at its
        lookup: the one the head step of the same micro-batch will carry (the lookup comes
        first in the model's forward). The server keeps the two contributions apart and counts
        the micro-batch once. A second lookup before that step (two forwards in one micro-batch)
        starts a micro-batch of its own, so no two embedding gradients share an identity."""
        if self._embedding_took_micro_batch:
            self.micro_batch += 1
        self._embedding_took_micro_batch = True
        return GradientId(self.trainer, self.step, self.micro_batch)

    def next_step(self) -> None:
        self.step += 1
        self.micro_batch = 0
        self._embedding_took_micro_batch = False

    def optimizer_step_arguments(self, optimizer: dict) -> dict:
        """Client.optimizer_step's arguments `optimizer`, with what this trainer's step is
        pinned to where the caller did not say: gradients zeroed, this server process, and
        among several ranks the synchronous step `step` at the version this trainer holds."""
        optimizer.setdefault("zero_gradients", True)
        optimizer.setdefault("expected_incarnation", self.incarnation)
        if self.cluster.distributed:
            # Every rank must hold the same version: the server checks that they agree.
            optimizer.setdefault("expected_weight_version", self.info.weight_version)
            optimizer.setdefault("synchronous",
                                 (self.step, self.cluster.rank, self.cluster.world_size))
        return optimizer

    def restored(self, info: HeadInfo, step: Optional[int]) -> None:
        """The head put back to a saved state by this server process; gradient identities
        continue from `step` when given."""
        self.info = info
        self.incarnation = info.incarnation
        if step is not None:
            self.step, self.micro_batch = step, 0
            self._embedding_took_micro_batch = False
