"""Every relative link in the README, the CHANGELOG and docs/ points at a file that exists, and every
``#anchor`` at a heading of that file (GitHub's slugs), so the docs' cross-references stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (a link-shaped string in code is not a link)."""
    out, fence = [], None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if m and (fence is None or m.group(1)[0] == fence):
            fence = None if fence else m.group(1)[0]
            continue
        if fence is None:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", _prose(path), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_githubs_rule():
    assert slug("Behind a reverse proxy") == "behind-a-reverse-proxy"
    assert slug("What `make demo` prints") == "what-make-demo-prints"
    assert slug("Sharded models: FSDP2 and HSDP") == "sharded-models-fsdp2-and-hsdp"
