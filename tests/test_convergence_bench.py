"""bench/convergence.py stays runnable: every row kind trains a few steps on the digits task through real
frames, with finite losses, measured ratios near the calibrated ones, and dense AdamW lowering the loss."""

from __future__ import annotations

import importlib.util
import json
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
        calib = cv.calibrate(
            spec.kind, _sample(cv, digits), spec.target, settings.H if spec.kind == "sparseloco" else 1
        )
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


def test_row_keys_parse_the_downlink(cv):
    assert cv.RowSpec.parse("sparseloco@300").key == "sparseloco@300"  # the old rows (and their caches) stand
    r = cv.RowSpec.parse("sparseloco@300/agg:b1,d300,ef0.5,srv")
    assert r.key == "sparseloco@300/agg:b1,d300,ef0.5,srv"
    assert r.down_opts == {"b": 1, "d": 300, "ef": 0.5, "srv": True}
    assert cv.RowSpec.parse("demo@300/agg").down_opts == {"ef": 1.0, "srv": False}
    assert cv.RowSpec.parse("demo@300/frames").down_opts == {}
    for bad in (
        "dense/agg",
        "demo@300/agg:srv",
        "sparseloco@300/agg:k4,d300",
        "sparseloco@300/agg:ef2",
        "sparseloco@300/agg:x1",
        "sparseloco@300/mean",
    ):
        with pytest.raises(ValueError):
            cv.RowSpec.parse(bad)


def _trace(opt_cls, grads, **kw):
    p = torch.nn.Parameter(torch.zeros(grads.shape[1], dtype=torch.float64))
    opt = opt_cls([p], **kw)
    out = [p.detach().clone()]
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return torch.stack(out)


def test_local_adamw_is_adamw_at_divisor_one_and_steps_further_only_where_noise_dominates(cv):
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(40, 30, generator=gen, dtype=torch.float64) + 0.3
    torch.testing.assert_close(
        _trace(cv.LocalAdamW, grads, lr=0.01, weight_decay=0.1),
        _trace(torch.optim.AdamW, grads, lr=0.01, weight_decay=0.1),
        rtol=1e-9,
        atol=1e-12,
    )
    steps, lr = 300, 0.01
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(steps // 2).reshape(steps, 1)
    grads = torch.cat([torch.ones(steps, 1, dtype=torch.float64), 0.05 + sign], dim=1)  # no noise | noise 20× signal
    plain = _trace(torch.optim.AdamW, grads, lr=lr, weight_decay=0.0)
    corrected = _trace(cv.LocalAdamW, grads, lr=lr, noise_divisor=16.0)
    torch.testing.assert_close(corrected[:, 0], plain[:, 0], rtol=1e-9, atol=1e-12)
    assert plain[-1, 1] < 0 and corrected[-1, 1] < 2.5 * plain[-1, 1]  # about √16× as far along the signal
    assert (corrected.diff(dim=0).abs() <= lr * (1 + 1e-9)).all()
    with pytest.raises(ValueError, match="noise_divisor"):
        cv.LocalAdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1, noise_divisor=0.5)


def test_local_rows_take_the_inner_local_adamw(cv, digits):
    """``+nD`` after a local kind trains its nodes with the bench's LocalAdamW(noise_divisor=D): its own cache key and
    label, and a different trajectory from the same row with torch's AdamW."""
    torch.set_num_threads(1)
    r = cv.RowSpec.parse("sparseloco+n4@300/agg:b4,d300")
    assert (r.kind, r.noise, r.key) == ("sparseloco", 4.0, "sparseloco+n4@300/agg:b4,d300")
    assert "LocalAdamW n4" in r.label and cv.RowSpec.parse("diloco").noise == 1.0
    for bad in ("dense+n4", "demo+n4@300", "diloco+n1", "diloco+x4", "diloco+n"):
        with pytest.raises(ValueError):
            cv.RowSpec.parse(bad)
    settings = cv.Settings(full=False, nodes=2, H=2, evals=2)
    held = {}
    for row in ("diloco", "diloco+n4"):
        spec = cv.RowSpec.parse(row)
        hp, lr, extra = cv.grid("digits", spec, digits.scale, full=False)[1]
        res = cv.run_one(digits, spec, lr, extra, 0, 8, settings, None)
        assert math.isfinite(res.held_out) and res.held_out < res.curve[0][2]
        held[row] = res.held_out
    assert held["diloco"] != held["diloco+n4"]


