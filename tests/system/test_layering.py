"""The server's layers: what the build cannot check (server/README.md, "Layers").

server/src is filed by layer, bottom to top: group/ (the transport, a leaf), service/ (the
service's own core), step/ (one step call, no protobuf), translate/ (protobuf <-> the server's
own types), replication/ (a head operation on every rank and replica), rpc/ (everything gRPC);
main.cc composes them all. A public header's layer is its folder under include/remotehead/server/
the same way.

The build enforces the includes: each layer is a target (server/CMakeLists.txt,
`remotehead_server_layer`) that reaches its own headers and those of the layers it links, and
protobuf's generated messages and gRPC's stubs are libraries of their own; the CTests
`layering.*` (tests/CMakeLists.txt) prove that an include running back up a layer, or into code
generated for a layer above, fails to build. What is left here, checked on every source, header
and on the server's CMakeLists.txt:

- every folder of src/ is a layer, and every layer target links only layers below it (a link
  that ran back up would let the build accept an upward include);
- only rpc/ and main.cc include gRPC (<grpcpp/...>, a generated *.grpc.pb.h, or a wire header
  that brings gRPC's types): gRPC's headers are system headers, on every target's path;
- protobuf's remotehead.v1 types (``v1::``) are named only in rpc/, translate/ and replication/
  (a forward declaration needs no include);
- no include climbs out of its folder with "..", around the include roots.

Each rule is also run on a small tree that breaks it, so that a rule that could never fail
fails this test.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server"
PROTO = ROOT / "proto"
LAYERS = ["group", "service", "step", "translate", "replication", "rpc", "main"]  # bottom to top
RANK = {layer: i for i, layer in enumerate(LAYERS)}
GRPC_LAYERS = {"rpc", "main"}
V1_LAYERS = {"rpc", "translate", "replication"}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.M)
V1_USE = re.compile(r"\bv1::")
LAYER_CALL = re.compile(r"^remotehead_server_layer\((\w+)", re.M)
LAYER_LINK = re.compile(r"\bremotehead_server_(\w+)\b")


def strip_comments(text):
    """The code of a C++ file without its comments (a comment may name any layer)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def brings_grpc(kind, quoted):
    """Whether an include brings gRPC's types: gRPC's own headers, a generated stub, and a
    remotehead/wire/ header that includes one of those (one not found counts as bringing them)."""
    if quoted.startswith("grpcpp/") or quoted.startswith("grpc/") or quoted.endswith(".grpc.pb.h"):
        return True
    if kind != '"' or not quoted.startswith("remotehead/wire/"):
        return False
    path = PROTO / quoted
    if not path.exists():
        return True
    return any(brings_grpc(k, t) for k, t in INCLUDE.findall(strip_comments(path.read_text())))


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
    return inner[0] if len(inner) > 1 else "(the top of src/)"


def server_files(server):
    return sorted(p for p in list((server / "src").rglob("*")) +
                  list((server / "include").rglob("*")) if p.suffix in (".h", ".cc"))


