"""Every Python package's version has one home. The pins live in requirements files only:
requirements.txt (torch, numpy, pytest: the venv's key), client/python/requirements.txt (the
package's runtime dependencies, which pyproject.toml reads), client/python/requirements-build.txt
(the stubs' generator, which setup.py hands to the build frontend), client/python/
requirements-dev.txt (tests and tools) and tests/bench/requirements-gpu-peers.txt; no package is
constrained in two places — not in pyproject.toml, setup.py, the scripts, the Dockerfile or CI.
And the package's metadata does come from those files: its build requirements, as the frontend
asks setup.py for them, and its runtime dependencies."""

import pathlib
import re
import subprocess
import shutil

import build
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client" / "python"
# A version constraint: name, operator, version (no space between, as in requirements files
# and pyproject strings; `$x == 1` in a script is not one).
SPEC = re.compile(r"(?<![\w$./-])([A-Za-z][A-Za-z0-9._-]*)(===|==|~=|>=|<=|!=)\s*(\d[\w.*+!-]*)")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def where_pins_could_live():
    """The files a pin could hide in: requirements files anywhere in the project (tracked or
    new, not what git ignores: a build tree, a GPU kit's copies of the pins), the package's
    build files, the scripts, the Dockerfile and deploy/, CI."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    files = [ROOT / f for f in listed
             if f and re.fullmatch(r"requirements.*\.txt", pathlib.PurePath(f).name)]
    files += [CLIENT / "pyproject.toml", CLIENT / "setup.py", CLIENT / "MANIFEST.in"]
    for folder in ("scripts", "docker", "deploy", ".ci"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file()
                  and p.suffix not in {".json", ".png"}]
    return sorted(set(f for f in files if f.is_file()))


def requirements(path: pathlib.Path):
    """A requirements file's requirements, comments and blank lines dropped."""
    lines = path.read_text().splitlines()
    return [r for r in (line.split("#", 1)[0].strip() for line in lines) if r]


def test_no_package_is_pinned_in_two_places():
    homes = {}
    for path in where_pins_could_live():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name, operator, version in SPEC.findall(line):
                homes.setdefault(normalized(name), []).append(
                    f"{path.relative_to(ROOT)}:{number}: {name}{operator}{version}")
    assert "grpcio-tools" in homes and "torch" in homes, "the scan found the known pins"
    twice = {name: places for name, places in homes.items() if len(places) > 1}
    assert not twice, "pinned in more than one place:\n" + "\n".join(
        "\n".join(places) for places in twice.values())


def test_pins_live_only_in_requirements_files():
    """pyproject.toml bounds setuptools (the backend itself, which cannot come from a file);
    every other constraint is in a requirements file."""
    for path in where_pins_could_live():
        if re.fullmatch(r"requirements.*\.txt", path.name):
            continue
        found = SPEC.findall(path.read_text(errors="replace"))
        allowed = [("setuptools", ">=", "68")] if path == CLIENT / "pyproject.toml" else []
        assert found == allowed, f"{path.relative_to(ROOT)}: {found}"


def test_the_project_requirements_are_exact_pins():
    """What the venv installs is pinned exactly (==), bar the client's runtime torch and numpy,
    which are any (their pins are requirements.txt's)."""
    files = [ROOT / "requirements.txt", ROOT / "tests" / "bench" / "requirements-gpu-peers.txt"]
    files += sorted(CLIENT.glob("requirements*.txt"))
    for path in files:
        for requirement in requirements(path):
            if path == CLIENT / "requirements.txt" and requirement in ("torch", "numpy"):
                continue
            assert re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][\w.+!-]*", requirement), \
                f"{path.relative_to(ROOT)}: {requirement} is not name==version"


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory):
    """client/python's build files and package, away from the checkout (asking setuptools for
    the requirements writes an egg-info)."""
    copy = tmp_path_factory.mktemp("client") / "python"
    shutil.copytree(CLIENT, copy, ignore=shutil.ignore_patterns(
        "__pycache__", "build", "dist", "*.egg-info", "examples", "v1"))
    return copy


def test_the_build_requires_the_pinned_grpcio_tools(package_copy):
    """What the frontend installs (isolated) or checks (--no-isolation) before building: the
    setuptools bound of pyproject.toml, then requirements-build.txt, as setup.py reports it."""
    builder = build.ProjectBuilder(package_copy)
    assert builder.build_system_requires == {"setuptools>=68"}
    pinned = set(requirements(CLIENT / "requirements-build.txt"))
    assert any(r.startswith("grpcio-tools==") for r in pinned)
    for distribution in ("sdist", "wheel"):
        assert builder.get_requires_for_build(distribution) == pinned, distribution


def test_the_package_depends_on_its_requirements_file(package_copy):
    builder = build.ProjectBuilder(package_copy)
    metadata = (pathlib.Path(builder.metadata_path(package_copy / "meta")) / "METADATA")
    depends = [line.split(":", 1)[1].strip() for line in metadata.read_text().splitlines()
               if line.startswith("Requires-Dist:")]
    assert depends == requirements(CLIENT / "requirements.txt")
    assert {"grpcio", "protobuf", "torch", "numpy"} <= {re.split(r"[=<>~!]", d)[0]
                                                      for d in depends}