@pytest.mark.parametrize(
    "row", ["demo@300/frames", "demo@300/agg:ef0", "sparseloco@300/agg:d300", "sparseloco@300/agg:b1,k64,ef0.9,srv"]
)
def test_published_downlink_rows_train(cv, digits, row):
    """Verbatim versions cost every node's frame; a re-encoded one a single server frame, whatever n."""
    settings = cv.Settings(full=False, nodes=4, H=4, evals=2)
    spec = cv.RowSpec.parse(row)
    calib = cv.calibrate_row(spec, _sample(cv, digits), settings)
    hp, lr, extra = cv.grid("digits", spec, digits.scale, full=False)[0]
    torch.set_num_threads(1)
    r = cv.run_one(digits, spec, lr, extra, 0, 8, settings, calib)
    assert math.isfinite(r.held_out) and r.held_out < 2 * r.curve[0][2]
    up = r.fp32_bytes / r.up_bytes_per_step
    down = r.fp32_bytes / r.down_bytes_per_step
    if spec.down == "frames":
        assert 0.9 * up / 4 < down < up / 4  # n frames and the version's header
        assert r.down_k is None
    else:
        assert (r.down_k, r.down_bits) == calib[2:]
        if "d300" in row:
            assert 0.8 * 300 < down < 1.25 * 300
        if "k64" in row:
            assert (r.down_k, r.down_bits) == (64, 1)
        assert down > 0.5 * up  # one frame, not n


def test_signloco_rows_send_one_bit_per_parameter_both_ways_whatever_the_node_count(cv, digits):
    """1 bit per parameter per sync: the ratio is about 32·H, and the re-encoded downlink stays one frame
    (the same bytes at 2 and 6 nodes) where publishing every frame costs n of them."""
    torch.set_num_threads(1)
    assert cv.RowSpec.parse("signloco/agg").down_opts == {"ef": 1.0, "srv": False}
    for bad in ("signloco@300", "signloco/agg:b2"):
        with pytest.raises(ValueError):
            cv.RowSpec.parse(bad)
    H = 4
    down = {}
    for n in (2, 6):
        settings = cv.Settings(full=False, nodes=n, H=H, evals=2)
        for row in ("signloco/agg", "signloco/frames"):
            spec = cv.RowSpec.parse(row)
            hp, lr, extra = cv.grid("digits", spec, digits.scale, full=False)[1]
            r = cv.run_one(digits, spec, lr, extra, 0, 8, settings, None)
            assert math.isfinite(r.held_out) and r.held_out < r.curve[0][2]
            up = r.fp32_bytes / r.up_bytes_per_step
            assert 0.7 * 32 * H < up <= 32 * H, (row, up)  # less the per-column scales and the headers
            down[(n, row)] = r.down_bytes_per_step
    assert down[(2, "signloco/agg")] == down[(6, "signloco/agg")]
    assert down[(6, "signloco/frames")] > 5 * down[(6, "signloco/agg")]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_muon_rows_train_their_nodes_and_dense_with_muon_on_the_hidden_matrices(cv, digits):
    """``+muon`` after dense or a local kind steps Muon on the weight matrices and AdamW on the rest (dense Muon,
    MuLoCo): its own cache key and label, a trajectory of its own, and the same bits as torch's two optimizers
    stepped side by side."""
    torch.set_num_threads(1)
    r = cv.RowSpec.parse("signloco+muon/agg")
    assert (r.kind, r.muon, r.key) == ("signloco", True, "signloco+muon/agg") and "Muon inner" in r.label
    assert cv.RowSpec.parse("dense+muon").label == "dense Muon" and not cv.RowSpec.parse("dense").muon
    for bad in ("demo+muon@300", "panthalia+muon@300", "dense+mu"):
        with pytest.raises(ValueError):
            cv.RowSpec.parse(bad)
    model = digits.build()
    (opt,) = cv.muon_and_adamw(model, 0.01)
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    assert {id(p) for g in opt.muon.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.dim() == 2 and all(p is not q for q in head.parameters())
    }
    settings = cv.Settings(full=False, nodes=2, H=2, evals=2)
    held = {}
    for row in ("dense", "dense+muon", "signloco/agg", "signloco+muon/agg"):
        spec = cv.RowSpec.parse(row)
        hp, lr, extra = cv.grid("digits", spec, digits.scale, full=False)[1]
        res = cv.run_one(digits, spec, lr, extra, 0, 8, settings, None)
        assert math.isfinite(res.held_out) and res.held_out < res.curve[0][2]
        held[row] = res.held_out
    assert held["dense"] != held["dense+muon"] and held["signloco/agg"] != held["signloco+muon/agg"]


