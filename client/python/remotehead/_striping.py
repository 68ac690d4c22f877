"""A step striped over several gRPC streams (StepHeader.stripe), seen from the client: the
streams' responses read as one. Client._step opens the streams; PreparedStep.messages says what
each stream sends."""

from __future__ import annotations

import queue
import threading
from typing import Iterator

import grpc

from remotehead.v1 import head_service_pb2 as pb


def merged_responses(calls) -> Iterator[pb.StepResponse]:
    """The responses of a striped step's streams as one iterator, each stream read on a thread of
    its own. The first stream to fail cancels the others and its error is raised, once every
    stream has ended (a CANCELLED that the failure caused is not what is reported)."""
    arrived: "queue.Queue" = queue.Queue()

    def pump(call):
        try:
            for response in call:
                arrived.put((response, None))
            arrived.put((None, None))
        except grpc.RpcError as e:
            arrived.put((None, e))

    threads = [threading.Thread(target=pump, args=(c,), daemon=True,
                                name=f"remotehead-stripe-{i}") for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    failure = None
    try:
        for _ in calls:
            while True:
                response, error = arrived.get()
                if response is None:
                    break
                yield response
            if error is not None and (failure is None or (
                    failure.code() == grpc.StatusCode.CANCELLED
                    and error.code() != grpc.StatusCode.CANCELLED)):
                failure = error
                for c in calls:
                    c.cancel()
        if failure is not None:
            raise failure
    finally:
        for c in calls:
            c.cancel()  # nothing on a finished call; ends the rest when the reader stopped early
        for t in threads:
            t.join()
