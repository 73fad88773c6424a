"""bench/convergence.py stays runnable: every row kind trains a few steps on the digits task through real
frames, with finite losses, measured ratios near the calibrated ones, and dense AdamW lowering the loss."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")

BENCH = Path(__file__).resolve().parent.parent / "bench" / "convergence.py"


@pytest.fixture(scope="module")
def cv():
    spec = importlib.util.spec_from_file_location("convergence_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def digits(cv):
    return cv.DigitsTask(cv.Scale(steps=8, batch=32, width=256))


def _sample(cv, task):
    torch.manual_seed(0)
    model = task.build()
    task.loss(model, task.batch(task.shards(4)[0], torch.Generator().manual_seed(0))).backward()
    return cv.Packer(cv._params(model)).pack(cv._grads(model))


@pytest.mark.parametrize("row", ["dense", "panthalia@100", "demo@300", "sparseloco@300", "diloco"])
def test_every_row_kind_trains_through_frames(cv, digits, row):
    settings = cv.Settings(full=False, nodes=4, H=4, evals=2)
    spec = cv.RowSpec.parse(row)
    calib = None
    if spec.target:
        calib = cv.calibrate(spec.kind, _sample(cv, digits), spec.target, settings.H if spec.kind == "sparseloco" else 1)
        assert 0.8 < calib[1] / spec.target < 1.25
    hp, lr, extra = cv.grid("digits", spec, digits.scale, full=False)[1]
    torch.set_num_threads(1)
    r = cv.run_one(digits, spec, lr, extra, 0, 8, settings, calib)
    assert math.isfinite(r.train_loss) and math.isfinite(r.held_out)
    assert all(math.isfinite(h) for _, _, h in r.curve)
    ratio = r.fp32_bytes / r.up_bytes_per_step
    if spec.kind == "diloco":  # fp32 frames once every H steps
        assert 0.8 * settings.H < ratio <= settings.H
    elif spec.kind == "dense":
        assert ratio == 1.0
        assert r.held_out < r.curve[0][2] - 0.05, "dense AdamW should lower the held-out loss in 8 steps"
    else:
        # Measured in training (momenta and pseudo-gradients, Rice-coded positions) near the calibration.
        assert 0.6 * spec.target < ratio < 1.8 * spec.target, (row, ratio)
        assert r.down_bytes_per_step > 0


def test_packer_round_trips(cv, digits):
    model = digits.build()
    named = {n: p.detach() for n, p in model.named_parameters()}
    packer = cv.Packer(named)
    packed = packer.pack(named)
    assert len(packed) < len(named)
    back = packer.unpack(packed)
    assert all(torch.equal(back[n], named[n]) for n in named)


def test_wire_size_functions_count_the_selection(cv, digits):
    sel = {"tensors": [{"name": "a", "chunks": 3, "kept": 30, "chunk_numel": 4096}], "kept": 30, "chunks": 3}
    assert cv.demo_wire(sel) == 30 * 12
    assert cv.panthalia_wire(sel) == 30 * 9 + 3 * 8
    assert cv.templar_wire(sel) == 45 + 30 + 256 * 4 + 8
    assert cv.psyche_wire(sel) == 60 + 4
