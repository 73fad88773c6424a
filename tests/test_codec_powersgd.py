"""gradwire.PowerSGD (id 9): rank-r factors with warm start, dense vectors, the collective helpers."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import ErrorFeedback, FrameError, PowerSGD
from gradwire.codecs.powersgd import first_q, matrix_view, powersgd_decompress, powersgd_p, powersgd_q
from gradwire.frame import write_frame
from gradwire.lowrank import compressible, orthogonalize_, should_compress

CUDA = torch.cuda.is_available()


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _low_rank(rows, cols, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)


@pytest.mark.parametrize(
    "codec",
    [
        PowerSGD(2),
        PowerSGD(1, min_compression=1.0),
        PowerSGD(4, factor_dtype=torch.float16),
        PowerSGD(2, factor_dtype=torch.bfloat16),
    ],
    ids=repr,
)
@pytest.mark.parametrize("shape", [(64, 48), (16, 3, 3, 3), (1000,), (), (5, 4), (1, 100), (0, 4)], ids=str)
def test_frame_decodes_to_the_reconstruction_compress_reports(codec, shape):
    x = _rand(shape, seed=1)
    for _step in range(2):  # the second step uses the warm-start Q
        entry, recon = codec.compress(x, "w")
        out = gradwire.decode(write_frame([entry]))
        assert out.shape == x.shape and out.dtype == x.dtype and torch.equal(out, recon)


def test_factors_go_in_the_frame_and_vectors_go_dense():
    codec = PowerSGD(rank=2)
    entry, _ = codec.compress(_rand((64, 48), seed=2), "w")
    assert struct.unpack("<BI", entry.params) == (1, 2)
    assert entry.sections["p"].shape == (64 * 2,) and entry.sections["q"].shape == (48 * 2,)
    assert entry.nbytes() == 5 + 4 * 2 * (64 + 48)
    bias = _rand((48,), seed=3)
    entry, recon = codec.compress(bias, "b")
    assert struct.unpack("<BI", entry.params) == (0, 0) and list(entry.sections) == ["data"]
    assert torch.equal(recon, bias)


def test_small_matrices_go_dense_under_min_compression():
    assert compressible((64, 48), 2, 2.0)
    assert not compressible((5, 4), 2, 2.0)  # 20 values against 2 * 9 = 18
    assert compressible((5, 4), 2, 1.0)
    assert not compressible((100,), 1, 1.0)
    assert not compressible((4, 0), 1, 1.0)
    entry, _ = PowerSGD(2).compress(_rand((5, 4), seed=4))
    assert entry.params[0] == 0


def test_factors_must_be_strictly_smaller_as_in_torch_powersgd():
    # 6 x 6 at rank 3: (6 + 6) * 3 = 36 = 6 * 6, no saving, so dense (torch's powerSGD_hook rule).
    assert not should_compress(6, 6, 3)
    assert should_compress(6, 6, 2)
    assert not compressible((6, 6), 3, 1.0) and compressible((6, 7), 3, 1.0)
    entry, _ = PowerSGD(3, min_compression=1.0).compress(_rand((6, 6), seed=4))
    assert entry.params[0] == 0
    entry, _ = PowerSGD(3, min_compression=1.0).compress(_rand((6, 7), seed=4))
    assert entry.params[0] == 1


def test_low_rank_input_is_reconstructed_exactly_in_one_step():
    m = _low_rank(60, 40, 2, seed=5)
    _, recon = PowerSGD(rank=2).compress(m, "w")
    assert (recon - m).norm() < 1e-4 * m.norm()
    # Rank 3 input at rank 2 is not.
    m3 = _low_rank(60, 40, 3, seed=6)
    _, recon3 = PowerSGD(rank=2).compress(m3, "w")
    assert (recon3 - m3).norm() > 1e-2 * m3.norm()


def test_warm_start_converges_to_the_best_rank_r_approximation():
    g = torch.Generator().manual_seed(7)
    u, _ = torch.linalg.qr(torch.randn(80, 80, generator=g))
    v, _ = torch.linalg.qr(torch.randn(50, 50, generator=g))
    s = torch.tensor([10.0, 6.0, 3.0] + [0.5] * 47)
    m = u[:, :50] @ torch.diag(s) @ v.T
    best = torch.sqrt((s[2:] ** 2).sum()).item()  # Eckart–Young: error of the best rank-2 approximation
    codec = PowerSGD(rank=2)
    errs = [(codec.compress(m, "w")[1] - m).norm().item() for _ in range(8)]
    assert errs[0] > 1.05 * best
    assert errs[-1] < 1.01 * best
    assert errs[-1] < errs[0]
    # Without the warm start every step is the first one.
    cold = [(PowerSGD(rank=2).compress(m, "w")[1] - m).norm().item() for _ in range(3)]
    assert cold[0] == cold[1] == cold[2] == pytest.approx(errs[0])


def test_q_is_kept_per_name_and_can_be_saved_and_reset():
    codec = PowerSGD(rank=2)
    codec.compress(_rand((30, 20), seed=8), "a")
    codec.compress(_rand((40, 10), seed=9), "b")
    assert codec.q("a").shape == (20, 2) and codec.q("b").shape == (10, 2)
    state = codec.state_dict()
    other = PowerSGD(rank=2)
    other.load_state_dict(state)
    x = _rand((30, 20), seed=10)
    assert torch.equal(codec.compress(x, "a")[1], other.compress(x, "a")[1])
    codec.reset("a")
    assert codec.q("a") is None and codec.q("b") is not None
    codec.reset()
    assert codec.q("b") is None


def test_the_same_seed_gives_the_same_first_q_on_every_worker():
    assert torch.equal(first_q("layer.weight", 20, 2, seed=3), first_q("layer.weight", 20, 2, seed=3))
    assert not torch.equal(first_q("layer.weight", 20, 2, seed=3), first_q("layer.bias", 20, 2, seed=3))
    x = _rand((30, 20), seed=11)
    assert torch.equal(PowerSGD(seed=3).compress(x, "w")[1], PowerSGD(seed=3).compress(x, "w")[1])


def test_zero_gradient_keeps_the_warm_start_alive():
    codec = PowerSGD(rank=2)
    m = _low_rank(30, 20, 2, seed=12)
    codec.compress(m, "w")
    entry, recon = codec.compress(torch.zeros(30, 20), "w")
    assert torch.equal(recon, torch.zeros(30, 20))
    assert codec.q("w").norm() > 0
    assert (codec.compress(m, "w")[1] - m).norm() < 1e-4 * m.norm()


def test_collective_helpers_compose_to_the_codec():
    m = _rand((30, 20), seed=13)
    q0 = first_q("w", 20, 2, seed=0)
    p_hat = orthogonalize_(powersgd_p(m, q0))
    assert torch.allclose(p_hat.T @ p_hat, torch.eye(2), atol=1e-5)
    q1 = powersgd_q(m, p_hat)
    approx = powersgd_decompress(p_hat, q1)
    _, recon = PowerSGD(rank=2).compress(m, "w")
    torch.testing.assert_close(approx, recon)
    assert matrix_view(torch.zeros(4, 3, 2)).shape == (4, 6)
    # Linearity the all-reduce relies on: mean of P over workers = P of the mean matrix.
    m2 = _rand((30, 20), seed=14)
    torch.testing.assert_close((powersgd_p(m, q0) + powersgd_p(m2, q0)) / 2, powersgd_p((m + m2) / 2, q0))


def test_error_feedback_tracks_the_sum_of_inputs():
    shape = (40, 30)
    ef, plain = ErrorFeedback(PowerSGD(rank=1)), PowerSGD(rank=1)
    sum_in, sum_fb, sum_plain = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    gaps = []
    drift = _low_rank(40, 30, 3, seed=15) * 0.1
    for t in range(60):
        g = _rand(shape, seed=100 + t) * 0.5 + drift
        sum_in += g
        sum_fb += gradwire.decode(ef.encode(g, "w", round=t))
        sum_plain += gradwire.decode(plain.encode(g, name="w"))
        gaps.append((sum_fb - sum_in).norm().item())
    # The gap is the residual, and it levels off; rank 1 alone loses the other directions for good.
    assert gaps[-1] == pytest.approx(ef.residual("w").norm().item(), rel=1e-3)
    assert max(gaps[30:]) < 1.3 * max(gaps[10:30])
    assert (sum_plain - sum_in).norm() > 3 * gaps[-1]


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(min_compression=0.5), dict(factor_dtype=torch.float64)])
def test_bad_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        PowerSGD(**kwargs)


def test_non_finite_input_is_rejected():
    x = _rand((30, 20))
    x[1, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        PowerSGD().compress(x)
    with pytest.raises(ValueError, match="non-finite"):
        PowerSGD().compress(torch.tensor([1.0, float("inf")]))


# ---------------------------------------------------------------------------------------------
# Hostile records


def _factors(params=None, shape=None, **sections):
    e = PowerSGD(rank=2).compress(_rand((12, 10), seed=16), "w")[0]
    e.sections = {**e.sections, **sections}
    if params is not None:
        e.params = params
    if shape is not None:
        e.shape = shape
    return e


def _dense(params=None, **sections):
    e = PowerSGD(rank=2).compress(_rand((7,), seed=17), "b")[0]
    e.sections = {**e.sections, **sections}
    if params is not None:
        e.params = params
    return e


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: _factors(params=b"\x01"), "params must be 5 bytes"),
        (lambda: _factors(params=struct.pack("<BI", 2, 2)), "mode must be 0"),
        (lambda: _factors(params=struct.pack("<BI", 1, 0)), "rank must lie"),
        (lambda: _factors(params=struct.pack("<BI", 1, 11)), "rank must lie"),
        (lambda: _factors(params=struct.pack("<BI", 1, 3)), "'p' must hold"),
        (lambda: _factors(shape=(120,)), "needs ndim >= 2"),
        (lambda: _factors(q=np.zeros(20, np.float16)), "share an element type"),
        (lambda: _factors(p=np.full(24, np.nan, np.float32)), "finite"),
        (lambda: _factors(p=np.zeros(24, np.float64)), "element type"),
        (lambda: _factors(data=np.zeros(120, np.float32)), "unexpected section"),
        (lambda: _dense(params=struct.pack("<BI", 0, 1)), "rank must be 0"),
        (lambda: _dense(data=np.zeros(6, np.float32)), "'data' must hold numel"),
        (lambda: _dense(data=np.zeros(7, np.float16)), "element type"),
    ],
)
def test_malformed_records_raise_frame_errors_naming_the_rule(make, rule):
    with pytest.raises(FrameError, match=rule):
        gradwire.decode(write_frame([make()]))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_round_trip_and_parity():
    x = _rand((300, 64), seed=18)
    codec_c, codec = PowerSGD(rank=4), PowerSGD(rank=4)
    for _ in range(3):
        entry_c, recon_c = codec_c.compress(x.cuda(), "w")
        entry, recon = codec.compress(x, "w")
    assert recon_c.device.type == "cuda" and codec_c.q("w").device.type == "cuda"
    assert torch.equal(gradwire.decode(write_frame([entry_c]), device="cuda"), recon_c)
    torch.testing.assert_close(recon_c.cpu(), recon, atol=1e-4, rtol=1e-3)
