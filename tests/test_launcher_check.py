"""No silent single-rank training: under a launcher's environment of several ranks (WORLD_SIZE=2, as torchrun
sets it) with no process group, every gradwire optimizer refuses at its first step (built before the group,
as the HF Trainer recipe builds it, it still runs once the group exists), and replicas_agree, average_buffers
and LowPrecisionDecentralized refuse, each naming torch.distributed.init_process_group; a group of one (no
launcher, or torchrun with one rank) still runs; and the README's quick start, the init call left out, fails
on a launched rank instead of training alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch as gt
from gradwire.torch.launcher_check import launcher_ranks

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


#: Every optimizer that exchanges across ranks, built as a script builds it.
OPTIMIZERS = {
    "DeMo": lambda m: gt.DeMo(m.parameters(), lr=1e-3),
    "SparseLoCo": lambda m: gt.SparseLoCo(m.parameters(), torch.optim.AdamW(m.parameters()), sync_every=1),
    "MuLoCo": lambda m: gt.MuLoCo(m, lr=1e-2, sync_every=1),
    "AlgorithmOptimizer": lambda m: gt.AlgorithmOptimizer(m, "demo"),
}
#: What needs the group where it is called.
CALLS = {
    "LowPrecisionDecentralized": lambda m: gt.LowPrecisionDecentralized(m, lr=0.1),
    "replicas_agree": lambda m: gt.replicas_agree(m),
    "average_buffers": lambda m: gt.average_buffers(m),
}


def _step(opt, model: nn.Module) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
    opt.step()


@pytest.fixture
def torchrun_rank(monkeypatch):
    """Rank 1 of 2 as torchrun describes it, and no process group."""
    assert not dist.is_initialized()
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


def _says_what_to_add(message: str, name: str) -> None:
    assert message.startswith(f"{name}: ") and "WORLD_SIZE=2, RANK=1, LOCAL_RANK=1" in message
    assert "torch.distributed.init_process_group()" in message and "every rank would train alone" in message


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_under_a_launcher_of_two_without_a_process_group_the_first_step_refuses(name, torchrun_rank):
    model = _model()
    opt = OPTIMIZERS[name](model)  # built before any group, as the HF Trainer recipe builds it
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gt.NoProcessGroupError) as err:
        _step(opt, model)
    _says_what_to_add(str(err.value), name)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was trained
    with pytest.raises(gt.NoProcessGroupError):  # and not on a second try either
        _step(opt, model)


@pytest.mark.parametrize("name", list(CALLS))
def test_under_a_launcher_of_two_without_a_process_group_the_checks_refuse(name, torchrun_rank):
    with pytest.raises(gt.NoProcessGroupError) as err:
        CALLS[name](_model())
    _says_what_to_add(str(err.value), name)


def test_an_optimizer_built_before_the_group_runs_once_the_group_exists(torchrun_rank, tmp_path):
    model = _model()
    opt = OPTIMIZERS["SparseLoCo"](model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        _step(opt, model)
        assert opt.syncs == 1 and gt.replicas_agree(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "env, several",
    [
        ({}, {}),
        ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, {}),  # torchrun --nproc-per-node 1
        ({"WORLD_SIZE": "2"}, {"WORLD_SIZE": 2}),
        ({"LOCAL_RANK": "1"}, {"LOCAL_RANK": 1}),  # a launcher that sets only the local rank
        ({"RANK": "3", "WORLD_SIZE": "4"}, {"WORLD_SIZE": 4, "RANK": 3}),
        ({"WORLD_SIZE": "two"}, {}),  # not a launcher's value
    ],
)
def test_what_says_several_ranks(env, several):
    assert launcher_ranks(env) == several


def test_a_group_of_one_still_trains_and_agrees_with_itself(monkeypatch):
    for k in LAUNCHER:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    model = _model()
    opt = OPTIMIZERS["SparseLoCo"](model)
    _step(opt, model)
    assert opt.syncs == 1 and gt.replicas_agree(model)


def test_a_process_group_given_passes_under_the_launcher(torchrun_rank, tmp_path):
    # The launcher's variables stay; the script initialized its group (here a one-rank gloo group by file).
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = _model()
        opt = OPTIMIZERS["DeMo"](model)
        _step(opt, model)
        assert opt.steps == 1 and gt.replicas_agree(model)
    finally:
        dist.destroy_process_group()


def _quick_start_without_init(tmp_path: Path) -> Path:
    """examples/quickstart_torchrun.py as a reader of the README's short form once wrote it: no init_process_group
    line, and the rank read from the launcher's environment (torch.distributed's own calls would already fail)."""
    source = (ROOT / "examples" / "quickstart_torchrun.py").read_text()
    call = re.compile(r"^dist\.init_process_group\(.*\n", re.M)
    assert len(call.findall(source)) == 1 and source.count("dist.get_rank()") == 1
    source = call.sub("", source).replace("dist.get_rank()", "int(__import__('os').environ['RANK'])")
    script = tmp_path / "quickstart_without_init.py"
    script.write_text(source)
    return script


def test_the_quick_start_without_init_process_group_fails_on_a_launched_rank(tmp_path):
    """The script a launcher starts as rank 1 of 2 (the environment torchrun gives each rank) stops at the
    optimizer's first step with the line to add, instead of training alone and reporting bytes it never sent."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    env.update(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT="29500", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(_quick_start_without_init(tmp_path))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout
    assert "NoProcessGroupError: SparseLoCo: a launcher started this process as one of several ranks" in done.stderr
    assert "Add `torch.distributed.init_process_group()`" in done.stderr
    assert "bytes" not in done.stdout  # it never reached a step
