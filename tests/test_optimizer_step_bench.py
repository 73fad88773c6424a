"""bench/optimizer_step.py end to end on the CPU, small: every row timed on the same parameters beside
torch's AdamW, and the bytes the optimizers' real exchange sent per step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "optimizer_step.py"


def test_the_optimizer_step_bench_times_every_row_beside_adamw_and_counts_the_bytes_sent(tmp_path):
    out = tmp_path / "optimizer_step.md"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--params", "1.1e6", "--repeat", "1", "--threads", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 1.0 M")]
    by_name = {r[1].strip(): r for r in rows}
    assert set(by_name) == {"torch AdamW (foreach)", "gradwire DeMo", "gradwire SparseLoCo, per step",
                            "gradwire SparseLoCo, the sync step (1 in 8)"}
    assert float(by_name["torch AdamW (foreach)"][3]) == 1.0
    fp32 = 4 * 1_050_624  # one 1024×1024 layer with its bias
    for name in ("gradwire DeMo", "gradwire SparseLoCo, per step"):
        ms, sent = float(by_name[name][2]), float(by_name[name][4].replace(",", ""))
        assert ms > 0 and 0 < sent < fp32 / 100, (name, sent)
