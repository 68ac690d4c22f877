"""The client's exceptions (apart from client.py so that _wire.py can raise them too)."""

import grpc


class RemoteheadError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message (or the
    client's, for a call it refused before sending anything)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgumentError(RemoteheadError, ValueError):
    """A call the client refuses before sending it (code INVALID_ARGUMENT, as the C++ client's
    absl::InvalidArgumentError); also a ValueError, Python's name for a bad argument."""

    def __init__(self, details: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, details)


class ServerRestartedError(RemoteheadError):
    """The server restarted since this client learned its incarnation (code
    FAILED_PRECONDITION): the dW accumulated and the gradient ids sent before are gone, and the
    head is at the version restored from its saved state (the message names it). Resume from
    the trainer checkpoint of that version (with transformers' Trainer: resume_from_checkpoint,
    and RemoteHeadCallback restores the head's state saved with it)."""
