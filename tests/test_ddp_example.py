"""examples/ddp_digits.py runs as documented: with --spawn, and under torchrun (a few steps each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_digits.py"


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, COLUMNS="200")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _rows(out: str) -> list[list[str]]:
    """The per-rank rows of the printed table: rank, steps/s, bytes, ratio, loss, accuracy."""
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 6 and cells[0].isdigit():
            rows.append(cells)
    return rows


def test_spawn_dct_hook():
    out = _run([sys.executable, str(EXAMPLE), "--spawn", "2", "--hook", "dct", "--steps", "8"])
    rows = _rows(out)
    assert [r[0] for r in rows] == ["0", "1"], out
    assert float(rows[0][3]) > 50  # the DCT hook's frames are far smaller than fp32 gradients
    assert "parameters: 0\n" in out  # DDP hooks leave every rank with the same parameters


def test_torchrun_decentralized():
    out = _run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(EXAMPLE), "--algorithm", "decentralized", "--steps", "8",
        ]
    )  # fmt: skip
    rows = _rows(out)
    assert [r[0] for r in rows] == ["0", "1"], out
    assert 3.5 < float(rows[0][3]) < 4.1  # MinMax uint8: about one byte per four
