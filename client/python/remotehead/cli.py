"""remotehead: the operator's command line for a remotehead server.

    remotehead [--server HOST:PORT] [TLS / token options] [--json] COMMAND

    heads               every head: id, shape, dtype, device, version, micro-batches; then
                        the frozen heads and the heads each is the teacher of
    describe ID         one head, every field
    save ID PATH        its weights to PATH (safetensors, relative to the server's
                        --checkpoint_dir)
    drop ID             remove it (its dW and optimizer state are lost)
    zero ID             zero its dW and forget its gradient ids
    functions           every function the server computes: parameters (default, range,
                        meaning), aux inputs, output, whether a head group runs it,
                        whether it compares two heads (a distillation: needs a teacher),
                        the per-token extras it reports (token_extras)
    health              the server's grpc.health.v1 status

Exit codes follow the server's statuses: 0 when the call succeeded, else the gRPC status code
(3 INVALID_ARGUMENT, 5 NOT_FOUND, 9 FAILED_PRECONDITION, 14 UNAVAILABLE, 16 UNAUTHENTICATED,
…) with the server's message and its reason on stderr; `health` exits 0 for SERVING and 14 otherwise. Bad
input (the command line, $REMOTEHEAD_SERVER, a file it names: missing, unreadable, not a
regular file, not the PEM or token expected, text that is not UTF-8) exits 64 with one line on
stderr naming the argument and what was expected, before any call. --json prints the result
as one JSON document (errors too, on stderr: {"code": "NOT_FOUND", "reason": "HEAD_NOT_FOUND",
"metadata": {"head": "..."}, "message": "..."}; code and reason "USAGE" for bad input).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import math
import os
import re
import stat
import sys
from typing import List, Optional, Sequence

import grpc

USAGE_ERROR = 64  # EX_USAGE: kept apart from the gRPC codes 1–16
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
DEFAULT_SERVER = "127.0.0.1:50051"
# Certificates, keys and tokens are small; a larger "file" is a mistake (or /dev/zero-like).
MAX_FILE_BYTES = 1 << 20
# HOST:PORT: a host name or IPv4 address, or an IPv6 address in brackets (checked below).
_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9._-]+|\[(?P<v6>[^\]]+)\]):(?P<port>[0-9]{1,5})")


class BadInput(Exception):
    """Input the CLI refuses before any call: one line on stderr, exit USAGE_ERROR."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line; and argparse's own exit code 2 would read as gRPC's UNKNOWN.
        print(f"{self.prog}: error: {message} (see remotehead --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="remotehead", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--server", help=f"HOST:PORT (or unix:PATH) of the server (default "
                                    f"$REMOTEHEAD_SERVER, else {DEFAULT_SERVER})")
    p.add_argument("--ca", help="PEM file of the CA(s) that signed the server's certificate "
                                "(turns TLS on)")
    p.add_argument("--cert", help="PEM client certificate chain (mTLS; with --key and --ca)")
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
    sub.add_parser("functions", help="the functions the server computes")
    sub.add_parser("health", help="the server's grpc.health.v1 status")
    return p


def _shown(text: str) -> str:
    """`text` for a one-line message: as it is when printable, else quoted with escapes."""
    return text if text.isprintable() else repr(text)


def _utf8(value: str, what: str) -> str:
    """`value` from argv or the environment, which must be UTF-8 to go on the wire: Python
    hands undecodable bytes over as lone surrogates, which gRPC cannot encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"{what}: expected UTF-8 text; got {os.fsencode(value)!r}") from None
    return value


def _check_texts(args) -> None:
    """The command's own arguments (head id, path, tensor names) are sent as they are."""
    for attribute, what in (("head_id", "ID"), ("path", "PATH"),
                            ("weight_name", "--weight-name"), ("bias_name", "--bias-name")):
        value = getattr(args, attribute, None)
        if value is not None:
            _utf8(value, what)


def _server(args) -> str:
    """The server's address: --server, else $REMOTEHEAD_SERVER, else the default; refused
    unless it has a form gRPC connects to (it would otherwise wrap a port above 65535 or
    default to 443 without a word)."""
    if args.server is not None:
        value, what = args.server, "--server"
    elif "REMOTEHEAD_SERVER" in os.environ:
        value, what = os.environ["REMOTEHEAD_SERVER"], "$REMOTEHEAD_SERVER"
    else:
        return DEFAULT_SERVER
    _utf8(value, what)
    if value.startswith("unix:") and len(value) > len("unix:") and value.isprintable() \
            and " " not in value:
        return value
    match = _HOST_PORT.fullmatch(value)
    if match and 1 <= int(match["port"]) <= 65535 and _valid_v6(match["v6"]):
        return value
    raise BadInput(f"{what}: expected HOST:PORT (a host name or IPv4 address, or [IPv6 "
                   f"address], and a port from 1 to 65535) or unix:PATH; got {value!r}")


