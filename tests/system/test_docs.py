"""The documentation holds together: README.md (kept short, for a newcomer), server/README.md and
docs/*.md. Every relative link and image points at a file that exists, every #anchor (in the same
file or another markdown file) names a heading there under GitHub's slug rules, README.md stays
under 300 lines, and every docs/*.md can be reached from README.md by following links. No server
and no build needed."""

import pathlib
import re
import sys
import unicodedata
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 300


def documents():
    docs = [README] + sorted((ROOT / "docs").glob("*.md"))
    if (ROOT / "server" / "README.md").is_file():
        docs.append(ROOT / "server" / "README.md")
    return docs


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def slug(heading):
    """GitHub's anchor for a heading (github-slugger): the heading's text lower-cased, every
    character removed that is not a letter, a mark, a digit, a space, a hyphen or connector
    punctuation (the underscore), then each space turned into a hyphen."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # images: their alt text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)         # links: their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML tags
    text = text.strip().lower()
    kept = []
    for char in text:
        category = unicodedata.category(char)
        if char in " -" or category[0] in "LMN" or category == "Pc":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


def anchors(path):
    """Every anchor of a markdown file: its headings' slugs, a repeated slug numbered -1, -2, …
    as GitHub does, plus explicit <a name=…> / id=… anchors."""
    seen = {}
    result = set()
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines_raw(text):
        match = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
        for explicit in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line):
            result.add(explicit)
    return result


def prose_lines_raw(text):
    """The lines outside fenced code blocks, with their 1-based numbers, inline code kept
    (headings' slugs include code spans' text)."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not line.strip()[len(match.group(1)):].strip():
                fence = None
            continue
        yield number, line


def prose_lines(text):
    """As prose_lines_raw, with inline code spans blanked so that a link written inside
    backticks is not taken for one."""
    for number, line in prose_lines_raw(text):
        yield number, re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), line)


# [text](target) and ![alt](target); the target may be <…> and may carry a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)")


def links(path):
    """(line number, target) of every markdown link, image and reference definition outside code
    (a link's text may run over several lines)."""
    text = path.read_text(encoding="utf-8")
    numbered = dict(prose_lines(text))
    prose = "\n".join(numbered.get(n, "") for n in range(1, text.count("\n") + 2))
    for match in LINK.finditer(prose):
        yield prose.count("\n", 0, match.start()) + 1, match.group(1).strip("<>")
    for number, line in numbered.items():
        match = REFERENCE.match(line)
        if match:
            yield number, match.group(1)


def is_external(target):
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None   # http:, https:, mailto:, …


def check_link(source, target):
    """None if the link resolves, else why not."""
    if is_external(target):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = urllib.parse.unquote(path_part)
    if path_part.startswith("/"):
        return "an absolute path (GitHub resolves it against the site, not the repository)"
    resolved = (source.parent / path_part).resolve() if path_part else source
    if not resolved.exists():
        return f"{path_part}: no such file"
    try:
        resolved.relative_to(ROOT)
    except ValueError:
        return f"{path_part}: outside the repository"
    if anchor:
        anchor = urllib.parse.unquote(anchor)
        if resolved.suffix != ".md" or not resolved.is_file():
            return f"#{anchor}: an anchor into {path_part}, which is not a markdown file"
        if anchor not in anchors(resolved):
            return (f"#{anchor}: no heading of {resolved.relative_to(ROOT)} has that anchor "
                    f"(it has {', '.join(sorted(anchors(resolved)))})")
    return None


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(document):
    broken = [f"{document.relative_to(ROOT)}:{number}: ({target}) {why}"
              for number, target in links(document)
              if (why := check_link(document, target)) is not None]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES} (a newcomer reads it "
        "to the end) and move the rest into docs/")


def test_every_doc_is_reachable_from_the_readme():
    """Following relative links from README.md (through other documents too) reaches every
    docs/*.md."""
    reached = {README.resolve()}
    frontier = [README.resolve()]
    while frontier:
        source = frontier.pop()
        for _, target in links(source):
            if is_external(target):
                continue
            path_part = urllib.parse.unquote(target.partition("#")[0])
            if not path_part:
                continue
            resolved = (source.parent / path_part).resolve()
            if resolved.suffix == ".md" and resolved.is_file() and resolved not in reached:
                reached.add(resolved)
                frontier.append(resolved)
    unreached = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))
                 if p.resolve() not in reached]
    assert not unreached, f"not linked from README.md, directly or through another doc: {unreached}"


# The slug rules themselves, on headings of the kinds the documents use.
@pytest.mark.parametrize("heading, expected", [
    ("Where to go next", "where-to-go-next"),
    ("Files (`--checkpoint_dir`)", "files---checkpoint_dir"),
    ("The group plane: nobody else runs commands", "the-group-plane-nobody-else-runs-commands"),
    ("The operator CLI: `remotehead`", "the-operator-cli-remotehead"),
    ("The main job on 2 trainers: `scripts/demo --trainers 2`",
     "the-main-job-on-2-trainers-scriptsdemo---trainers-2"),
    ("Benchmark: `remotehead-bench`", "benchmark-remotehead-bench"),
    ("PyTorch's `linear_cross_entropy`, and `--plot`", "pytorchs-linear_cross_entropy-and---plot"),
    ("The C++ client, and the cost of a synchronous step",
     "the-c-client-and-the-cost-of-a-synchronous-step"),
    ("Zero head memory — à la carte", "zero-head-memory--à-la-carte"),
    ("A [linked](x.md) heading", "a-linked-heading"),
])
def test_slug_follows_github(heading, expected):
    assert slug(heading) == expected


def test_a_repeated_heading_gets_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Usage\n\n```\n## Usage\n```\n\n## Usage\n\n### Usage\n")
    assert anchors(page) == {"notes", "usage", "usage-1", "usage-2"}


def test_a_broken_link_or_anchor_is_caught(tmp_path, monkeypatch):
    """The checks fail where they should: a missing file, a missing anchor, a link in code is
    ignored, an external link is skipped."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://example.com/x#y)\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-section) ![img](nope.png)\n"
        "`[in code](missing-too.md)`\n\n```\n[in a fence](missing-three.md)\n```\n"
        "[a link over\ntwo lines](other.md#not-there)\n")
    found = {target: check_link(page, target) for _, target in links(page)}
    assert set(found) == {"other.md#a-section", "#page", "https://example.com/x#y", "missing.md",
                          "other.md#no-such-section", "nope.png",
                          "other.md#not-there"}
    assert found["other.md#a-section"] is None and found["#page"] is None
    assert found["https://example.com/x#y"] is None
    assert "no such file" in found["missing.md"] and "no such file" in found["nope.png"]
    assert "no heading" in found["other.md#no-such-section"]
    assert "no heading" in found["other.md#not-there"]
