"""bench/optimizer_step.py end to end on the CPU, small: every row timed on the same parameters beside
torch's AdamW and DeMo's reference optimizer, on the linear, many-tensor and MLP models, the bytes the
optimizers' real exchange sent per step, and the issue's targets printed as met / missed lines."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench_modules import BENCH_DIR, load_bench

BENCH = BENCH_DIR / "optimizer_step.py"


_bench = load_bench


def test_the_optimizer_step_bench_times_every_row_beside_adamw_and_the_reference(tmp_path):
    out = tmp_path / "optimizer_step.md"
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--params",
            "1.1M",
            "--models",
            "linear,many,mlp",
            "--repeat",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    text = out.read_text()
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith("| linear") or line.startswith("| many") or line.startswith("| mlp")
    ]
    names = {
        "torch AdamW (foreach)",
        "DeMo reference (demo.py)",
        "gradwire DeMo",
        "gradwire SparseLoCo, per step",
        "gradwire SparseLoCo, the sync step (1 in 8)",
    }
    by_model: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        by_model.setdefault(r[0], {})[r[3]] = r
    assert set(by_model) == {"linear", "many", "mlp"}
    for model, by_name in by_model.items():
        assert set(by_name) == names, model
        assert float(by_name["torch AdamW (foreach)"][5]) == 1.0
        assert float(by_name["DeMo reference (demo.py)"][6]) == 1.0
    # The many-tensor model: 48 layers of 256×256 with biases.
    assert by_model["many"]["gradwire DeMo"][1:3] == ["3.2 M", "96"]
    assert by_model["linear"]["gradwire DeMo"][1:3] == ["1.0 M", "2"]
    fp32 = 4 * 1_050_624  # one 1024×1024 layer with its bias
    lin = by_model["linear"]
    for name in ("gradwire DeMo", "gradwire SparseLoCo, per step"):
        ms, sent = float(lin[name][4]), float(lin[name][7].replace(",", ""))
        assert ms > 0 and 0 < sent < fp32 / 100, (name, sent)
    # The reference sends int64 indices and fp32 values of 32 of each 64×64 tile: 256 tiles × 32 × 12 B,
    # and the bias's 16 rows of 64 (a 1-D tensor is cut in rows of the chunk) × 32 × 12 B.
    assert float(lin["DeMo reference (demo.py)"][7].replace(",", "")) == 256 * 32 * 12 + 16 * 32 * 12
    targets = [line for line in text.splitlines() if line.startswith("target ")]
    assert any("DeMo step / reference, linear 1.0 M" in t for t in targets)
    assert any("DeMo step / reference, many 3.2 M" in t for t in targets)
    assert any("SparseLoCo mean step / AdamW, linear 1.0 M" in t for t in targets)
    assert all(t.endswith(("— met", "— missed")) for t in targets)


def test_the_reference_rewrite_matches_demo_py_semantics():
    """One step of the rewritten DeMo on one parameter, checked against what demo.py's step means: the
    delta keeps what was not sent, the weights move by −lr·sign of the decoded top-k."""
    ref = _bench("demo_reference")
    DeMoReference, smaller_split = ref.DeMoReference, ref.smaller_split
    assert smaller_split(4096, 64) == 64 and smaller_split(96, 64) == 48 and smaller_split(97, 64) == 1
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(128, 64))
    g = torch.randn(128, 64)
    p.grad = g.clone()
    w0 = p.detach().clone()
    opt = DeMoReference([p], lr=0.1, compression_topk=4)
    opt.step()
    delta = opt.demo_state[p]["delta"]
    sent = 0.1 * g - delta  # what was transmitted, decoded
    # 2 tiles of 64×64, 4 coefficients kept each: the transmitted part has rank ≤ 8 in the DCT domain.
    coeffs = opt.transform.encode(sent)
    assert int((coeffs.abs() > 1e-6).sum()) == 2 * 4
    torch.testing.assert_close(p.detach(), w0 - 0.1 * torch.sign(sent), atol=1e-6, rtol=0)
    assert opt.bytes_sent == 2 * 4 * (8 + 4)


@pytest.mark.parametrize("tokens,sizes", [(["10M,100M"], [10e6, 100e6]), (["1.1e6", "3k"], [1.1e6, 3e3])])
def test_the_params_option_reads_suffixes_and_commas(tokens, sizes):
    _bench("demo_reference")
    assert _bench("optimizer_step").parse_sizes(tokens) == sizes