def _valid_v6(address: Optional[str]) -> bool:
    if address is None:
        return True
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def _timeout(args) -> float:
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise BadInput(f"--timeout: expected a positive number of seconds; got {args.timeout}")
    return args.timeout


def _read(path: Optional[str], flag: str) -> Optional[bytes]:
    """The bytes of the regular file `path` (None if not given). Checked before it is opened:
    a FIFO would block the CLI, a device never end."""
    if path is None:
        return None
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a special file"
            raise BadInput(f"{flag}: expected a regular file; got {kind}: {_shown(path)}")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise BadInput(f"{flag}: cannot read {_shown(path)}: {e.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise BadInput(f"{flag}: expected at most {MAX_FILE_BYTES} bytes in {_shown(path)}; "
                       f"got more")
    return data


def _token(data: bytes, path: str) -> str:
    """The bearer token of a --token-file: surrounding whitespace trimmed; visible ASCII only,
    as the server's --auth_token_file (an HTTP/2 header value). Never shown in a message."""
    token = data.strip()
    if not token:
        raise BadInput(f"--token-file: expected one bearer token in {_shown(path)}; got an "
                       f"empty file")
    for offset, byte in enumerate(token):
        if not 0x21 <= byte <= 0x7E:
            raise BadInput(f"--token-file: expected one token of visible ASCII characters in "
                           f"{_shown(path)}; got byte 0x{byte:02x} at offset "
                           f"{offset + len(data) - len(data.lstrip())}")
    return token.decode("ascii")


def _check_pem(args, ca: Optional[bytes], cert: Optional[bytes]) -> None:
    """gRPC takes any bytes here and fails only at the handshake, with lines of its own: the
    PEM files are parsed now (as the server checks its own at start)."""
    import ssl
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for flag, path, pem in (("--ca", args.ca, ca), ("--cert", args.cert, cert)):
        if pem is None:
            continue
        try:
            context.load_verify_locations(cadata=pem.decode("ascii"))
        except (UnicodeDecodeError, ValueError, ssl.SSLError):
            raise BadInput(f'{flag}: expected PEM certificates ("-----BEGIN CERTIFICATE-----") '
                           f"in {_shown(path)}; got none that parses") from None
    if args.key is None:
        return
    try:
        # A passphrase is never prompted for: an encrypted key fails like a broken one.
        context.load_cert_chain(args.cert, args.key, password=lambda: b"")
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise BadInput(f"--key: expected the private key of the certificate in "
                           f"{_shown(args.cert)}; got a different key in "
                           f"{_shown(args.key)}") from None
        raise BadInput(f"--key: expected an unencrypted PEM private key in "
                       f"{_shown(args.key)}; got none that parses") from None


def _client(args, server: str):
    """The client of `server`, every input of the command line checked first (BadInput)."""
    timeout = _timeout(args)
    if (args.cert is None) != (args.key is None):
        raise BadInput("--cert and --key: expected both or neither")
    if args.cert is not None and args.ca is None:
        raise BadInput("--cert and --key: expected --ca as well (a client certificate is only "
                       "sent over TLS)")
    if args.token_file is not None and args.ca is None:
        raise BadInput("--token-file: expected --ca as well (a token is only sent over TLS)")
    ca, cert, key = (_read(args.ca, "--ca"), _read(args.cert, "--cert"),
                     _read(args.key, "--key"))
    token = _read(args.token_file, "--token-file")
    token = _token(token, args.token_file) if token is not None else None
    _check_pem(args, ca, cert)
    import remotehead  # after parsing and checking: --help and bad input need no torch
    return remotehead.Client(server, root_certificates=ca, private_key=key,
                             certificate_chain=cert, token=token, timeout=timeout,
                             max_attempts=1)


def _head_dict(info) -> dict:
    d = dataclasses.asdict(info)
    for field in ("dtype", "grad_dtype"):  # the dW accumulators' dtype: the memory mode's
        d[field] = str(getattr(info, field, "float32")).replace("torch.", "")
    d["shards"] = [list(s) for s in info.shards]
    # A frozen head (a distillation teacher, a reference) and the heads whose steps named it
    # as their teacher.
    d["frozen"] = bool(getattr(info, "frozen", False))
    d["teacher_of"] = list(getattr(info, "teacher_of", ()) or ())
    return d


def _table(heads: List[dict]) -> str:
    columns = ["head_id", "vocab_size", "hidden_size", "dtype", "device", "weight_version",
               "accumulated_micro_batches", "group_size"]
    titles = ["ID", "VOCAB", "HIDDEN", "DTYPE", "DEVICE", "VERSION", "MICRO_BATCHES", "RANKS"]
    rows = [titles] + [[str(h[c]) for c in columns] for h in heads]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    table = "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)
    frozen = [h for h in heads if h["frozen"]]
    if not frozen:
        return table
    lines = [f"  {h['head_id']}: teacher of "
             f"{', '.join(h['teacher_of']) if h['teacher_of'] else '(no student yet)'}"
             for h in frozen]
    return "\n".join([table, "", "frozen (read only: no dW, no optimizer step):"] + lines)


