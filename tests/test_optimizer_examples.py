"""examples/demo_torchrun.py and examples/sparseloco_torchrun.py run under torchrun (a few steps each)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _torchrun(script: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / script),
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _ratio(out: str) -> float:
    return float(re.search(r"compression ratio vs fp32[^:]*: ([0-9.]+)x", out).group(1))


@pytest.mark.parametrize("extra", [(), ("--model-record",)], ids=["per-tensor", "model-record"])
def test_demo_example(extra):
    out = _torchrun("demo_torchrun.py", "--steps", "4", *extra)
    assert "replicas bit-identical: True" in out, out
    assert _ratio(out) >= 300, out
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0], out


@pytest.mark.parametrize("extra", [(), ("--model-record",)], ids=["per-tensor", "model-record"])
def test_sparseloco_example(extra):
    out = _torchrun("sparseloco_torchrun.py", "--steps", "8", "--sync-every", "4", "--nesterov", *extra)
    assert "replicas bit-identical: True" in out, out
    assert _ratio(out) >= 300, out
