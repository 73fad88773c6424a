"""`make demo`'s table is the README's: `gradwire demo` with its defaults (seed 0), run here once, prints every
figure of the table in README.md and docs/tutorial.md but the seconds — held-out losses, gaps, ratios, test
accuracies, bytes, nodes in sync, rounds missed. The tables were made by `make docs-tables` in another process,
on another day, under another load: a match is also the proof that a seed gives the same table every time
(every round waits for all of the demo's nodes, and the demo runs torch's portable CPU kernels).

The one run also carries what a user of the command sees: plain progress lines on a pipe (at most one per
tenth, the last at 100 %), the plot and results.json, every node in sync, both ways compressed. (This replaced
two smaller demo runs of test_cli.py that compared a seed with itself: the suite runs about as many demo
processes as before.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
docs_tables = sys.modules["docs_tables"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_tables)

DOCS = ("README.md", "docs/tutorial.md")
RUNS = ("SparseLoCo H=8 k=256", "DeMo k=4", "dense AdamW")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``gradwire demo`` as `make demo` runs it (a pipe for stdout and stderr): (stdout, stderr, out dir)."""
    tmp = tmp_path_factory.mktemp("demo")
    out = tmp / "demo_out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "gradwire_apps.cli", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, done.stderr, out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"[┃│]", line)[1:-1]]


def _figures(table: str) -> list[list[str]]:
    """The table's title, header and rows, each row without its last column (the seconds), and its footnote."""
    lines = [line.rstrip() for line in table.strip("\n").splitlines()]
    out = []
    for line in lines:
        if line.startswith(("┃", "│")):
            out.append(_cells(line)[:-1])
        elif not line.startswith(("┏", "┡", "└")):
            out.append([line.strip()])
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_the_documents_table_is_what_the_demo_prints_seconds_aside(demo, doc):
    stdout, _, _ = demo
    attrs, shown = docs_tables.blocks((ROOT / doc).read_text())["demo"]
    printed = docs_tables.demo_table(stdout)
    if attrs.get("torch") != torch.__version__:
        pytest.skip(f"{doc}'s table was made with torch {attrs.get('torch')}, this is {torch.__version__}")
    rows = [_cells(line)[0] for line in shown.splitlines() if line.startswith("│")]
    assert tuple(rows) == RUNS
    if docs_tables.made_here(attrs, torch.__version__):
        assert _figures(shown) == _figures(printed), f"{doc}'s demo table is stale: run `make docs-tables`"
        return
    # Another kind of processor (the marker's cpu=): the losses and accuracies follow the last bits of its
    # kernels' rounding; the title, the footnote, the nodes in sync and the rounds missed do not, and the bytes
    # (which follow the values a top-k keeps) stay within a few per cent.
    for want, got in zip(_figures(shown), _figures(printed), strict=True):
        if len(want) < 10:
            assert want == got, f"{doc}'s demo table is stale: run `make docs-tables`"
            continue
        assert (want[0], want[8], want[9]) == (got[0], got[8], got[9]), (want, got)
        for column in (3, 4, 6, 7):  # × up, × down, bytes up/step, bytes down/step
            a, b = (float(row[column].replace(",", "")) for row in (want, got))
            assert abs(a - b) <= 0.05 * a, (doc, want[0], column, want[column], got[column])


def test_the_demo_reports_progress_plot_and_results(demo):
    stdout, stderr, out = demo
    assert "digits MLP (26,122 parameters), 8 nodes, 320 steps per node" in stdout
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    results = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in results] == list(RUNS)
    assert all(r["in_sync"] and r["rounds_missed"] == 0 and r["steps"] == 320 for r in results)
    assert [r["rounds"] for r in results] == [40, 320, 320]  # SparseLoCo publishes a version every 8 steps
    sparseloco, demo_run, dense = results
    assert dense["up_ratio"] < 1.01 and dense["down_ratio"] < 1.01
    for r in (sparseloco, demo_run):  # both ways compressed: the re-encoded aggregate down is about a frame up
        assert r["up_ratio"] > 100 and 0.5 < r["down_ratio"] / r["up_ratio"] < 2.0, r
    # stderr is a pipe: plain progress lines (gradwire_apps.progress), at most one per tenth, the last at 100%.
    assert "\r" not in stderr
    line = re.compile(
        r"(.+): (\d+)/(\d+) version \(\d+%\), \d+:\d\d elapsed(, about \d+:\d\d left)?(, train loss \d+\.\d{4})?"
    )
    shown: dict[str, list[tuple[int, int]]] = {}
    for text in stderr.splitlines():
        m = line.fullmatch(text)
        if m:
            shown.setdefault(m[1], []).append((int(m[2]), int(m[3])))
    assert {label: lines[-1] for label, lines in shown.items()} == dict(zip(RUNS, [(40, 40), (320, 320), (320, 320)]))
    assert all(len(lines) <= 11 for lines in shown.values()), shown
