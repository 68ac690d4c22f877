"""How big the code's units are: a C++ class's files together, and every Python file.

A unit is a class with its files: the headers in which it is the main class and the sources
that mostly define its members (server/, core/, client/cpp/; `Client::Impl`'s members count as
`Client`'s). A file's main class is the one it gives the most lines: in a header, the class whose
body (from `class X {` or `struct X::Inner {` to its closing `};`) is longest; in a source, or a
header with no class body (a template's definitions), the class most of its member definitions
(`… X::Name(` or `… X<T>::Name(` at a line's start) belong to. A file with no
class is a unit of its own. A unit over WARN_LINES is worth a look and is printed; one over
MAX_LINES fails: split it by concept (a class per concern, value types in their own header), never
to dodge the count. Each Python file is a unit (Python keeps a class in one file; the generated
stubs aside), and so is each file of the tests and scripts, C++ ones too (their classes are
fixtures, one file each).
"""

import collections
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPP_ROOTS = [ROOT / "server", ROOT / "core", ROOT / "client" / "cpp"]
FILE_ROOTS = [ROOT / "client" / "python" / "remotehead", ROOT / "client" / "python" / "examples",
            ROOT / "tests", ROOT / "scripts"]
WARN_LINES = 600
MAX_LINES = 800

CLASS_OPEN = re.compile(r"^\s*(?:class|struct)\s+(?:\[\[[^\]]*\]\]\s*)?"
                        r"([A-Za-z_]\w*)(?:::\w+)*\b(?:\s+final)?\s*(?::[^;{]*)?\{", re.M)
MEMBER_DEFINITION = re.compile(
    r"^[^\s#/][^;=(]*?\b([A-Z]\w*)(?:<[^>]*>)?::(?:[A-Z]\w*::)*~?[A-Za-z_]\w*\s*\(", re.M)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def header_class(text):
    """The class a header gives the most lines (its outermost name), or None."""
    code = strip_comments(text)
    sizes = collections.Counter()
    for match in CLASS_OPEN.finditer(code):
        depth, end = 0, len(code)
        for i in range(match.end() - 1, len(code)):
            if code[i] == "{":
                depth += 1
            elif code[i] == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
        sizes[match.group(1)] += code.count("\n", match.start(), end) + 1
    return sizes.most_common(1)[0][0] if sizes else None


def source_class(text):
    """The class most of a source's member definitions belong to (its outermost name), or None."""
    counts = collections.Counter(MEMBER_DEFINITION.findall(strip_comments(text)))
    return counts.most_common(1)[0][0] if counts else None


def cpp_units(roots):
    """{unit name: [(path, lines)]} for the C++ files under `roots`."""
    units = collections.defaultdict(list)
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix not in (".h", ".cc", ".cu", ".cuh") or "build" in path.parts:
                continue
            text = path.read_text()
            # A header without a class body (a template's definitions) goes by its definitions.
            header = path.suffix in (".h", ".cuh")
            cls = (header_class(text) if header else None) or source_class(text)
            rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            key = f"{root.name}: {cls}" if cls else f"{rel}"
            units[key].append((rel, len(text.splitlines())))
    return units


def sizes(units):
    return sorted(((sum(n for _, n in files), name, files) for name, files in units.items()),
                  reverse=True)


def over(units, limit):
    return [f"{name}: {total} lines over {', '.join(f'{p} ({n})' for p, n in files)}"
            for total, name, files in sizes(units) if total > limit]


def file_units(roots):
    """{file: [(file, lines)]}: Python files, and every source file of the tests and scripts."""
    return {str(p.relative_to(ROOT)): [(p.relative_to(ROOT), len(p.read_text().splitlines()))]
            for root in roots for p in sorted(root.rglob("*"))
            if p.suffix in (".py", ".cc", ".h") and "v1" not in p.parts}


def test_no_cpp_unit_is_over_800_lines():
    units = cpp_units(CPP_ROOTS)
    for line in over(units, WARN_LINES):
        print(f"warning: over {WARN_LINES}: {line}")
    assert over(units, MAX_LINES) == []


def test_no_python_test_or_script_file_is_over_800_lines():
    units = file_units(FILE_ROOTS)
    for line in over(units, WARN_LINES):
        print(f"warning: over {WARN_LINES}: {line}")
    assert over(units, MAX_LINES) == []


# ----- the rule measures what it says -----

def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_class_over_several_files_is_one_unit(tmp_path):
    root = tmp_path / "lib"
    write(root, "include/thing.h", "struct Options {\n  int a;\n};\nclass Thing {\n" +
          "  void f();\n" * 300 + "};\n")
    write(root, "src/thing.cc", "void Thing::f() {\n" + "  x();\n" * 300 + "}\n")
    write(root, "src/thing_more.cc", "int Thing::g(int a) {\n" + "  y();\n" * 200 + "}\n"
          "void Other::h() {}\n")
    write(root, "src/thing_impl.h", "struct Thing::Impl {\n" + "  int x;\n" * 10 + "};\n")
    write(root, "src/alone.cc", "int main() {}\n" + "\n" * 90)
    write(root, "src/thing_inl.h", "template <typename T>\nvoid Thing<T>::k() {}\n")
    units = cpp_units([root])
    assert {name: [str(p.name) for p, _ in files] for name, files in units.items()} == {
        "lib: Thing": ["thing.h", "thing.cc", "thing_impl.h", "thing_inl.h", "thing_more.cc"],
        str(root / "src/alone.cc"): ["alone.cc"]}
    assert [line.split(":")[1] for line in over(units, MAX_LINES)] == [" Thing"]
    assert over(units, 1000) == []
