"""transformers' Trainer and remotehead: RemoteHeadCallback (the server's optimizer steps, the
head's saved state with each checkpoint) and accumulation_window_ends (when dW is pulled)."""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from remotehead import cluster as cluster_lib
from remotehead.autograd import RemoteHead
from remotehead.client import RemoteheadError


def accumulation_window_ends() -> bool:
    """Whether this micro-batch is the last of its gradient-accumulation window: transformers'
    Trainer (through accelerate's GradientState) says so before each micro-batch; without a
    Trainer every micro-batch counts as the last (dW is then pulled after each backward)."""
    try:
        from accelerate.state import GradientState
    except ImportError:
        return True
    return GradientState().sync_gradients


class RemoteHeadCallback(TrainerCallback):
    """Makes transformers' Trainer step a server-trained head (gradients="server") with the
    Trainer's own AdamW settings and its current learning rate, after each local optimizer
    step:  Trainer(..., callbacks=[RemoteHeadCallback(head)]).

    Trainer's gradient clipping (max_grad_norm) sees only the local parameters in this mode;
    offload with gradients="local" to clip the head's gradient together with the body's."""

    # Written into each trainer checkpoint directory: the head's saved state that goes with it.
    STATE_FILE = "remotehead_state.json"

    def __init__(self, head: RemoteHead, save_state: Optional[bool] = None):
        """save_state: with each trainer checkpoint, save the head's training state on the
        server (its --state_dir) and record its id in the checkpoint, so that
        resume_from_checkpoint puts the head back to the same version with the same optimizer
        state — after a server crash too. Default: when the head is trained on the server and
        the server keeps states (--state_dir; without one a warning says the head's state is
        not saved)."""
        self.head = head
        self.save_state = self._server_trained() if save_state is None else save_state
        self._required = save_state is True

    def _server_trained(self) -> bool:
        return self.head.accumulate and self.head.local_weight is None

    def on_save(self, args, state, control, **kwargs):
        if not self.save_state or not state.is_world_process_zero:
            return
        try:
            info = self.head.save_state()
        except RemoteheadError as e:
            if self._required or "--state_dir" not in e.details:
                raise
            warnings.warn(f"remotehead: the head's training state is not saved with the "
                          f"checkpoints: {e.details}")
            self.save_state = False
            return
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        with open(os.path.join(checkpoint, self.STATE_FILE), "w") as f:
            json.dump({"head_id": self.head.head_id, "state_id": info.state_id,
                       "weight_version": info.weight_version,
                       "global_step": state.global_step}, f)

    def on_init_end(self, args, state, control, **kwargs):
        self._declare_loss_scale(args)

    def _declare_loss_scale(self, args) -> None:
        """Under average_tokens_across_devices (transformers' default with several processes)
        Trainer.compute_loss multiplies each rank's num_items_in_batch-normalised loss by the
        number of processes, so that DDP's average is the global token mean: backward brings
        dL/dloss = W to those losses, declared here up front (OffloadedHead.trainer_loss_scale,
        which offload_lm_head's loss uses only with num_items_in_batch, as Trainer scales only
        then; trainers with a compute_loss of their own, e.g. TRL's GRPOTrainer, route their
        loss elsewhere and are not scaled)."""
        cluster = self.head.cluster
        if hasattr(self.head, "trainer_loss_scale"):
            average = cluster.distributed and getattr(args, "average_tokens_across_devices", False)
            self.head.trainer_loss_scale = float(cluster.world_size) if average else 1.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._declare_loss_scale(args)
        # Resuming (Trainer has loaded the checkpoint's TrainerState): the head goes back to the
        # state saved with that checkpoint, whatever the server holds now — once, by rank 0; the
        # other ranks then continue from the restored head.
        if not self.save_state or state.global_step == 0:
            return
        cluster_lib.share(self.head.cluster, lambda: self._restore(args, state),
                          lambda: self._follow_restore(state))

    def _follow_restore(self, state) -> None:
        self.head.info = self.head.client.describe_head(self.head.head_id)
        self.head.incarnation = self.head.info.incarnation
        self.head.step, self.head.micro_batch = state.global_step, 0

    def _restore(self, args, state) -> None:
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = os.path.join(checkpoint, self.STATE_FILE)
        if not os.path.isfile(path):
            if not self._required:
                warnings.warn(f"remotehead: {path} is missing: the head is not put back to the "
                              f"state of step {state.global_step} (the server was started "
                              "without --state_dir when the checkpoint was written?)")
                return
            raise FileNotFoundError(
                f"{path}: expected the remote head's state saved with the checkpoint of step "
                f"{state.global_step} (RemoteHeadCallback writes it); got none — the head "
                "cannot be put back to that step")
        with open(path) as f:
            saved = json.load(f)
        info = self.head.restore_state(saved["state_id"], step=state.global_step)
        if info.weight_version != saved["weight_version"]:
            raise RuntimeError(f"{path}: expected the head at version {saved['weight_version']} "
                               f"after restoring; got {info.weight_version}")

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._server_trained():
            self.head.optimizer_step(adamw=dict(
                lr=optimizer.param_groups[0]["lr"], beta1=args.adam_beta1,
                beta2=args.adam_beta2, eps=args.adam_epsilon, weight_decay=args.weight_decay))

    def on_train_end(self, args, state, control, **kwargs):
        if self._server_trained():
            self.head.sync_lm_head()  # generation after training uses the trained head
