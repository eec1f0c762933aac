"""The docs a newcomer reads hold together.

Relative links and anchors resolve, the README stays short, and nothing cites a notes file that is not in the
repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 120
# Written on another branch of the same issue; checked like any other target once it is in the tree.
PENDING = {"docs/architecture.md"}
# Built from parts, so this file does not name what it forbids.
NOTES_NAME = "FIELD" + "-NOTES"

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _markdown_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "plugins").rglob("README.md"))]
    return [f for f in files if ".venv" not in f.parts and "build" not in f.parts]


def _prose(text: str, *, code_spans: bool = False) -> list[str]:
    """The lines outside fenced code blocks; inline code spans blanked out unless `code_spans`."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        out.append("" if fenced else line if code_spans else re.sub(r"`[^`]*`", "", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file offers, numbered as GitHub numbers repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(), code_spans=True):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    targets = []
    for line in _prose(path.read_text()):
        targets += _LINK.findall(line) + _IMAGE.findall(line)
    return targets


def test_slug_follows_github() -> None:
    assert slug("Waiting without spinning (2026-11-23, 23:25-23:45 UTC)") == (
        "waiting-without-spinning-2026-11-23-2325-2345-utc"
    )
    assert slug("4. Device memory in the data path: direct or staged, one contract") == (
        "4-device-memory-in-the-data-path-direct-or-staged-one-contract"
    )
    assert slug("The pair bench (`kvbridge bench`)") == "the-pair-bench-kvbridge-bench"


def test_links_are_found(tmp_path: Path) -> None:
    probe = tmp_path / "probe.md"
    probe.write_text("see [a](x.md#y), ![img](i.svg) and [b [c]](z.md) but `[no](n.md)`\n```\n[no](m.md)\n```\n")
    assert links(probe) == ["x.md#y", "z.md", "i.svg"]


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s), mailto: not this test's business
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / unquote(file_part)).resolve() if file_part else doc
        rel = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else str(dest)
        if not dest.exists():
            if rel not in PENDING:
                broken.append(f"{target}: no {rel}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {rel} has no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(REPO)} has broken links:\n" + "\n".join(broken)


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move details to the docs it links"
    )


def test_nothing_cites_a_notes_file_outside_the_repository() -> None:
    # tracked and untracked-but-not-ignored files: what a commit would hold, never .git or .venv
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    cites = []
    for name in filter(None, listed):
        path = REPO / name.decode()
        if path.parts[len(REPO.parts)] in {".git", ".venv"} or not path.is_file():
            continue
        if NOTES_NAME.encode() in path.read_bytes():
            cites.append(name.decode())
    assert not cites, f"these files cite {NOTES_NAME}, which is not in the repository; state the fact instead: {cites}"
