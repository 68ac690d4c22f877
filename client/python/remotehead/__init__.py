"""remotehead: the LM head of a model served over gRPC.

    client = remotehead.Client("127.0.0.1:50051")
    client.upload_head("lm", model.lm_head.weight)
    head = remotehead.RemoteHead(client, "lm")
    loss = head.loss(hidden, labels)   # the [N, V] logits are never built here
    loss.backward()                    # hidden.grad from the server's dX; dW accumulates there

Step calls take a StepOptions (help(remotehead.StepOptions) lists every option) or its fields
as keyword arguments, and return a StepResult whose summary is a StepSummary.
"""

from remotehead.client import (Client, GradientId, HeadInfo, InvalidArgumentError,
                               RemoteheadError, ServerRestartedError, StepOptions, StepResult,
                               StepSummary, StepTimings)
from remotehead.autograd import RemoteHead, upstream_matches_declared

__all__ = ["Client", "GradientId", "HeadInfo", "InvalidArgumentError", "RemoteHead",
           "RemoteheadError", "ServerRestartedError", "StepOptions", "StepResult", "StepSummary", "StepTimings",
           "upstream_matches_declared"]
