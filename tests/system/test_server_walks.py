"""The walks of the docs name only functions that exist, where they say, in the code's order.

server/README.md's "The path of one ForwardBackward" and "A mesh's synchronous optimizer step",
docs/engine.md's "The path of one fused step" and "The path of a row-coupled call", and
docs/hugging-face.md's "The path of a Trainer step through `offload_lm_head`" are tables of
layer | file | function | what it does (files relative to the document). Each function must be
defined (or declared in its class) in the file named beside it (C++, or Python: `def f`, and
`Class.f` in `class Class`); every other `Class::Function` the server's walks name must be
defined in some source of the server or core; a walk stays within 4 files per layer; and its
rows keep the code's order: no row calls the row before it (a callee listed before its caller).

The "Layers" table of server/README.md names every unit of server/src (a source file, or a
header alone) in its layer's row, and docs/engine.md's file list every file of core/, so a file
added without a word about it fails here.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "server" / "README.md"
ENGINE = ROOT / "docs" / "engine.md"
HUGGING_FACE = ROOT / "docs" / "hugging-face.md"
WALKS = [(README, "The path of one ForwardBackward"),
         (README, "A mesh's synchronous optimizer step"),
         (ENGINE, "The path of one fused step"),
         (ENGINE, "The path of a row-coupled call"),
         (HUGGING_FACE, "The path of a Trainer step through `offload_lm_head`")]
WALK_IDS = [title for _, title in WALKS]
MAX_FILES_PER_LAYER = 4


def section(text, title):
    """The body of the `## title` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section '## {title}'"
    return match.group(1)


def rows(body):
    """(layer, file, function) of each row of the section's table."""
    found = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("layer", "") or set(cells[0]) <= set("-"):
            continue
        found.append((cells[0], cells[1].strip("`"), cells[2].strip("`")))
    return found


def defines_py(text, function):
    """Whether Python `text` defines `function` (f, or Class.f: def f inside class Class)."""
    *owner, name = function.split(".")
    if owner:
        body = py_body(text, owner[-1], keyword="class")
        return body is not None and bool(re.search(rf"^\s*def {re.escape(name)}\s*\(", body, re.M))
    return bool(re.search(rf"^\s*def {re.escape(name)}\s*\(", text, re.M))


def py_body(text, name, keyword="def"):
    """The lines of Python `def name` (or `class name`) after its first line, by indentation."""
    match = re.search(rf"^(\s*){keyword} {re.escape(name)}\b.*$", text, re.M)
    if not match:
        return None
    indent = len(match.group(1))
    lines = []
    for line in text[match.end() + 1:].splitlines():
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        lines.append(line)
    return "\n".join(lines)


def qualified(function):
    """A regex of C++ `function` (A::B::f) as a definition names it: a class template's
    arguments may follow each class (A<Call>::f)."""
    return r"(?:<[^<>;]*>)?::".join(re.escape(part) for part in function.split("::"))


def defines(text, function):
    """Whether C++ `text` defines `function` (A::B::f, or f declared or defined in a class)."""
    name = function.split("::")[-1]
    qualified_call = qualified(function) + r"\s*\("
    return bool(re.search(qualified_call, text)) or bool(
        "::" not in function and re.search(rf"\b{re.escape(name)}\s*\(", text)) or bool(
        "::" in function and re.search(rf"\b{re.escape(name)}\s*\(", text) and
        re.search(rf"\b(class|struct)\s+{re.escape(function.split('::')[-2])}\b", text))


def body_of(text, function):
    """The body of `function`'s definition in C++ `text`, or None where it is only declared."""
    name = function.split("::")[-1]
    head = qualified(function) if "::" in function else r"(?<![\w:])" + re.escape(name)
    for match in re.finditer(head + r"\s*\(", text):
        i, depth = match.end(), 1
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        brace = re.match(r"[^;{}]*\{", text[i:])
        if not brace:
            continue  # a declaration or a call
        j = k = i + brace.end()
        depth = 1
        while k < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
        return text[j:k - 1]
    return None


def calls(body, function):
    """Whether `body` calls `function` (by its last name)."""
    name = re.split(r"::|\.", function)[-1]
    return body is not None and bool(re.search(rf"\b{re.escape(name)}\s*\(", body))


def order_errors(steps, read):
    """Rows that call the row before them: `steps` as rows() gives them, `read(file)` its text."""
    found = []
    for (_, file_a, a), (_, file_b, b) in zip(steps, steps[1:]):
        text = read(file_b)
        body = (py_body(text, b.split(".")[-1]) if file_b.endswith(".py")
                else body_of(text, b))
        if calls(body, a):
            found.append(f"{b} calls {a}, which the walk lists before it")
    return found


def layer_rows(text):
    """The Layers table's files cell, by layer (rpc, replication, …, service, group)."""
    body = re.search(r"^## Layers\n(.*?)(?=^## )", text, re.S | re.M).group(1)
    found = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] == "layer" or set(cells[0]) <= set("-"):
            continue
        found[re.match(r"`?([a-z]+)", cells[0]).group(1)] = cells[1]
    return found


