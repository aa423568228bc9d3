"""The documentation stays true to the tree: links resolve, the README stays short, and nothing
cites a file outside the repository. Plain file reads; no JAX."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
#: markdown files whose relative links must resolve (those that exist; README.md and docs/ must)
LINKED = ["README.md", "experiments/README.md", "checkpoints/README.md", "tests/README.md"]
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
# spelled in pieces so that this file does not match itself
_OUTSIDE = [re.compile(p) for p in ("REFERENCE" + r"\.md", "REFERENCE" + " §", r"\.\./" + "shared/")]


def doc_files() -> list[Path]:
    files = [ROOT / f for f in LINKED if (ROOT / f).exists() or f == "README.md"]
    return files + sorted((ROOT / "docs").glob("*.md"))


def relative_links(text: str) -> list[str]:
    """The link targets of a markdown text outside code blocks and code spans, minus external ones."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    out = []
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        out.append(target.split("#", 1)[0])
    return out


def broken_links(path: Path) -> list[str]:
    return [t for t in relative_links(path.read_text()) if not (path.parent / t).exists()]


def test_docs_exist():
    assert (ROOT / "README.md").is_file()
    assert list((ROOT / "docs").glob("*.md")), "docs/ holds no markdown files"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.is_file(), path
    assert broken_links(path) == [], f"{path.relative_to(ROOT)}: links to missing files"


def test_link_check_can_fail(tmp_path):
    (tmp_path / "there.md").write_text("x")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md) [ok too](there.md#part) [web](https://example.com) [anchor](#top)\n"
        "[gone](missing.md#x) `[code](nowhere.md)`\n```\n[block](nowhere.md)\n```\n"
    )
    assert broken_links(doc) == ["missing.md"]


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        paths = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):  # not a git checkout: every file but the usual noise
        skip = {".git", ".venv", "runs", "__pycache__", "build"}
        paths = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in paths if p.suffix in (".py", ".md") and p.is_file()]


def test_nothing_cites_a_file_outside_the_repository():
    results = ROOT / "experiments" / "results"
    offenders = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or results in path.parents:
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {p.pattern}" for p in _OUTSIDE if p.search(text)]
    assert offenders == [], "cite docs/reference.md instead:\n" + "\n".join(offenders)