def layer_targets(cmake_text):
    """[(layer, the call's arguments)] for each remotehead_server_layer call, in order."""
    text = re.sub(r"#[^\n]*", "", cmake_text)
    calls = []
    for match in LAYER_CALL.finditer(text):
        depth, end = 1, len(text)
        for i in range(match.end(), len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                end = i
                break
        calls.append((match.group(1), text[match.end():end]))
    return calls


def target_violations(server):
    """Layer targets that are no layer, or that link a layer not below them."""
    found = []
    cmake = server / "CMakeLists.txt"
    for layer, body in layer_targets(cmake.read_text() if cmake.exists() else ""):
        if layer not in RANK or layer == "main":
            found.append(f"CMakeLists.txt: layer target {layer} is not a layer")
            continue
        for linked in LAYER_LINK.findall(body):
            if linked not in RANK or RANK[linked] >= RANK[layer]:
                found.append(f"CMakeLists.txt: layer {layer} links remotehead_server_{linked}, "
                             "which is not below it")
    return found


def violations(server):
    """Every broken rule in the server at `server`, one line each."""
    found = target_violations(server)
    for path in server_files(server):
        rel = path.relative_to(server)
        layer = layer_of(server, path)
        if layer not in RANK:
            found.append(f"{rel}: folder {layer} is not a layer ({', '.join(LAYERS)})")
            continue
        code = strip_comments(path.read_text())
        for kind, target in INCLUDE.findall(code):
            if brings_grpc(kind, target) and layer not in GRPC_LAYERS:
                found.append(f"{rel}: includes gRPC ({target}) outside rpc/")
            if kind == '"' and ".." in target.split("/"):
                found.append(f"{rel}: includes {target}, climbing out of its folder")
        if layer not in V1_LAYERS and V1_USE.search(code):
            found.append(f"{rel}: names a v1:: type outside rpc/translate/replication/")
    return found


def test_the_server_keeps_its_layers():
    assert violations(SERVER) == []


def test_every_layer_is_a_folder_holds_files_and_is_a_target():
    folders = {p.name for p in (SERVER / "src").iterdir() if p.is_dir()}
    assert folders == set(LAYERS) - {"main"}
    targets = [layer for layer, _ in layer_targets((SERVER / "CMakeLists.txt").read_text())]
    assert targets == LAYERS[:-1]  # declared bottom to top
    for layer in folders:
        assert list((SERVER / "src" / layer).glob("*.cc")), layer


# ----- each rule can fail -----

def write(server, rel, text):
    path = server / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


CLEAN_CMAKE = """\
remotehead_server_layer(group
  SOURCES src/group/head_group.cc
  PRIVATE OpenSSL::Crypto)
remotehead_server_layer(service
  SOURCES src/service/head_operations.cc
  PUBLIC remotehead_server_group prometheus-cpp::core)
# remotehead_server_rpc in a comment is fine
remotehead_server_layer(step
  SOURCES src/step/step_session.cc
  PUBLIC remotehead_server_service)
"""


@pytest.fixture()
def clean(tmp_path):
    """A small server that keeps every rule."""
    server = tmp_path / "server"
    write(server, "CMakeLists.txt", CLEAN_CMAKE)
    write(server, "include/remotehead/server/group/head_group.h",
          '#include "remotehead/core/vocab_group.h"\n')
    write(server, "src/group/head_group.cc", '#include "remotehead/server/group/head_group.h"\n')
    write(server, "src/service/head_operations.h",
          '#include "remotehead/server/group/head_group.h"\n')
    write(server, "src/step/step_session.h", '#include "service/head_operations.h"\n')
    write(server, "src/translate/protocol.h",
          '#include "step/step_session.h"\n#include "remotehead/v1/head_service.pb.h"\n'
          "// v1::StepHeader and <grpcpp/grpcpp.h> in a comment are fine anywhere\n")
    write(server, "src/replication/group_steps.h", '#include "translate/protocol.h"\n')
    write(server, "src/rpc/head_service.cc",
          "#include <grpcpp/grpcpp.h>\n#include \"replication/group_steps.h\"\n"
          '#include "remotehead/wire/frames.h"\n')
    write(server, "src/main.cc", '#include "rpc/head_service.h"\n#include <grpcpp/grpcpp.h>\n'
          '#include "remotehead/wire/http2_settings.h"\n')
    write(server, "src/rpc/head_service.h", "")
    return server


def test_a_clean_tree_passes(clean):
    assert violations(clean) == []


@pytest.mark.parametrize("rel, text, expected", [
    ("src/service/metrics.cc", "#include <grpcpp/support/server_interceptor.h>\n",
     "includes gRPC"),
    ("src/translate/x.h", '#include "remotehead/v1/head_service.grpc.pb.h"\n', "includes gRPC"),
    ("src/replication/x.cc", '#include "remotehead/wire/frames.h"\n', "includes gRPC"),
    ("src/step/x.cc", "#include <grpc/grpc.h>\n", "includes gRPC"),
    ("src/step/step_session.cc", "int f(const v1::StepHeader& h);\n", "names a v1:: type"),
    ("src/main.cc", "v1::GroupCommand command;\n", "names a v1:: type"),
    ("src/step/x.cc", '#include "../rpc/step_stream.h"\n', "climbing out of its folder"),
    ("src/misc/thing.cc", "", "is not a layer"),
    ("src/thing.cc", "", "is not a layer"),
    ("CMakeLists.txt", CLEAN_CMAKE.replace("PUBLIC remotehead_server_service)",
                                           "PUBLIC remotehead_server_service\n"
                                           "         remotehead_server_rpc)"),
     "layer step links remotehead_server_rpc"),
    ("CMakeLists.txt", CLEAN_CMAKE.replace("PRIVATE OpenSSL::Crypto)",
                                           "PRIVATE remotehead_server_group)"),
     "layer group links remotehead_server_group"),
    ("CMakeLists.txt", CLEAN_CMAKE + "remotehead_server_layer(misc\n  SOURCES src/misc/a.cc)\n",
     "layer target misc is not a layer"),
])
def test_each_rule_catches_its_break(clean, rel, text, expected):
    write(clean, rel, text)
    found = violations(clean)
    assert any(expected in line for line in found), found


def test_wire_headers_bring_grpc_as_they_are_written():
    assert brings_grpc('"', "remotehead/v1/head_service.grpc.pb.h")
    assert brings_grpc('"', "remotehead/wire/frames.h")  # grpc::ByteBuffer
    assert brings_grpc('"', "remotehead/wire/no_such_header.h")
    assert not brings_grpc('"', "remotehead/wire/tensor_codec.h")  # protobuf's messages only
    assert not brings_grpc('"', "remotehead/wire/http2_settings.h")  # plain C++ in its header
    assert not brings_grpc('"', "remotehead/v1/head_service.pb.h")