def _describe_text(head: dict) -> str:
    def shown(key, value):
        if key == "teacher_of":
            return ", ".join(value) if value else "-"
        return value
    return "\n".join(f"{k}: {shown(k, v)}" for k, v in head.items())


def _aux_names(f: dict, names) -> List[str]:
    """Aux input names, each marked with its shape when it is not [n]: "[n, k] int" for token
    ids, "[n, k]" for their values."""
    topk, integral = set(f.get("topk_aux", ())), set(f.get("integral_aux", ()))
    return [name + (" [n, k]" if name in topk else "") + (" int" if name in integral else "")
            for name in names]


def _functions_text(functions: List[dict]) -> str:
    """One paragraph per function: what it is, its output, its aux inputs and parameters."""
    blocks = []
    for f in functions:
        output = f["output_kind"] + f" ({f['output_dtype']}"
        output += ", float64 on float64 heads)" if f["output_float64_on_float64_heads"] else ")"
        lines = [f"{f['name']}: {f['help']}",
                 f"  output: {output}; "
                 f"{'loss and gradients' if f['differentiable'] else 'Forward, reduction none only'}"
                 f"; {'runs on head groups' if f['vocab_decomposable'] else 'one server only'}"
                 f"{'; needs targets' if f['needs_targets'] else ''}"]
        if f.get("needs_teacher"):
            lines.append("  two heads: the step's head and a frozen teacher head "
                         "(teacher_head_id; the rows carry its teacher_hidden)")
        if f["required_aux"] or f["optional_aux"]:
            lines.append(f"  aux: required {_aux_names(f, f['required_aux'])}, "
                         f"optional {_aux_names(f, f['optional_aux'])}")
        for p in f["params"]:
            if not p["common"]:
                lines.append(f"  {p['name']} = {p['default']:g} in [{p['min']:g}, {p['max']:g}]: "
                             f"{p['help']}")
        for e in f.get("extras", ()):
            when = (f" (when {e['when_param']} > 0)" if e["when_param"]
                    else f" (with aux {e['when_aux']})" if e["when_aux"] else "")
            lines.append(f"  extra {e['name']}{when}: {e['help']}")
        blocks.append("\n".join(lines))
    common = [p for p in functions[0]["params"] if p["common"]] if functions else []
    if common:
        blocks.append("every function also takes: " + "; ".join(
            f"{p['name']} = {p['default']:g} in [{p['min']:g}, {p['max']:g}] ({p['help']})"
            for p in common))
    return "\n\n".join(blocks)


def _function_dict(info) -> dict:
    d = info.to_dict()
    # Two-head (distillation) functions, and the aux inputs that are [n, k] / integer.
    d["needs_teacher"] = bool(getattr(info, "needs_teacher", False))
    d["topk_aux"] = list(getattr(info, "topk_aux", ()) or ())
    d["integral_aux"] = list(getattr(info, "integral_aux", ()) or ())
    d["extras"] = [dataclasses.asdict(e) for e in getattr(info, "extras", ()) or ()]
    return d


def _run(args, client, server: str) -> tuple:
    """(what to print as text, what to print as JSON, exit code)."""
    if args.command == "heads":
        heads = [_head_dict(h) for h in client.list_heads()]
        return _table(heads) if heads else "no heads", heads, 0
    if args.command == "describe":
        head = _head_dict(client.describe_head(args.head_id))
        return _describe_text(head), head, 0
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
    if args.command == "functions":
        functions = [_function_dict(f) for f in client.functions().values()]
        return _functions_text(functions), functions, 0
    status = client.health()
    return status, {"server": server, "status": status}, 0 if status == "SERVING" \
        else UNAVAILABLE


def _report(args, code: str, reason: str, metadata: dict, message: str, line: str) -> None:
    """An error on stderr: `line` after the program's name, or with --json one document."""
    document = {"code": code, "reason": reason, "metadata": metadata, "message": message}
    print(json.dumps(document) if args.json else f"remotehead: {line}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_texts(args)
        server = _server(args)
        client = _client(args, server)
    except BadInput as e:
        _report(args, "USAGE", "USAGE", {}, str(e), str(e))
        return USAGE_ERROR
    from remotehead import RemoteheadError
    try:
        text, document, code = _run(args, client, server)
    except RemoteheadError as e:
        _report(args, e.code.name, e.reason, e.metadata, e.details,
                f"{args.command}: {e.code.name} ({e.reason}): {e.details}")
        return e.code.value[0]
    finally:
        client.close()
    print(json.dumps(document, indent=2) if args.json else text)
    return code


if __name__ == "__main__":
    sys.exit(main())
