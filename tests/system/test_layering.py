"""The server's layers, read from the includes (server/README.md, "Layers").

server/src is filed by layer, top to bottom: rpc/ (everything gRPC), replication/ (a head
operation on every rank and replica), translate/ (protobuf <-> the server's own types), step/
(one step call, no protobuf), the service's own core at the top of src/, and group/ (the
transport, a leaf); main.cc composes them all. A public header's layer is its folder under
include/remotehead/server/ the same way. The rules, checked on every source and header:

- no include runs back up these layers (a layer includes its own and the ones below);
- only rpc/ and main.cc include gRPC (<grpcpp/...> or a generated *.grpc.pb.h);
- protobuf's remotehead.v1 types (``v1::``, "remotehead/v1/...", and the headers of
  "remotehead/wire/..." that speak them, the codec's) appear only in rpc/, translate/ and
  replication/ (a wire header that names no v1 type, the connections' HTTP/2 settings, is plain
  C++);
- group/ includes nothing of the server outside itself.

(How big a unit may be is tests/system/test_unit_sizes.py's.)

Each rule is also run on a small tree that breaks it, so that a rule that could never fail
fails this test.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server"
PROTO = ROOT / "proto"
LAYERS = ["group", "root", "step", "translate", "replication", "rpc", "main"]  # bottom to top
RANK = {layer: i for i, layer in enumerate(LAYERS)}
GRPC_LAYERS = {"rpc", "main"}
V1_LAYERS = {"rpc", "translate", "replication"}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.M)
V1_USE = re.compile(r"\bv1::")


def strip_comments(text):
    """The code of a C++ file without its comments (a comment may name any layer)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def speaks_v1(quoted):
    """Whether an include of the protocol's libraries brings protobuf's v1 types: every
    remotehead/v1/ header, and a remotehead/wire/ header that names v1:: or includes one that
    does (one not found counts as speaking them)."""
    if quoted.startswith("remotehead/v1/"):
        return True
    if not quoted.startswith("remotehead/wire/"):
        return False
    path = PROTO / quoted
    if not path.exists():
        return True
    text = strip_comments(path.read_text())
    return bool(V1_USE.search(text)) or any(
        kind == '"' and speaks_v1(target) for kind, target in INCLUDE.findall(text))


def layer_of(server, path):
    """The layer of a file of the server (a path under `server`)."""
    rel = path.relative_to(server)
    parts = rel.parts
    if parts[:1] == ("src",):
        inner = parts[1:]
    elif parts[:3] == ("include", "remotehead", "server"):
        inner = parts[3:]
    else:
        raise ValueError(f"not a server source: {rel}")
    if inner == ("main.cc",):
        return "main"
    return inner[0] if len(inner) > 1 else "root"


def included_layer(server, quoted):
    """The layer of a quoted include of the server's, or None for one outside the server."""
    if quoted.startswith("remotehead/server/"):
        rest = quoted[len("remotehead/server/"):].split("/")
        return rest[0] if len(rest) > 1 else "root"
    if quoted.startswith("remotehead/"):
        return None  # core, wire, the generated protocol: below every layer
    first = quoted.split("/")[0]
    if "/" in quoted and first in RANK:
        return first
    return "root" if (server / "src" / quoted).exists() else None


def server_files(server):
    return sorted(p for p in list((server / "src").rglob("*")) +
                  list((server / "include").rglob("*")) if p.suffix in (".h", ".cc"))


def violations(server):
    """Every broken rule in the server at `server`, one line each."""
    found = []
    for path in server_files(server):
        rel = path.relative_to(server)
        layer = layer_of(server, path)
        if layer not in RANK:
            found.append(f"{rel}: folder {layer}/ is not a layer ({', '.join(LAYERS)})")
            continue
        text = path.read_text()
        for kind, target in INCLUDE.findall(text):
            grpc = target.startswith("grpcpp/") or target.endswith(".grpc.pb.h")
            if grpc and layer not in GRPC_LAYERS:
                found.append(f"{rel}: includes gRPC ({target}) outside rpc/")
            if kind == '"' and speaks_v1(target) and layer not in V1_LAYERS:
                found.append(f"{rel}: includes protobuf's {target} outside rpc/translate/"
                             "replication/")
            if kind != '"':
                continue
            to = included_layer(server, target)
            if to is None:
                continue
            if layer == "group" and to != "group":
                found.append(f"{rel}: the transport includes {target} ({to}) of the server")
            elif RANK[to] > RANK[layer]:
                found.append(f"{rel}: includes {target}, which runs back up from {layer} to {to}")
        if layer not in V1_LAYERS and layer != "main" and V1_USE.search(strip_comments(text)):
            found.append(f"{rel}: names a v1:: type outside rpc/translate/replication/")
        if layer == "main" and V1_USE.search(strip_comments(text)):
            found.append(f"{rel}: names a v1:: type (main composes the layers; rpc/ speaks v1)")
    return found