def test_local_step_screen_is_the_benchs_loop_and_sends_values_only(cv, tmp_path):
    """bench/local_step_screen.py: with every coordinate at 32 bits it is the bench's uncompressed DiLoCo row
    (same held-out loss on the same batches); with a shared random support at 1 bit its bytes per step match
    the ratio asked for, each way, with no positions sent."""
    spec = importlib.util.spec_from_file_location("local_step_screen", BENCH.parent / "local_step_screen.py")
    screen = importlib.util.module_from_spec(spec)
    added = sys.modules.setdefault("convergence", cv) is cv  # the screen imports the bench as `convergence`
    try:
        spec.loader.exec_module(screen)
    finally:
        if added:
            sys.modules.pop("convergence")
    torch.set_num_threads(1)
    out = tmp_path / "screen.jsonl"
    common = ["--task", "digits", "--nodes", "2", "--H", "2", "--steps", "8", "--lr", "0.003", "--out", str(out)]
    screen.main(common + ["--support", "all", "--bits", "32"])
    screen.main(common + ["--support", "random", "--bits", "1"])
    screen.main(common + ["--support", "dense"])
    exact, sparse, dense = [json.loads(line) for line in out.read_text().splitlines()]
    task = cv.DigitsTask(cv.SCALES[False]["digits"])
    settings = cv.Settings(full=False, nodes=2, H=2, evals=2)
    bench = cv.run_one(task, cv.RowSpec.parse("diloco"), 0.003, {"outer": "plain"}, 0, 8, settings, None)
    assert exact["held_out"] == pytest.approx(bench.held_out, rel=1e-5)
    bench_dense = cv.run_one(task, cv.RowSpec.parse("dense"), 0.003, {}, 0, 8, settings, None)
    assert dense["held_out"] == pytest.approx(bench_dense.held_out, rel=1e-5)
    assert math.isfinite(sparse["held_out"]) and sparse["held_out"] < bench.curve[0][2]
    assert 0 < sparse["fraction"] < 0.5 and 250 < sparse["ratio_measured"] <= 310


