"""remotehead: the LM head of a model served over gRPC.

    client = remotehead.Client("127.0.0.1:50051")
    client.upload_head("lm", model.lm_head.weight)
    head = remotehead.RemoteHead(client, "lm")
    loss = head.loss(hidden, labels)   # the [N, V] logits are never built here
    loss.backward()                    # hidden.grad from the server's dX; dW accumulates there

A tied input embedding (the head's W is also the model's embedding matrix) served from the same
head, its gradient added into the same dW (remotehead.hf.offload_lm_head does this for a Hugging
Face model):

    embed = remotehead.RemoteEmbedding(head, padding_idx=pad, embed_scale=scale)

Distillation: a frozen teacher head beside the student's (docs/distillation.md):

    client.upload_head("teacher", teacher.lm_head.weight, frozen=True)
    loss = head.distill(hidden, teacher_hidden, labels, teacher="teacher", function="distill_kl")

Step calls take a StepOptions (help(remotehead.StepOptions) lists every option) or its fields
as keyword arguments, and return a StepResult whose summary is a StepSummary.
"""

from remotehead._errors import (GroupUnavailableError, HeadExistsError, HeadFrozenError,
                                HeadNotFoundError, InvalidArgumentError, MeshReconfiguringError,
                                NotTheFrontError, NotTheLeaderError, RanksDisagreeError,
                                RanksMissingError, RemoteheadError, ReplicaMovedError,
                                ReplicasDivergedError, ServerRestartedError,
                                TeacherIncompatibleError, WeightVersionMismatchError,
                                WrongReplicaError)
from remotehead.client import Client, HeadInfo, StepResult, StepSummary, StepTimings
from remotehead.step_options import GradientId, StepOptions
from remotehead.functions import FunctionInfo, ParamInfo
from remotehead.autograd import RemoteHead, upstream_matches_declared
from remotehead.embedding import RemoteEmbedding

__all__ = ["Client", "FunctionInfo", "GradientId", "GroupUnavailableError", "HeadExistsError",
           "HeadFrozenError", "HeadInfo", "HeadNotFoundError", "InvalidArgumentError",
           "MeshReconfiguringError", "NotTheFrontError", "NotTheLeaderError", "ParamInfo",
           "RanksDisagreeError", "RanksMissingError", "RemoteEmbedding", "RemoteHead",
           "RemoteheadError", "ReplicaMovedError", "ReplicasDivergedError",
           "ServerRestartedError", "StepOptions", "StepResult", "StepSummary", "StepTimings",
           "TeacherIncompatibleError", "WeightVersionMismatchError", "WrongReplicaError",
           "upstream_matches_declared"]
