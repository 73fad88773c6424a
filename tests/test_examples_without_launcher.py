"""An example started without torchrun (and without --spawn) stops with one line saying how to run it and
exit status 2, not a page of torch's rendezvous traceback ending in "RANK expected"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradwire.torch as gt

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


@pytest.mark.parametrize("script", ["sparseloco_torchrun.py", "demo_torchrun.py", "ddp_digits.py"])
def test_example_without_a_launcher_is_a_usage_error(script):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun --nproc-per-node 2" in lines[0] and "RANK" in lines[0]
    if script == "ddp_digits.py":
        assert "--spawn" in lines[0]


def test_init_from_env_names_what_a_launcher_sets(monkeypatch):
    for var in LAUNCHER:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(gt.NoLauncherError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        gt.init_from_env("gloo")