def test_local_step_screen_counts_what_block_and_topk_supports_send(cv, tmp_path):
    """The screen's data-chosen supports: a block support takes whole blocks with the largest scores, a
    per-node top-k's fraction spends the budget on values and entropy-coded positions, and both runs send
    the ratio asked for, each way, the reports and positions counted."""
    spec = importlib.util.spec_from_file_location("local_step_screen", BENCH.parent / "local_step_screen.py")
    screen = importlib.util.module_from_spec(spec)
    added = sys.modules.setdefault("convergence", cv) is cv
    try:
        spec.loader.exec_module(screen)
    finally:
        if added:
            sys.modules.pop("convergence")
    scores = torch.tensor([0.0, 5.0, 1.0, 7.0, 2.0])
    idx = screen.block_support(scores, 0.4, 4, 19)  # 2 of 5 blocks; the last block holds 3 coordinates
    assert idx.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert screen.block_support(torch.tensor([0.0, 9.0, 0.0, 0.0, 8.0]), 0.4, 4, 19).tolist() == [
        4,
        5,
        6,
        7,
        16,
        17,
        18,
    ]
    p = screen.topk_fraction(1.0, 1)
    assert p + screen.entropy_bits(p) == pytest.approx(1.0, abs=1e-9) and 0.2 < p < 0.3
    torch.set_num_threads(1)
    out = tmp_path / "screen.jsonl"
    common = ["--task", "digits", "--nodes", "2", "--H", "4", "--steps", "8", "--lr", "0.003", "--out", str(out)]
    screen.main(common + ["--support", "blocks", "--block", "16"])
    screen.main(common + ["--support", "topk"])
    for run in (json.loads(line) for line in out.read_text().splitlines()):
        assert math.isfinite(run["held_out"]) and 250 < run["ratio_measured"] <= 310, run["support"]


def test_a_per_node_batch_setting_reaches_the_task_and_the_cache_key(cv):
    """``--batch`` (bench/convergence_nodes.py): the task draws that many samples per node, and a run at
    another batch is another cache entry, never the default batch's result."""
    rows = [cv.RowSpec.parse("dense")]
    base = cv.Settings(full=False, nodes=2, H=4, steps={"digits": 4}, dense_mults=(1.0,))
    wide = cv.Settings(full=False, nodes=2, H=4, steps={"digits": 4}, batch={"digits": 8}, dense_mults=(1.0,))
    (plan,), _ = cv.make_plans(["digits"], rows, [0], base)
    (wide_plan,), _ = cv.make_plans(["digits"], rows, [0], wide)
    assert plan.scale.batch == cv.SCALES[False]["digits"].batch != 8
    assert wide_plan.scale.batch == 8 and wide_plan.task.scale.batch == 8
    x, y = wide_plan.task.batch(wide_plan.task.shards(2)[0], torch.Generator().manual_seed(0))
    assert len(y) == 8
    assert wide_plan.key != plan.key


@pytest.mark.parametrize("support", ["powersgd", "subspace"])
def test_local_step_screen_low_rank_sync_loses_nothing_and_sends_the_same_whatever_the_node_count(cv, support):
    """The screen's low-rank supports: at full rank and 32 bits a sync applies the nodes' exact mean and
    leaves no error on average; at rank 1 and 8 bits what the nodes' and the server's error buffers lose is exactly what
    is applied (error feedback drops nothing), and a node sends the same bits at 2 nodes as at 6."""
    spec = importlib.util.spec_from_file_location("local_step_screen", BENCH.parent / "local_step_screen.py")
    screen = importlib.util.module_from_spec(spec)
    added = sys.modules.setdefault("convergence", cv) is cv
    try:
        spec.loader.exec_module(screen)
    finally:
        if added:
            sys.modules.pop("convergence")
    two_phase = support == "powersgd"
    g = torch.Generator().manual_seed(3)
    errors = [torch.randn(12, 5, generator=g) for _ in range(3)]
    mean = torch.stack(errors).mean(0)
    full = screen.LowRankSync((12, 5), rank=5, bits=32, two_phase=two_phase, seed=0)
    step, _ = full.sync(errors)
    # At full rank one sync applies the exact mean (subspace: its first side projects on all of R⁵); each
    # node keeps what lies outside the mean's column space, and those residuals average to zero.
    assert torch.allclose(step, mean, atol=1e-5)
    assert torch.stack(errors).mean(0).abs().max() < 1e-5 and full.server.abs().max() < 1e-5
    sent = {}
    for n in (2, 6):
        sync = screen.LowRankSync((12, 5), rank=1, bits=8, two_phase=two_phase, seed=0)
        errs = [torch.randn(12, 5, generator=g) for _ in range(n)]
        for _ in range(4):
            before = torch.stack(errs).mean(0) + sync.server
            step, bits = sync.sync(errs)
            after = torch.stack(errs).mean(0) + sync.server
            assert torch.allclose(before - after, step, atol=1e-5)
            assert torch.linalg.matrix_rank(step) == 1
            sent.setdefault(n, []).append(bits)
    assert sent[2] == sent[6] and max(sent[2]) <= (12 + 5) * 8


