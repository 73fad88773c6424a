"""The README shows the table `gradwire demo` prints: the same title shape, columns and runs, so the
README cannot drift from what a newcomer sees after `make demo`."""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console

from gradwire_apps.demo.report import results_table
from gradwire_apps.demo.runs import DistributedResult

ROOT = Path(__file__).resolve().parent.parent
DEMO_RUN_LABELS = ("SparseLoCo H=8 k=256", "DeMo k=4", "dense AdamW")


def _readme_demo_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What `make demo` prints") :]
    return re.search(r"```text\n(.*?)```", section, re.S).group(1)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"[┃│]", line)[1:-1]]


def _printed_table() -> str:
    runs = []
    for label in DEMO_RUN_LABELS:
        r = DistributedResult(label=label, run_id="r", workers=8, rounds=40, params=26_122)
        r.title, r.test_loss, r.test_accuracy, r.server_hash = "digits MLP", 0.07, 0.98, "h"
        r.node_hashes = {i: "h" for i in range(8)}
        r.up_bytes, r.down_bytes, r.losses = [1000] * 40, [1000] * 40, [1.0] * 40
        runs.append(r)
    console = Console(width=200, record=True, color_system=None)
    console.print(results_table(runs))
    return console.export_text()


def test_readme_table_has_the_columns_and_runs_the_demo_prints():
    readme = _readme_demo_block()
    printed = _printed_table()
    header = next(line for line in printed.splitlines() if "held-out loss" in line)
    readme_header = next(line for line in readme.splitlines() if "held-out loss" in line)
    assert _cells(readme_header) == _cells(header)
    rows = [_cells(line)[0] for line in readme.splitlines() if line.startswith("│")]
    assert tuple(rows) == DEMO_RUN_LABELS
    # Every row has a value in every column, and no row hides a node that missed rounds.
    for line in readme.splitlines():
        if line.startswith("│"):
            cells = _cells(line)
            assert len(cells) == len(_cells(header)) and all(cells)
            in_sync, missed = cells[_cells(header).index("in sync")], cells[_cells(header).index("rounds missed")]
            assert in_sync == "8/8" and missed == "0"
    title = next(line for line in readme.splitlines() if line.strip()).strip()
    assert title.startswith("digits MLP (26,122 parameters), 8 nodes, 320 steps per node")
