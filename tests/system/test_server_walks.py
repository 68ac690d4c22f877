"""server/README.md's walks name only functions that exist, where they say.

"The path of one ForwardBackward" and "A mesh's synchronous optimizer step" are tables of
layer | file | function | what it does. Each function must be defined (or declared in its
class) in the file named beside it; every other `Class::Function` the sections name must be
defined in some source of the server or core; and a walk stays within 4 files per layer.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "server" / "README.md"
WALKS = ["The path of one ForwardBackward", "A mesh's synchronous optimizer step"]
MAX_FILES_PER_LAYER = 4


def section(text, title):
    """The body of the `## title` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"server/README.md has no section '## {title}'"
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


def defines(text, function):
    """Whether C++ `text` defines `function` (A::B::f, or f declared or defined in a class)."""
    name = function.split("::")[-1]
    qualified = re.escape(function) + r"\s*\("
    return bool(re.search(qualified, text)) or bool(
        "::" not in function and re.search(rf"\b{re.escape(name)}\s*\(", text)) or bool(
        "::" in function and re.search(rf"\b{re.escape(name)}\s*\(", text) and
        re.search(rf"\b(class|struct)\s+{re.escape(function.split('::')[-2])}\b", text))


def sources():
    return [p for root in (ROOT / "server", ROOT / "core")
            for p in root.rglob("*") if p.suffix in (".h", ".cc")]


@pytest.mark.parametrize("title", WALKS)
def test_each_step_of_the_walk_is_in_its_file(title):
    steps = rows(section(README.read_text(), title))
    assert len(steps) >= 8, steps
    for layer, file, function in steps:
        path = (README.parent / file).resolve()
        assert path.is_file(), f"{title}: {file} does not exist"
        assert defines(path.read_text(), function), f"{title}: {function} is not in {file}"


@pytest.mark.parametrize("title", WALKS)
def test_a_walk_stays_within_four_files_per_layer(title):
    by_layer = {}
    for layer, file, _ in rows(section(README.read_text(), title)):
        by_layer.setdefault(layer, set()).add(file)
    for layer, files in by_layer.items():
        assert len(files) <= MAX_FILES_PER_LAYER, (layer, sorted(files))


@pytest.mark.parametrize("title", WALKS)
def test_every_qualified_function_the_walk_names_exists(title):
    body = section(README.read_text(), title)
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
    table = "| layer | file | function | what |\n|---|---|---|---|\n| rpc | `a.cc` | `F` | x |\n"
    assert rows(table) == [("rpc", "a.cc", "F")]