def unnamed_units(server, table):
    """server/src's units (a file's stem; main.cc aside) that their layer's row does not name."""
    missing = set()
    for path in sorted((server / "src").rglob("*")):
        if path.suffix not in (".cc", ".h") or path.name == "main.cc":
            continue
        rel = path.relative_to(server / "src")
        layer = rel.parts[0] if len(rel.parts) > 1 else "(the top of src/)"
        named = re.search(rf"\b{re.escape(path.stem)}(\.cc|\.h|\.\{{h,cc\}})", table.get(layer, ""))
        if not named:
            missing.add(str(rel.with_suffix("")))
    return sorted(missing)


def sources():
    return [p for root in (ROOT / "server", ROOT / "core")
            for p in root.rglob("*") if p.suffix in (".h", ".cc")]


@pytest.mark.parametrize("doc, title", WALKS, ids=WALK_IDS)
def test_each_step_of_the_walk_is_in_its_file(doc, title):
    steps = rows(section(doc.read_text(), title))
    assert len(steps) >= 7, steps
    for layer, file, function in steps:
        path = (doc.parent / file).resolve()
        assert path.is_file(), f"{title}: {file} does not exist"
        found = (defines_py if path.suffix == ".py" else defines)(path.read_text(), function)
        assert found, f"{title}: {function} is not in {file}"


@pytest.mark.parametrize("doc, title", WALKS, ids=WALK_IDS)
def test_a_walk_stays_within_four_files_per_layer(doc, title):
    by_layer = {}
    for layer, file, _ in rows(section(doc.read_text(), title)):
        by_layer.setdefault(layer, set()).add(file)
    for layer, files in by_layer.items():
        assert len(files) <= MAX_FILES_PER_LAYER, (layer, sorted(files))


@pytest.mark.parametrize("doc, title", WALKS, ids=WALK_IDS)
def test_no_row_calls_the_row_before_it(doc, title):
    steps = rows(section(doc.read_text(), title))
    assert order_errors(steps, lambda f: (doc.parent / f).resolve().read_text()) == []


def test_the_layers_table_names_every_unit():
    table = layer_rows(README.read_text())
    assert set(table) == {"rpc", "replication", "translate", "step", "service", "group"}, table
    assert unnamed_units(ROOT / "server", table) == []


@pytest.mark.parametrize("doc, title", WALKS[:2], ids=WALK_IDS[:2])
def test_every_qualified_function_the_walk_names_exists(doc, title):
    body = section(doc.read_text(), title)
    texts = [p.read_text() for p in sources()]
    named = set(re.findall(r"`((?:[A-Z]\w*::)+[A-Z]\w*)`", body))
    assert named, title
    missing = [f for f in sorted(named) if not any(defines(t, f) for t in texts)]
    assert missing == []


def test_a_missing_function_is_caught(tmp_path):
    text = "int Other::Thing(int x) { return x; }\nclass Lane { absl::Status Run(); };\n"
    assert defines(text, "Other::Thing")
    assert defines(text, "HeadGroup::Lane::Run")
    assert not defines(text, "Other::OnRows")
    assert not defines(text, "DecodeInputs")
    template = "template <typename Call>\nvoid StreamPipeline<Call>::ComputeNext() { Run(); }\n"
    assert defines(template, "StreamPipeline::ComputeNext")
    assert body_of(template, "StreamPipeline::ComputeNext").strip() == "Run();"
    assert not defines(template, "StreamPipeline::Attach")
    table = "| layer | file | function | what |\n|---|---|---|---|\n| rpc | `a.cc` | `F` | x |\n"
    assert rows(table) == [("rpc", "a.cc", "F")]


def test_the_engines_file_list_names_every_file_of_core():
    text = (ROOT / "docs" / "engine.md").read_text()
    files = text[text.index("Files: "):text.index("No header includes another in a loop.")]
    core = ROOT / "core"
    stems = {p.stem for p in [*(core / "include" / "remotehead" / "core").glob("*.h"),
                              *(core / "src").glob("*.*")]}
    missing = [s for s in sorted(stems)
               if not re.search(rf"\b{re.escape(s)}(\.cc|\.h|\.cu|`)", files)]
    assert missing == []
    assert "fused/" in files


def test_a_swapped_pair_and_an_unnamed_file_are_caught(tmp_path):
    text = ("void Outer(int x) {\n  Inner(x);\n}\n"
            "void Inner(int x);\nvoid Inner(int x) { (void)x; }\n")
    assert body_of(text, "Outer").strip() == "Inner(x);"
    assert body_of(text, "Inner").strip() == "(void)x;"
    read = lambda f: text  # noqa: E731
    assert order_errors([("rpc", "a.cc", "Outer"), ("rpc", "a.cc", "Inner")], read) == []
    assert order_errors([("rpc", "a.cc", "Inner"), ("rpc", "a.cc", "Outer")], read) == [
        "Outer calls Inner, which the walk lists before it"]
    (tmp_path / "src" / "rpc").mkdir(parents=True)
    for name in ("src/rpc/a.cc", "src/rpc/a.h", "src/rpc/b.h", "src/c.cc", "src/main.cc"):
        (tmp_path / name).write_text("")
    table = {"rpc": "`a.cc` (one), `b.h`", "service": ""}
    assert unnamed_units(tmp_path, table) == ["c"]
    py = "class Head:\n    def loss(self):\n        return step()\n\ndef step():\n    pass\n"
    assert defines_py(py, "Head.loss") and defines_py(py, "step")
    assert not defines_py(py, "Head.step") and not defines_py(py, "Other.loss")
    assert py_body(py, "loss").strip() == "return step()"