def test_a_parallel_sweep_reports_steps_while_its_runs_train(tmp_path):
    # With --jobs 2 the workers report their steps as they take them: a log shows a count that no run's end
    # alone produces (every run here is 8 steps), so an hour-long run is not an hour of silence.
    import re
    import subprocess

    cache = tmp_path / "runs.json"
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--tasks",
            "digits",
            "--steps",
            "8",
            "--rows",
            "dense",
            "--seeds",
            "0",
            "--dense-mults",
            "1",
            "3",
            "--jobs",
            "2",
            "--cache",
            str(cache),
            "--out",
            str(tmp_path / "report.md"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    counts = [int(n) for n in re.findall(r"(\d+)/16 step", out.stderr)]
    assert counts and counts[-1] == 16, out.stderr[-2000:]
    assert any(n % 8 for n in counts), counts
    runs = json.loads(cache.read_text())
    assert sorted(r["lr"] for r in runs.values()) == pytest.approx([0.003, 0.009])


def _load_convergence_nodes(cv):
    spec = importlib.util.spec_from_file_location("convergence_nodes", BENCH.parent / "convergence_nodes.py")
    mod = importlib.util.module_from_spec(spec)
    added = sys.modules.setdefault("convergence", cv) is cv  # it imports the bench as `convergence`
    sys.modules[spec.name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        if added:
            sys.modules.pop("convergence")
    return mod


def test_a_node_count_report_shows_carried_cells_until_a_run_of_their_row_replaces_them(cv, tmp_path):
    """bench/convergence_nodes.py's ledger: a cell an earlier report printed shows, marked †, where the cache
    has no run of its row at its node count; once the row is trained the cache's run is what the report shows,
    and the gaps of the rows still carried are taken against it."""
    cn = _load_convergence_nodes(cv)
    cache, ledger, out = tmp_path / "runs.json", tmp_path / "ledger.json", tmp_path / "report.md"

    def cell(row, nodes, held):
        return {
            "task": "digits",
            "nodes": nodes,
            "row": row,
            "label": cv.RowSpec.parse(row).label,
            "best_hp": "lr=0.003" + (" plain" if row != "dense" else ""),
            "tried": ["lr=0.003"],
            "held_out": {"0": held},
            "up_bytes": 1000.0,
            "down_bytes": 1000.0,
            "fp32": 300_000,
            "batch": 32,
            "steps": 4,
        }

    ledger.write_text(
        json.dumps({"cells": [cell("dense", 2, 2.0), cell("sparseloco@300/frames", 2, 2.1), cell("dense", 4, 9.0)]})
    )
    common = [
        "--tasks",
        "digits",
        "--nodes",
        "2",
        "--steps",
        "4",
        "--rows",
        "dense",
        "sparseloco@300/frames",
        "--seeds",
        "0",
        "--cache",
        str(cache),
        "--ledger",
        str(ledger),
        "--out",
        str(out),
    ]
    torch.set_num_threads(1)
    cn.main(common + ["--report-only"])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 2 and all("†" in r for r in rows), rows
    assert "| 2.0000 | — |" in rows[0] and "| 2.1000 | +5.0 % |" in rows[1]
    assert "Rows marked † are carried" in out.read_text()

    cn.main(common[:7] + ["dense", "--dense-mults", "1"] + common[9:] + ["--jobs", "1"])  # train dense only
    (trained,) = json.loads(cache.read_text()).values()
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert "†" not in rows[0] and f"| {trained['held_out']:.4f} | — |" in rows[0]
    cn.main(common + ["--report-only"])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert "†" not in rows[0] and "†" in rows[1]
    gap = 100.0 * (2.1 / trained["held_out"] - 1.0)
    assert f"| {gap:+.1f} % |" in rows[1]
    # The carried cells were trained at a constant lr: a report of another schedule shows none of them.
    cn.main(common + ["--report-only", "--schedule", "cosine"])
    assert "†" not in out.read_text()


@pytest.mark.parametrize("carried_held, carried_shown", [(1e-4, True), (99.0, False)])
def test_a_run_at_an_lr_a_carried_row_did_not_try_joins_its_grid(cv, tmp_path, carried_held, carried_shown):
    """A run of a carried row at a new lr widens the row's grid instead of replacing its carried seeds: the
    report shows whichever best is lower on seed 0 and lists the carried lr and the new one as tried."""
    cn = _load_convergence_nodes(cv)
    cache, ledger, out = tmp_path / "runs.json", tmp_path / "ledger.json", tmp_path / "report.md"
    ledger.write_text(
        json.dumps(
            {
                "cells": [
                    {
                        "task": "digits",
                        "nodes": 2,
                        "row": "dense",
                        "label": "dense AdamW",
                        "best_hp": "lr=0.003",
                        "tried": ["lr=0.003"],
                        "held_out": {"0": carried_held, "1": carried_held},
                        "up_bytes": 1000.0,
                        "down_bytes": 1000.0,
                        "fp32": 300_000,
                        "batch": 32,
                        "steps": 4,
                    }
                ]
            }
        )
    )
    common = [
        "--tasks",
        "digits",
        "--nodes",
        "2",
        "--steps",
        "4",
        "--rows",
        "dense",
        "--seeds",
        "0",
        "--cache",
        str(cache),
        "--ledger",
        str(ledger),
        "--out",
        str(out),
    ]
    torch.set_num_threads(1)
    cn.main(common + ["--dense-mults", "3", "--jobs", "1"])  # lr 0.009: not in the carried grid
    (trained,) = json.loads(cache.read_text()).values()
    assert trained["lr"] == pytest.approx(0.009)
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert ("†" in row) is carried_shown, row
    if carried_shown:
        assert "| 0.003 (0.003, 0.009) | 2 | 0.0001 / 0.0001 (mean 0.0001) |" in row, row
    else:
        assert f"| 0.009 (0.003, 0.009) | 1 | {trained['held_out']:.4f} |" in row, row


@pytest.fixture(scope="module")
def node_batch():
    spec = importlib.util.spec_from_file_location("node_batch", BENCH.parent / "node_batch.py")
    mod = importlib.util.module_from_spec(spec)
    added = sys.modules.setdefault("node_batch", mod) is mod  # what bench/convergence.py imports
    spec.loader.exec_module(mod)
    yield mod
    if added:
        sys.modules.pop("node_batch", None)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("shape", [(3, 8, 5), (3, 5, 8)])
def test_batched_muon_is_torchs_muon_on_each_nodes_matrix(node_batch, shape):
    """``BatchedMuon`` on an ``[N, A, B]`` stack moves each node's matrix as ``torch.optim.Muon`` (no weight decay,
    lr matched to AdamW's RMS, as ``MuonAdamW``) moves it alone, wide and tall matrices alike."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(*shape, generator=gen)
    alone = [stack[i].clone() for i in range(shape[0])]
    batched = node_batch.BatchedMuon([stack], lr=0.1)
    each = [torch.optim.Muon([m], lr=0.1, weight_decay=0.0, adjust_lr_fn="match_rms_adamw") for m in alone]
    start = stack.clone()
    for _ in range(3):
        g = torch.randn(*shape, generator=gen)
        stack.grad = g
        batched.step()
        for i, (m, opt) in enumerate(zip(alone, each)):
            m.grad = g[i].clone()
            opt.step()
    assert (stack - start).abs().max() > 0.05
    for i, m in enumerate(alone):
        torch.testing.assert_close(stack[i], m, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="stacks"):
        node_batch.BatchedMuon([torch.zeros(4, 4)], lr=0.1)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("row", ["dense", "dense+muon", "diloco", "signloco+muon/agg"])
def test_batched_nodes_train_as_the_per_node_loop_does(cv, node_batch, row):
    """``--batched`` (every node in one vmap call and one optimizer step) trains the char transformer's nodes on
    the same batches to the per-node loop's curve, to float rounding, with the same bytes on the wire; it is a
    cache entry of its own."""
    torch.set_num_threads(1)
    task = cv.CharsTask(cv.Scale(steps=8, batch=4, width=32, context=16))
    spec = cv.RowSpec.parse(row)
    runs = []
    for batched in (False, True):
        settings = cv.Settings(full=False, nodes=3, H=4, evals=2, batched=batched)
        runs.append(cv.run_one(task, spec, 0.01, {"outer": "plain"}, 0, 8, settings, None))
    looped, batched = runs
    assert looped.curve[-1][2] < looped.curve[0][2] - 0.1
    for (s0, up0, h0), (s1, up1, h1) in zip(looped.curve, batched.curve):
        assert (s0, up0) == (s1, up1) and abs(h0 - h1) < 2e-3
    assert abs(looped.train_loss - batched.train_loss) < 2e-3
    assert (looped.up_bytes_per_step, looped.down_bytes_per_step) == (
        batched.up_bytes_per_step,
        batched.down_bytes_per_step,
    )
    keys = {
        cv.run_key("chars", task.scale, spec, "lr=0.01", 0, cv.Settings(full=False, nodes=3, H=4, batched=b), None)
        for b in (False, True)
    }
    assert len(keys) == 2


def test_iid_shards_let_every_node_draw_from_all_the_training_data_in_a_run_of_their_own(cv, digits):
    """``--shards iid`` (a diagnostic): the nodes train on windows of the whole training set instead of node i
    on the i-th slice, so the run differs from the default one, and it is another cache entry."""
    torch.set_num_threads(1)
    spec = cv.RowSpec.parse("diloco")
    runs = {}
    for shards in cv.SHARDS:
        settings = cv.Settings(full=False, nodes=4, H=4, evals=2, shards=shards)
        runs[shards] = cv.run_one(digits, spec, 3e-3, {"outer": "plain"}, 0, 8, settings, None)
    assert runs["iid"].held_out != runs["contiguous"].held_out
    assert all(math.isfinite(r.held_out) and r.held_out < r.curve[0][2] for r in runs.values())
    keys = {
        cv.run_key("digits", digits.scale, spec, "lr=0.003", 0, cv.Settings(full=False, nodes=4, H=4, shards=s), None)
        for s in cv.SHARDS
    }
    assert len(keys) == 2
    assert cv.run_key("digits", digits.scale, spec, "lr=0.003", 0, cv.Settings(full=False, nodes=4, H=4), None) in keys


def test_the_round_rule_is_the_plain_mean_or_the_servers_default_rule_object(cv):
    import gradwire
    from gradwire.aggregation import exact_mean

    codec = gradwire.DCTCodec(chunk_shape=[64], topk=16)
    g = torch.Generator().manual_seed(0)

    def round_records(biased: bool):
        updates = [torch.randn(4, 64, generator=g) for _ in range(4)]
        if biased:
            updates[3] = updates[3] + 1.0  # node 4 deviates the same way every round
        return [[codec.compress(u, "w")[0]] for u in updates]

    plain = cv.RoundRule("mean")
    recs = round_records(False)
    assert plain.weights(recs) == ([0.25] * 4, 0)
    assert torch.equal(plain.mean(recs)["w"], exact_mean(recs)["w"])
    # The server's default without a data assignment: the persistent deviator (an honest node on data of
    # its own looks the same) keeps at least its share (more in a round whose direction check drops another
    # update); the rule's state steps once per round.
    default = cv.RoundRule("bounded_mean")
    shares = [default.weights(round_records(True))[0][3] for _ in range(12)]
    assert min(shares) == pytest.approx(0.25), shares
    assert default.state.steps == 12 and default.state.norms.levels
