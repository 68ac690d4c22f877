"""What a RemoteHead resends when its trainer moves to another replica of a mesh.

On a mesh that evicts a lost replica (--mesh_min_replicas), the dW a trainer's calls added to
its replica since the last applied optimizer step is lost with that replica; the trainer itself
is not, so it sends those calls again to the replica that serves it now, under the same gradient
ids (exactly once there) and pinned to the same weight version, and the training loop sees
nothing. The journal keeps each such call — a ForwardBackward, a two-phase Backward with its
upstream gradient, a tied embedding's gradient rows — from when it succeeded until the trainer's
next optimizer step applies (or a pull of dW into a local weight takes it), with the front that
took it: a trainer moved away from a front that still serves (WRONG_REPLICA: its replica was
admitted again after an eviction, or reassigned) resends nothing, since that front keeps its dW;
one whose front restarted (SERVER_RESTARTED after a replica was healed) resends what the old
process took.

Memory: a host copy of every journaled call's per-token inputs (hidden states [N, D] in the wire
dtype, targets, weights, aux, a Backward's dL/dy, an embedding gradient's rows) until the next
step — about one step's worth of the head's inputs. RemoteHead(journal=False) keeps none; a
moved trainer then gets ReplicaMovedError (its step's dW is gone).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch


def host_copy(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`t` detached on the host (what the journal keeps of an input), None for None."""
    return None if t is None else t.detach().to("cpu", copy=True)


class ReplayJournal:
    """The calls that added dW since the trainer's last applied optimizer step, each as a
    function that sends it again (given the incarnation of the front it goes to), by the
    incarnation of the front that took it: only a front that is gone loses its calls' dW."""

    def __init__(self):
        self._calls: List[Tuple[str, Callable[[str], object]]] = []
        self.nbytes = 0  # what the journal's tensors hold now

    def __len__(self) -> int:
        return len(self._calls)

    def record(self, resend: Callable[[str], object], incarnation: str,
               *tensors: Optional[torch.Tensor]) -> None:
        """A call that succeeded at the front of `incarnation`: `resend(incarnation)` sends it
        again; `tensors` are what it keeps (counted in nbytes)."""
        self._calls.append((incarnation, resend))
        self.nbytes += sum(t.nbytes for t in tensors if t is not None)

    def clear(self) -> None:
        """The trainer's dW was applied (or taken): nothing to resend."""
        self._calls.clear()
        self.nbytes = 0

    def replay(self, lost: str, incarnation: str) -> int:
        """Every call the front of incarnation `lost` took sent again, in order, to the front of
        `incarnation` (which holds their dW from then on); how many."""
        replayed = 0
        for i, (taken_by, resend) in enumerate(self._calls):
            if taken_by != lost:
                continue
            resend(incarnation)
            self._calls[i] = (incarnation, resend)
            replayed += 1
        return replayed
