"""bench/train_step.py: a whole training step (forward, backward, optimizer) of a GPT-2-shaped model with
AdamW, DeMo and SparseLoCo, run on the CPU at a tiny size; and the default shape is GPT-2 small's 124 M."""

from __future__ import annotations

import subprocess
import sys

from bench_modules import BENCH_DIR, load_bench

BENCH = BENCH_DIR / "train_step.py"


_bench = load_bench


def test_the_train_step_bench_times_every_optimizer_beside_adamw_and_prints_the_target():
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--batch",
            "2",
            "--seq",
            "32",
            "--layers",
            "2",
            "--width",
            "64",
            "--heads",
            "2",
            "--vocab",
            "256",
            "--repeat",
            "1",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in lines if line.startswith("| "))}
    names = ("gradwire DeMo", "gradwire DeMo, overlapped", "gradwire SparseLoCo, mean step")
    assert {"torch AdamW", *names} <= set(rows)
    assert float(rows["torch AdamW"][2]) == 1.0
    for name in names:
        assert float(rows[name][1]) > 0
        loss = float(rows[name][4])
        assert 0 < loss < 2 * 5.545  # a language model's cross-entropy near ln(256) at the start, finite
    targets = [line for line in lines if line.startswith("target training step")]
    assert len(targets) == 3 and all(t.endswith(("— met", "— missed", "— met (stretch met)")) for t in targets)
    assert "batch 2 × 32 tokens, autocast bf16" in run.stdout
    assert [line for line in lines if line.startswith("overlap: DeMo adds") and line.endswith("% of it hidden")]


def test_the_default_model_has_gpt2_smalls_124m_parameters():
    GPT2 = _bench("train_step").GPT2
    model = GPT2(vocab=50257, positions=1024, layers=12, width=768, heads=12)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small, output tied to the embedding


def test_the_gpu_script_parses_and_runs_each_part_under_its_own_timeout():
    script = BENCH_DIR / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for part in (
        "part install",
        "part tests",
        "part optimizer_step_10M",
        "part optimizer_step_100M",
        "part dct_codec",
        "part train_step",
    ):
        assert part in text, part
    assert "--carry" not in text and 'carry=["dist", ".gpu-wheels"]' in text
