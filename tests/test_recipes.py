"""The recipes of docs/RECIPES.md run: HF Trainer, Accelerate and Lightning under torchrun (2 ranks, a few
steps each, skipped where the package is not installed), and a two-machine torchrun job (two torchrun
launchers, one per "machine", meeting at a c10d rendezvous on loopback)."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _needs(*packages: str):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install {' '.join(missing)})")


def _env() -> dict:
    # One thread per rank; gloo on loopback whatever the host name resolves to.
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
    )


def _torchrun(script: str, *args: str) -> str:
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
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def _ratio(out: str) -> float:
    return float(re.search(r"compression ratio vs fp32[^:]*: ([0-9.]+)x", out).group(1))


@_needs("transformers", "accelerate")
def test_hf_trainer_with_sparseloco_its_scheduler_and_ddp_wrapping():
    # The Trainer builds a linear lr schedule on SparseLoCo (KeyError 'lr' before its groups were the inner
    # AdamW's) and wraps GPT-2 in DDP, whose all-reduce the callback turns off.
    out = _torchrun("hf_trainer.py", "--optimizer", "sparseloco", "--steps", "4", "--sync-every", "2")
    assert "replicas bit-identical: True" in out, out
    assert "final lr: 0," in out, out  # the linear schedule ran down to 0 over the 4 steps
    assert _ratio(out) > 100, out


def _hash(out: str) -> str:
    return re.search(r"weights hash: (\S+)", out).group(1)


@_needs("transformers", "accelerate")
def test_hf_trainer_resumes_every_rank_from_the_file_rank_zero_saved(tmp_path):
    # The Trainer saves rank 0's optimizer file only and loads it on every rank; FullOptimizerState puts
    # every rank's share in it, so rank 1 resumes (it was refused: "this checkpoint is rank 0's") and the
    # resumed run ends on the uninterrupted run's weights, bit for bit.
    run = ["--optimizer", "sparseloco", "--steps", "4", "--sync-every", "2"]
    whole = _torchrun("hf_trainer.py", *run, "--out", str(tmp_path / "whole"))
    _torchrun("hf_trainer.py", *run, "--save-every", "2", "--out", str(tmp_path / "saved"))
    resumed = _torchrun(
        "hf_trainer.py", *run, "--out", str(tmp_path / "saved"), "--resume", str(tmp_path / "saved" / "checkpoint-2")
    )
    assert "replicas bit-identical: True" in resumed, resumed
    assert _hash(resumed) == _hash(whole), (resumed, whole)


@_needs("accelerate")
@pytest.mark.parametrize("mode", ["hook", "demo"])
def test_accelerate_recipe(mode):
    out = _torchrun("accelerate_recipe.py", "--mode", mode, "--epochs", "1")
    assert "replicas bit-identical: True" in out, out
    first, last = map(float, re.search(r"loss first ([0-9.]+) last ([0-9.]+)", out).groups())
    assert last < first, out
    assert _ratio(out) > 50, out  # the hook's or DeMo's frames were sent, not DDP's dense all-reduce


@_needs("lightning")
@pytest.mark.parametrize("mode", ["hook", "sparseloco"])
def test_lightning_recipe(mode):
    out = _torchrun("lightning_recipe.py", "--mode", mode, "--steps", "8")
    assert "replicas bit-identical: True" in out, out
    assert _ratio(out) > 50, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machine_torchrun_on_loopback():
    port = _free_port()
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "recipes-test",
                str(EXAMPLES / "sparseloco_torchrun.py"),
                "--steps",
                "4",
                "--sync-every",
                "2",
                "--width",
                "256",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for _machine in (0, 1)
    ]
    outs = []
    for p in launchers:
        out, err = p.communicate(timeout=300)
        outs.append((p.returncode, out, err))
    assert all(rc == 0 for rc, _, _ in outs), "\n".join(f"exit {rc}\n{o[-2000:]}\n{e[-4000:]}" for rc, o, e in outs)
    stdout = "".join(o for _, o, _ in outs)  # global rank 0 may be on either "machine"
    assert "replicas bit-identical: True" in stdout, outs
