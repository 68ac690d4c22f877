"""remotehead: the LM head of a model served over gRPC.

    client = remotehead.Client("127.0.0.1:50051")
    client.upload_head("lm", model.lm_head.weight)
    head = remotehead.RemoteHead(client, "lm")
    loss = head.loss(hidden, labels)   # the [N, V] logits are never built here
    loss.backward()                    # hidden.grad from the server's dX; dW accumulates there
"""

from remotehead.client import Client, HeadInfo, RemoteheadError, StepResult
from remotehead.autograd import RemoteHead

__all__ = ["Client", "HeadInfo", "RemoteHead", "RemoteheadError", "StepResult"]
