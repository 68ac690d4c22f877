"""The data-parallel trainer processes this one belongs to (torchrun, accelerate launch, a DDP
loop), found without the user's help: rank and world size from torch.distributed when it is
initialised, else from torchrun's environment (RANK, WORLD_SIZE; accelerate launch sets them
too), else one process.

What changes between 1 and W processes is decided here and nowhere else:
- each rank adds its own micro-batches' dW under its own gradient identity (`rank_trainer`), so a
  restarted rank's replays are dropped for that rank only;
- the optimizer step is synchronous (the server waits for every rank and applies it once, with
  the summed dW divided by W, as DDP averages gradients);
- the head is uploaded (or created) once, by rank 0; the other ranks wait for it (`share`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Cluster:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether several trainer processes share the head."""
        return self.world_size > 1

    def rank_trainer(self, trainer: Optional[str]) -> str:
        """This rank's gradient identity (GradientId.trainer) from the one the user named (None:
        none). One process: that name, else a random one. Several: the name with
        "/rank-<r>" appended (unless it ends so already) — ranks sharing a name would have all
        but the first rank's micro-batches dropped as replays —, else "<run>/rank-<r>", the same
        for a rank restarted within its run (torchrun's TORCHELASTIC_RUN_ID), so that its
        replays are recognised."""
        if not self.distributed:
            return trainer or f"py-{uuid.uuid4().hex[:12]}"
        suffix = f"/rank-{self.rank}"
        if trainer:
            return trainer if trainer.endswith(suffix) else trainer + suffix
        return (os.environ.get("TORCHELASTIC_RUN_ID") or "ddp") + suffix


def _process_group_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def detect() -> Cluster:
    """This process's rank and the number of trainer processes: torch.distributed's when it is
    initialised, else torchrun's environment, else (0, 1)."""
    if _process_group_ready():
        return Cluster(torch.distributed.get_rank(), torch.distributed.get_world_size())
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE: expected integers (torchrun's environment); got "
                         f"RANK={os.environ.get('RANK')!r}, "
                         f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}") from e
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK / WORLD_SIZE: expected 0 <= RANK < WORLD_SIZE; got RANK={rank}, "
                         f"WORLD_SIZE={world}")
    return Cluster(rank, world)


def share(cluster: Cluster, on_main: Callable[[], T], on_others: Callable[[], T],
          wait_until: Optional[Callable[[], bool]] = None, timeout: float = 600.0) -> T:
    """Runs `on_main` on rank 0 only and `on_others` on every other rank once rank 0 is done:
    after a torch.distributed broadcast of rank 0's outcome when a process group exists (an
    error on rank 0 is raised on every rank), else once `wait_until()` holds (polled, up to
    `timeout` seconds)."""
    if not cluster.distributed:
        return on_main()
    if _process_group_ready():
        outcome = [None]
        if cluster.is_main:
            try:
                result = on_main()
            except Exception as e:  # every rank must learn it, then rank 0 raises it
                torch.distributed.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)
                raise
            torch.distributed.broadcast_object_list([None], src=0)
            return result
        torch.distributed.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise RuntimeError(f"remotehead: rank 0 failed to set up the head: {outcome[0]}")
        return on_others()
    if cluster.is_main:
        return on_main()
    deadline = time.monotonic() + timeout
    while wait_until is not None and not wait_until():
        if time.monotonic() > deadline:
            raise TimeoutError(f"remotehead: rank {cluster.rank} waited {timeout:.0f} s for rank "
                               "0 to set up the head; it did not")
        time.sleep(0.2)
    return on_others()

