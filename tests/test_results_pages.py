"""Reports live in docs/results/: every page there is dated and listed in its index, and no bench writes a
report anywhere else in docs/ (the design pages say what is; the results say what was measured, and when)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "README.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
#: A path into docs/ built in Python (``ROOT / "docs" / "x.md"``): where a bench writes its page.
DOCS_PATH = re.compile(r'/ "docs" / "([^"]+)"')


def _pages() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.suffix in (".md", ".png") and p != INDEX)


def test_every_results_page_is_in_the_index():
    index = INDEX.read_text()
    listed = set(re.findall(r"\]\(([^)#]+)\)", index)) | set(re.findall(r"`([\w.-]+\.(?:md|png))`", index))
    shown = {p.name for p in _pages()}
    # A plot beside its page may be named by its suffix only ("(+ `.png`, `-chars.png`)").
    covered = {n for n in shown if n in listed or any(n.startswith(Path(m).stem) for m in listed)}
    assert shown == covered, f"docs/results/README.md does not list {sorted(shown - covered)}"


def test_every_results_page_says_when_it_was_measured():
    undated = [
        p.name for p in _pages() if p.suffix == ".md" and not DATE.search("\n".join(p.read_text().splitlines()[:12]))
    ]
    assert not undated, f"no date in the first lines of {undated}"


def test_benches_write_their_reports_into_docs_results():
    elsewhere = [
        f"{path.relative_to(ROOT)}: docs/{target}"
        for path in sorted((ROOT / "bench").rglob("*.py"))
        for target in DOCS_PATH.findall(path.read_text())
        if target != "results"
    ]
    assert not elsewhere, f"benches writing outside docs/results/: {elsewhere}"
    assert DOCS_PATH.findall('DOC = ROOT / "docs" / "wan.md"') == ["wan.md"]
