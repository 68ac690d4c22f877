"""Docker HEALTHCHECK: exit 0 when the server at argv[1] (default 127.0.0.1:50051) answers
grpc.health.v1.Health/Check for the whole server ("") with SERVING.

Only grpcio is needed (the client's own dependency): the request is the empty message and the
reply's field 1 (status) is read by hand, so no generated health stubs are required.
"""

import sys

import grpc

SERVING = 1


def status_of(reply: bytes) -> int:
    """Field 1 (varint) of a HealthCheckResponse; 0 (UNKNOWN) when absent."""
    if len(reply) >= 2 and reply[0] == 0x08:  # field 1, wire type 0
        return reply[1]
    return 0


def main() -> int:
    target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=lambda request: request,
                                    response_deserializer=lambda reply: reply)
        try:
            reply = check(b"", timeout=3)
        except grpc.RpcError as error:
            print(f"unhealthy: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = status_of(reply)
    if status != SERVING:
        print(f"unhealthy: status {status} (expected SERVING = {SERVING})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
