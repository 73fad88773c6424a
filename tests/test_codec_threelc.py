"""gradwire.ThreeLC (id 2): 3-value quantization with sparsity multiplication, quartic + zero-run coding."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import ErrorFeedback, FrameError, ThreeLC, wire
from gradwire.codecs.threelc import quantize, quartic_bytes
from gradwire.frame import write_frame

CUDA = torch.cuda.is_available()


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", [(1000,), (64, 33), (3, 4, 5), (), (1,), (7,), (0, 3)], ids=str)
@pytest.mark.parametrize("sparsity", [1.0, 1.5, 1.99])
def test_frame_decodes_to_the_reconstruction_compress_reports(shape, sparsity):
    codec = ThreeLC(sparsity)
    x = _rand(shape, seed=1)
    entry, recon = codec.compress(x, "w")
    out = gradwire.decode(write_frame([entry]))
    assert out.shape == x.shape and out.dtype == x.dtype and torch.equal(out, recon)


@pytest.mark.parametrize("sparsity", [1.0, 1.3, 1.9])
def test_values_are_minus_m_zero_or_m_with_m_the_scaled_max(sparsity):
    x = _rand((5000,), seed=2)
    entry, recon = ThreeLC(sparsity).compress(x)
    m = float(entry.sections["scale"][0])
    assert m == pytest.approx(x.abs().max().item() * sparsity, rel=1e-6)
    assert set(torch.unique(recon).tolist()) <= {-m, 0.0, m}
    # round(T / M) rounding half away from zero: |T| >= M/2 is sent as ±M, with T's sign.
    big = x.abs() >= m / 2
    assert torch.equal(recon[big], torch.sign(x[big]) * m)
    assert bool((recon[~big] == 0).all())


def test_rounding_is_half_away_from_zero_at_exactly_one_half():
    x = torch.tensor([1.0, 0.5, -0.5, 0.49999997, -0.49999997, 0.0])
    q, m = quantize(x, 1.0)
    assert m.item() == 1.0
    assert q.tolist() == [1, 1, -1, 0, 0, 0]


def test_larger_sparsity_sends_more_zeros_and_fewer_bytes():
    x = _rand((100_000,), seed=3)
    zeros, sizes = [], []
    for s in (1.0, 1.5, 1.99):
        entry, recon = ThreeLC(s).compress(x)
        zeros.append(int((recon == 0).sum()))
        sizes.append(entry.sections["data"].nbytes)
    assert zeros[0] < zeros[1] < zeros[2]
    assert sizes[0] > sizes[1] > sizes[2]
    assert sizes[0] <= -(-100_000 // 5)  # never more than quartic's 1.6 bits per element


def test_all_zero_tensor_encodes_to_zeros_with_m_zero():
    x = torch.zeros(1000)
    entry, recon = ThreeLC(1.5).compress(x)
    assert float(entry.sections["scale"][0]) == 0.0
    assert torch.equal(recon, x) and not torch.isnan(recon).any()
    # 200 quartic bytes of 121, zero-run coded: 14 bytes of 255 and one code byte for the 4 left over.
    assert entry.sections["data"].tolist() == [255] * 14 + [245]
    assert torch.equal(gradwire.decode(write_frame([entry])), x)


def test_payload_is_zero_run_of_quartic_of_the_trits():
    x = _rand((777,), seed=4)
    entry, recon = ThreeLC().compress(x)
    m = float(entry.sections["scale"][0])
    trits = (recon / m).round().to(torch.int8).numpy()
    assert entry.sections["data"].tobytes() == wire.zero_run_encode(wire.quartic_encode(trits))


def _spec_decode(m: float, data: bytes, n: int) -> list[float]:
    """FORMAT.md §5.3 in plain Python: zero-run expansion, then five planes of base-3 digits."""
    quartic = []
    for b in data:
        quartic.extend([121] * (b - 241) if b >= 243 else [b])
    planes = len(quartic)
    assert planes == -(-n // 5)
    digits = [0] * (5 * planes)
    for i, b in enumerate(quartic):
        for k, w in enumerate((81, 27, 9, 3, 1)):
            digits[k * planes + i] = (b // w) % 3
    return [m * (d - 1) for d in digits[:n]]


def test_the_documented_layout_decodes_to_the_same_values():
    x = _rand((1234,), seed=11)
    x[100:400] = 0  # long zero runs
    entry, recon = ThreeLC(1.2).compress(x)
    m = float(entry.sections["scale"][0])
    expect = _spec_decode(m, entry.sections["data"].tobytes(), 1234)
    assert recon.tolist() == pytest.approx(expect, abs=0)
    assert any(b >= 243 for b in entry.sections["data"])  # the runs really were coded


@pytest.mark.parametrize("n", [0, 1, 4, 5, 6, 999, 1000, 1001])
def test_device_quartic_matches_the_rust_kernel(n):
    q = torch.randint(-1, 2, (n,), generator=torch.Generator().manual_seed(n)).to(torch.int8)
    assert quartic_bytes(q).numpy().tobytes() == wire.quartic_encode(q.numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_decode_in_their_dtype(dtype):
    x = _rand((300,), seed=5, dtype=dtype)
    entry, recon = ThreeLC().compress(x)
    out = gradwire.decode(write_frame([entry]))
    assert out.dtype == dtype and torch.equal(out, recon)


def test_error_accumulation_tracks_the_sum_of_inputs():
    shape = (64, 64)
    ef = ErrorFeedback(ThreeLC(1.0))
    sum_in, sum_fb, sum_plain = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    gaps = []
    for t in range(60):
        g = _rand(shape, seed=100 + t) * 0.1 + 0.02  # a drift the quantizer alone mostly rounds away
        sum_in += g
        sum_fb += gradwire.decode(ef.encode(g, "w", round=t))
        sum_plain += gradwire.decode(ThreeLC(1.0).encode(g))
        gaps.append((sum_fb - sum_in).norm().item())
    # Nothing is lost, only delayed: the gap is exactly the carried residual, and it stays bounded
    # while the sum of inputs grows; without accumulation the gap grows with the sum.
    assert gaps[-1] == pytest.approx(ef.residual("w").norm().item(), rel=1e-3)
    assert max(gaps[30:]) < 1.25 * max(gaps[10:30])
    assert gaps[-1] < 0.15 * sum_in.norm()
    assert (sum_plain - sum_in).norm() > 4 * gaps[-1]


@pytest.mark.parametrize("s", [0.99, 2.0, float("nan"), 1.99999999])
def test_sparsity_outside_one_to_two_is_rejected(s):
    with pytest.raises(ValueError):
        ThreeLC(s)


def test_non_finite_input_is_rejected():
    with pytest.raises(ValueError, match="non-finite"):
        ThreeLC().compress(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="non-finite"):
        ThreeLC(1.9).compress(torch.tensor([3e38]))


# ---------------------------------------------------------------------------------------------
# Hostile records


def _good():
    return ThreeLC().compress(_rand((23,), seed=6), "w")[0]


def _with(**sections):
    e = _good()
    e.sections = {**e.sections, **sections}
    return e


def _params(p):
    e = _good()
    e.params = p
    return e


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: _params(b""), "params must be 4 bytes"),
        (lambda: _params(struct.pack("<f", 2.0)), "sparsity must lie"),
        (lambda: _params(struct.pack("<f", float("nan"))), "sparsity must lie"),
        (lambda: _with(scale=np.array([float("inf")], np.float32)), "scale M must be finite"),
        (lambda: _with(scale=np.array([-1.0], np.float32)), "scale M must be finite and >= 0"),
        (lambda: _with(scale=np.array([1.0, 2.0], np.float32)), "'scale' must hold"),
        (lambda: _with(data=np.array([121] * 4, np.uint8)), "section 'data'"),  # 20 trits, not 23
        (lambda: _with(data=np.array([121] * 6, np.uint8)), "section 'data'"),
        (lambda: _with(data=np.array([242, 242, 242, 242, 250], np.uint8)), "section 'data'"),  # run too long
        (lambda: _with(data=np.array([255, 255], np.uint8)), "section 'data'"),  # expands to 28 bytes
        (lambda: _with(data=np.array([121, 121, 121, 121, 242], np.uint8)), "section 'data'"),  # bad padding
        (lambda: _with(data=np.zeros(5, np.int8)), "element type uint8"),
    ],
)
def test_malformed_records_raise_frame_errors_naming_the_rule(make, rule):
    with pytest.raises(FrameError, match=rule):
        gradwire.decode(write_frame([make()]))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_matches_cpu():
    x = _rand((5001,), seed=7)
    entry_c, recon_c = ThreeLC(1.2).compress(x.cuda())
    entry, recon = ThreeLC(1.2).compress(x)
    assert recon_c.device.type == "cuda"
    assert np.array_equal(entry.sections["data"], entry_c.sections["data"])
    assert torch.equal(gradwire.decode(write_frame([entry_c]), device="cuda"), recon_c)
    torch.testing.assert_close(recon_c.cpu(), recon)
