"""The README's two quick starts run as written, whole (examples/quickstart_torchrun.py on two torchrun ranks,
examples/quickstart_server.py against a real `gradwire serve` whose admin token it reads from the file the
server wrote), and print what the tutorial shows: every figure, where this is the torch the tutorial's outputs
were made with (the marker above each names it; `make docs-tables` rewrites them)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
docs_tables = sys.modules["docs_tables"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_tables)


def _shown(name: str) -> tuple[dict[str, str], str]:
    return docs_tables.blocks((ROOT / "docs" / "tutorial.md").read_text())[name]


def _same_figures(name: str, printed: str) -> None:
    """The tutorial's output ``name`` is ``printed``: exactly under the torch and on the kind of processor it was
    made with (the marker's ``torch=`` and ``cpu=``); elsewhere line for line with the numbers left out (kernels
    round differently between torch versions and processors)."""
    attrs, shown = _shown(name)
    if docs_tables.made_here(attrs, torch.__version__):
        assert printed == shown, f"docs/tutorial.md's {name} output is stale: run `make docs-tables`"
    else:
        number = re.compile(r"\d[\d,.]*")
        assert number.sub("#", printed) == number.sub("#", shown)


def test_the_torchrun_quick_start_runs_on_two_ranks_and_prints_the_tutorials_figures():
    printed = docs_tables.run_torchrun()
    assert "2 ranks, 48 local steps, 24 syncs" in printed and "replicas bit-identical: True" in printed
    ratio = int(re.search(r"\((\d+)x fewer than fp32\)", printed).group(1))
    assert 250 < ratio < 400, printed  # the README's "about 300×"
    _same_figures("torchrun", printed)


def test_the_server_quick_start_reads_the_generated_token_and_prints_the_tutorials_figures(tmp_path):
    printed = docs_tables.run_server_example(tmp_path)
    token = (tmp_path / "gradwire-data" / "admin_token").read_text().strip()
    assert token, "the server generated no admin token"  # and the example used it: GRADWIRE_ADMIN_TOKEN was unset
    assert "weights hash the server's: True" in printed
    _same_figures("server", printed)


@pytest.mark.parametrize("name", ["torchrun", "server", "demo"])
def test_the_tutorial_holds_each_generated_output(name):
    attrs, shown = _shown(name)
    assert shown.strip() and {"torch", "date"} <= set(attrs), f"run `make docs-tables` ({name})"
