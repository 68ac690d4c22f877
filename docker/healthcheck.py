"""The image's health check (Docker HEALTHCHECK, Kubernetes exec probes): exit 0 when the
server at HOST:PORT (default 127.0.0.1:50051) answers grpc.health.v1.Health/Check for the whole
server ("") with SERVING, else 1.

    python healthcheck.py 127.0.0.1:50051                     # plaintext (docker compose)
    python healthcheck.py --ca /etc/remotehead/tls/ca.crt --server-name remotehead 127.0.0.1:50051

With --ca the channel is TLS (a server started with --tls_cert): the server's certificate is
verified against --ca, checking the name --server-name (one of the certificate's SANs; the probe
dials the loopback address). Health checks are exempt from the bearer token (docs/security.md),
so the probe holds no secret but the CA. Only grpcio is needed (the client's own dependency): the
request is the empty message and the reply's field 1 (status) is read by hand, so no generated
health stubs are required.
"""

import argparse
import sys

import grpc

SERVING = 1


def status_of(reply: bytes) -> int:
    """Field 1 (varint) of a HealthCheckResponse; 0 (UNKNOWN) when absent."""
    if len(reply) >= 2 and reply[0] == 0x08:  # field 1, wire type 0
        return reply[1]
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument("--ca", help="PEM CA(s) of the server's certificate (no --ca: plaintext)")
    parser.add_argument("--server-name", default="", help="the name checked in the certificate")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args()
    if args.ca:
        try:
            with open(args.ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(f.read())
        except OSError as error:
            print(f"unhealthy: --ca: {error}", file=sys.stderr)
            return 1
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(args.target, credentials, options)
    else:
        channel = grpc.insecure_channel(args.target)
    with channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=lambda request: request,
                                    response_deserializer=lambda reply: reply)
        try:
            reply = check(b"", timeout=args.timeout)
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
