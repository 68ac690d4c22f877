"""remotehead: the operator's command line for a remotehead server.

    remotehead [--server HOST:PORT] [TLS / token options] [--json] COMMAND

    heads               every head: id, shape, dtype, device, version, micro-batches
    describe ID         one head, every field
    save ID PATH        its weights to PATH (safetensors, relative to the server's
                        --checkpoint_dir)
    drop ID             remove it (its dW and optimizer state are lost)
    zero ID             zero its dW and forget its gradient ids
    health              the server's grpc.health.v1 status

Exit codes follow the server's statuses: 0 when the call succeeded, else the gRPC status code
(3 INVALID_ARGUMENT, 5 NOT_FOUND, 9 FAILED_PRECONDITION, 14 UNAVAILABLE, 16 UNAUTHENTICATED,
…) with the server's message on stderr; `health` exits 0 for SERVING and 14 otherwise; a bad
command line exits 64. --json prints the result as one JSON document (errors too, on stderr:
{"code": "NOT_FOUND", "message": "..."}).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import List, Optional, Sequence

import grpc

USAGE_ERROR = 64  # EX_USAGE: kept apart from the gRPC codes 1–16
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code 2 would read as gRPC's UNKNOWN
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="remotehead", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--server", default=os.environ.get("REMOTEHEAD_SERVER", "127.0.0.1:50051"),
                   help="host:port of the server (default $REMOTEHEAD_SERVER or 127.0.0.1:50051)")
    p.add_argument("--ca", help="PEM file of the CA(s) that signed the server's certificate "
                                "(turns TLS on)")
    p.add_argument("--cert", help="PEM client certificate chain (mTLS; with --key)")
    p.add_argument("--key", help="PEM private key of --cert")
    p.add_argument("--token-file", help="file holding the bearer token (needs --ca)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call (default 30)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("heads", help="list the heads")
    for name, text in (("describe", "one head, every field"), ("drop", "remove a head"),
                       ("zero", "zero a head's gradients")):
        sub.add_parser(name, help=text).add_argument("head_id", metavar="ID")
    save = sub.add_parser("save", help="write a head's weights to a safetensors file")
    save.add_argument("head_id", metavar="ID")
    save.add_argument("path", metavar="PATH", help="relative to the server's --checkpoint_dir")
    save.add_argument("--weight-name", default="", help="default lm_head.weight")
    save.add_argument("--bias-name", default="", help="default lm_head.bias")
    sub.add_parser("health", help="the server's health status")
    return p


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        print(f"remotehead: {what}: cannot read {path}: {e.strerror}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _client(args):
    import remotehead  # after parsing: --help needs no torch import
    if (args.cert is None) != (args.key is None):
        print("remotehead: --cert and --key: expected both or neither", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    token = _read(args.token_file, "--token-file")
    if token is not None and args.ca is None:
        print("remotehead: --token-file: expected --ca as well (a token is only sent over TLS)",
              file=sys.stderr)
        sys.exit(USAGE_ERROR)
    return remotehead.Client(args.server, root_certificates=_read(args.ca, "--ca"),
                             private_key=_read(args.key, "--key"),
                             certificate_chain=_read(args.cert, "--cert"),
                             token=token.decode().strip() if token is not None else None,
                             timeout=args.timeout, max_attempts=1)


def _head_dict(info) -> dict:
    d = dataclasses.asdict(info)
    d["dtype"] = str(info.dtype).replace("torch.", "")
    d["shards"] = [list(s) for s in info.shards]
    return d


def _table(heads: List[dict]) -> str:
    columns = ["head_id", "vocab_size", "hidden_size", "dtype", "device", "weight_version",
               "accumulated_micro_batches", "group_size"]
    titles = ["ID", "VOCAB", "HIDDEN", "DTYPE", "DEVICE", "VERSION", "MICRO_BATCHES", "RANKS"]
    rows = [titles] + [[str(h[c]) for c in columns] for h in heads]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def _run(args, client) -> tuple:
    """(what to print as text, what to print as JSON, exit code)."""
    if args.command == "heads":
        heads = [_head_dict(h) for h in client.list_heads()]
        return _table(heads) if heads else "no heads", heads, 0
    if args.command == "describe":
        head = _head_dict(client.describe_head(args.head_id))
        return "\n".join(f"{k}: {v}" for k, v in head.items()), head, 0
    if args.command == "save":
        written = client.save_weights(args.head_id, args.path, weight_name=args.weight_name,
                                      bias_name=args.bias_name)
        return (f"saved head \"{args.head_id}\" to {args.path} ({written} bytes)",
                {"head_id": args.head_id, "path": args.path, "bytes_written": written}, 0)
    if args.command == "drop":
        client.drop_head(args.head_id)
        return f"dropped head \"{args.head_id}\"", {"head_id": args.head_id, "dropped": True}, 0
    if args.command == "zero":
        head = _head_dict(client.zero_gradients(args.head_id))
        return (f"zeroed the gradients of head \"{args.head_id}\" (version "
                f"{head['weight_version']})", head, 0)
    status = client.health()
    return status, {"server": args.server, "status": status}, 0 if status == "SERVING" \
        else UNAVAILABLE


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    client = _client(args)
    from remotehead import RemoteheadError
    try:
        text, document, code = _run(args, client)
    except RemoteheadError as e:
        if args.json:
            print(json.dumps({"code": e.code.name, "message": e.details}), file=sys.stderr)
        else:
            print(f"remotehead: {args.command}: {e.code.name}: {e.details}", file=sys.stderr)
        return e.code.value[0]
    finally:
        client.close()
    print(json.dumps(document, indent=2) if args.json else text)
    return code


if __name__ == "__main__":
    sys.exit(main())
