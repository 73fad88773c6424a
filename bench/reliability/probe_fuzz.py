"""Fuzzing figures: executions and crashes per Rust decoder target, and the Python decoders' hypothesis run.

Full size reads the recorded results of the last ``make fuzz`` (rust/core/fuzz/results.json, committed with
the campaign that produced it: a campaign of every target to 10 M executions takes hours on two cores, too
long to rerun inside ``make reliability``) and runs tests/test_fuzz_decoders.py at 2,000 examples per test.
Quick mode runs a short bounded campaign of every target instead (``fuzz.sh run`` for 10 s each, recorded
under the fuzz crate's target/) and the Python fuzzing at its CI size.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.reliability.row import Row

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "rust" / "core" / "fuzz"
RECORDED = FUZZ / "results.json"
#: Executions each target must reach in a full campaign.
TARGET_EXECUTIONS = 10_000_000


def _rust_rows(results: dict, need: int, source: str) -> list[Row]:
    rows = []
    for t in results["targets"]:
        execs, crashes = int(t["executions"]), int(t["crashes"])
        observed = f"{execs / 1e6:.1f} M executions at {int(t['exec_per_s']):,} exec/s, {crashes} crash(es)" + (
            f", input {t['artifact']}" if crashes else ""
        )
        rows.append(
            Row(
                probe=f"cargo-fuzz `{t['target']}` ({source}, sanitizer {results.get('sanitizer', 'address')})",
                expected=(f">= {need / 1e6:.0f} M executions, " if need else "") + "0 crashes",
                observed=observed,
                passed=crashes == 0 and execs >= need,
            )
        )
    return rows


def rust_recorded() -> list[Row]:
    if not RECORDED.exists():
        return [
            Row(
                "cargo-fuzz: the last `make fuzz`",
                f">= {TARGET_EXECUTIONS // 10**6} M executions per target",
                f"no results at {RECORDED.relative_to(ROOT)}: run `make fuzz`",
                False,
            )
        ]
    results = json.loads(RECORDED.read_text())
    return _rust_rows(results, TARGET_EXECUTIONS, f"`make fuzz` of {results['date'][:10]}")


def rust_quick(seconds: int = 10) -> list[Row]:
    record = FUZZ / "target" / "quick_results.json"
    env = {**os.environ, "FUZZ_SECONDS": str(seconds), "FUZZ_RESULTS": str(record)}
    run = subprocess.run([str(FUZZ / "fuzz.sh"), "run"], env=env, capture_output=True, text=True)
    if not record.exists():
        return [Row("cargo-fuzz: a short campaign of every target", "runs", run.stderr[-300:], False)]
    return _rust_rows(json.loads(record.read_text()), 0, f"{seconds} s")


def python_rows(examples: int) -> list[Row]:
    env = {**os.environ, "GRADWIRE_FUZZ_EXAMPLES": str(examples)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_fuzz_decoders.py")],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    summary = next(
        (line for line in reversed(run.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
        run.stdout[-200:],
    )
    return [
        Row(
            probe=f"hypothesis: every Python decoder (frames, codec records, model records and specs, published "
            f"versions, sections), {examples} examples per test",
            expected="a WireError/FrameError for every bad input, no other exception, no allocation past 1 GiB",
            observed=summary.strip("= "),
            passed=run.returncode == 0,
        )
    ]


def probes(quick: bool) -> list[Row]:
    if quick:
        return rust_quick() + python_rows(120)
    return rust_recorded() + python_rows(2000)