def test_the_server_keeps_its_layers():
    assert violations(SERVER) == []


def test_every_layer_is_a_folder_and_holds_files():
    folders = {p.name for p in (SERVER / "src").iterdir() if p.is_dir()}
    assert folders == set(LAYERS) - {"root", "main"}
    for layer in folders:
        assert list((SERVER / "src" / layer).glob("*.cc")), layer


# ----- each rule can fail -----

def write(server, rel, text):
    path = server / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def clean(tmp_path):
    """A small server that keeps every rule."""
    server = tmp_path / "server"
    write(server, "include/remotehead/server/group/head_group.h",
          '#include "remotehead/core/vocab_group.h"\n')
    write(server, "src/group/head_group.cc", '#include "remotehead/server/group/head_group.h"\n')
    write(server, "src/head_operations.h", '#include "remotehead/server/group/head_group.h"\n')
    write(server, "src/step/step_session.h", '#include "head_operations.h"\n')
    write(server, "src/translate/protocol.h",
          '#include "step/step_session.h"\n#include "remotehead/v1/head_service.pb.h"\n'
          "// v1::StepHeader in a comment is fine anywhere\n")
    write(server, "src/replication/group_steps.h", '#include "translate/protocol.h"\n')
    write(server, "src/rpc/head_service.cc",
          "#include <grpcpp/grpcpp.h>\n#include \"replication/group_steps.h\"\n")
    write(server, "src/main.cc", '#include "rpc/head_service.h"\n#include <grpcpp/grpcpp.h>\n')
    write(server, "src/rpc/head_service.h", "")
    return server


def test_a_clean_tree_passes(clean):
    assert violations(clean) == []


@pytest.mark.parametrize("rel, text, expected", [
    ("src/step/step_call.h", '#include "rpc/service_context.h"\n', "runs back up from step to rpc"),
    ("src/head_requests.h", '#include "step/step_call.h"\n', "runs back up from root to step"),
    ("src/group/join.h", '#include "head_operations.h"\n', "the transport includes"),
    ("src/group/log.h", '#include "remotehead/server/admission.h"\n', "the transport includes"),
    ("src/metrics.cc", "#include <grpcpp/support/server_interceptor.h>\n", "includes gRPC"),
    ("src/translate/x.h", '#include "remotehead/v1/head_service.grpc.pb.h"\n', "includes gRPC"),
    ("src/step/step_session.cc", "int f(const v1::StepHeader& h);\n", "names a v1:: type"),
    ("src/group/head_group.cc", '#include "remotehead/v1/head_group.pb.h"\n',
     "includes protobuf's"),
    ("src/main.cc", "v1::GroupCommand command;\n", "names a v1:: type"),
    ("src/group/head_group.cc", '#include "remotehead/wire/tensor_codec.h"\n',
     "includes protobuf's"),
    ("src/misc/thing.cc", "", "is not a layer"),
])
def test_each_rule_catches_its_break(clean, rel, text, expected):
    write(clean, rel, text)
    found = violations(clean)
    assert any(expected in line for line in found), found


def test_wire_headers_speak_v1_as_they_are_written():
    assert speaks_v1("remotehead/v1/head_service.pb.h")
    assert speaks_v1("remotehead/wire/tensor_codec.h")  # names v1::Tensor
    assert speaks_v1("remotehead/wire/no_such_header.h")
    assert not speaks_v1("remotehead/wire/http2_settings.h")  # plain C++: main.cc may take it
    assert not speaks_v1("remotehead/core/engine.h")
