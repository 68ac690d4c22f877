"""What follows from the GPU machine's facts (scripts/lib/gpu-machine.txt) for a GPU kit.

  python3 scripts/lib/gpu_machine.py kit-requirements       the wheels the kit carries: what
        scripts/gpu-check imports there (the Python client's runtime, the stubs' generator,
        scripts/bench-gpu's peers, pytest: tests/gpu/requirements.txt) less what the machine has, pinned as the project pins them
  python3 scripts/lib/gpu_machine.py fallback-requirements  the Python client's runtime
        packages that the machine has at a version nobody read (protobuf, grpcio): carried
        pinned, installed there only if the machine's own cannot load the stubs that the kit's
        generator wrote
  python3 scripts/lib/gpu_machine.py standin-requirements   the environment the CPU dry run
        stands in for the machine with: the machine's torch at its version, and the rest of
        what the check imports from the machine at the project's pins (the machine's own
        versions may not exist for the dry run's Python: numpy 2.5 has no CPython 3.11 wheel)
  python3 scripts/lib/gpu_machine.py get KEY                a header fact (python-version,
        cuda-arch, python)

Standard library only (it runs before any environment exists).
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FACTS = ROOT / "scripts" / "lib" / "gpu-machine.txt"
# What scripts/gpu-check imports on the machine, and the project's files that pin it.
NEEDS = [ROOT / "client" / "python" / "requirements.txt",
         ROOT / "client" / "python" / "requirements-build.txt",
         ROOT / "tests" / "bench" / "requirements-gpu-peers.txt",
         ROOT / "tests" / "gpu" / "requirements.txt"]
PIN_FILES = [ROOT / "requirements.txt", *NEEDS, ROOT / "client" / "python" / "requirements-dev.txt"]
_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s#;]+))?\s*(?:#.*)?$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(path: pathlib.Path) -> dict[str, str | None]:
    """NAME -> pinned version (None: unpinned) of a requirements file of pins and bare names."""
    out: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise SystemExit(f"{path}: expected NAME or NAME==VERSION; got {raw!r}")
        out[canonical(m.group(1))] = m.group(2)
    return out


def machine_packages() -> dict[str, str | None]:
    """NAME -> version (None: there, version not read) of the machine's package lines."""
    out: dict[str, str | None] = {}
    for raw in FACTS.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", parts[0]):
            raise SystemExit(f"{FACTS}: expected NAME or NAME VERSION; got {raw!r}")
        out[canonical(parts[0])] = parts[1] if len(parts) == 2 else None
    return out


def facts() -> dict[str, str]:
    """The header facts ('# key: value' lines before the package list)."""
    out = {}
    for line in FACTS.read_text().splitlines():
        m = re.match(r"^#\s*([a-z][a-z0-9-]*):\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for path in PIN_FILES:
        for name, version in requirements(path).items():
            if version:
                out.setdefault(name, version)
    return out


def needed() -> list[str]:
    names: list[str] = []
    for path in NEEDS:
        names += [n for n in requirements(path) if n not in names]
    return names


def pinned(name: str) -> str:
    version = pins().get(name)
    if not version:
        raise SystemExit(f"gpu_machine: {name} is needed on the GPU machine but no requirements "
                         f"file of the project pins it")
    return f"{name}=={version}"


def main(argv: list[str]) -> int:
    machine = machine_packages()
    command = argv[0] if argv else ""
    if command == "kit-requirements":
        lines = [pinned(n) for n in needed() if n not in machine]
    elif command == "fallback-requirements":
        runtime = requirements(NEEDS[0])  # the client's runtime: what the stubs load with
        lines = [pinned(n) for n in runtime if n in machine and machine[n] is None]
    elif command == "standin-requirements":
        # The machine's torch (the low end of the range the build must take); the rest at the
        # project's pins (the machine's own versions may not exist for the dry run's Python).
        lines = [f"torch=={machine['torch']}"] + [pinned(n) for n in needed()
                                                   if n in machine and n != "torch"]
    elif command == "get" and len(argv) == 2:
        value = facts().get(argv[1])
        if value is None:
            raise SystemExit(f"gpu_machine: {FACTS.name} states no '{argv[1]}'")
        lines = [value]
    else:
        print(__doc__, file=sys.stderr)
        return 64
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
