"""gradwire.OneBit (id 5, 1-bit SGD) and gradwire.SignSGD (id 6, signSGD / EF-signSGD)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import ErrorFeedback, FrameError, OneBit, SignSGD, wire
from gradwire.codecs.sign import pack_sign_bits
from gradwire.frame import write_frame

CUDA = torch.cuda.is_available()
CODECS = [OneBit(), SignSGD("mean_abs"), SignSGD("none")]


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("shape", [(1000,), (64, 33), (3, 4, 5), (), (1,), (9,), (0, 3), (4, 0)], ids=str)
def test_frame_decodes_to_the_reconstruction_compress_reports(codec, shape):
    x = _rand(shape, seed=1)
    entry, recon = codec.compress(x, "w")
    out = gradwire.decode(write_frame([entry]))
    assert out.shape == x.shape and out.dtype == x.dtype and torch.equal(out, recon)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_bits_are_the_signs_packed_eight_per_byte(codec):
    x = _rand((37,), seed=2)
    x[5] = 0.0
    entry, _ = codec.compress(x)
    bits = entry.sections["bits"]
    assert bits.shape == (5,)
    assert wire.unpack_bits_exact(bits, 1, 37).tolist() == (x >= 0).int().tolist()  # zero -> bit 1


def test_onebit_sends_per_column_means_of_each_sign():
    x = torch.tensor([[1.0, -2.0, 0.0], [3.0, -4.0, -1.0], [-5.0, -6.0, 2.0]])
    entry, recon = OneBit().compress(x)
    assert entry.sections["pos"].tolist() == [2.0, 0.0, 1.0]  # zero counts with the non-negatives
    assert entry.sections["neg"].tolist() == [-5.0, -4.0, -1.0]
    assert recon.tolist() == [[2.0, -4.0, 1.0], [2.0, -4.0, -1.0], [-5.0, -4.0, 1.0]]


def test_onebit_views_tensors_as_shape0_by_rest_and_vectors_as_one_column():
    entry, recon = OneBit().compress(_rand((6, 2, 5), seed=3))
    assert entry.sections["pos"].shape == (10,)
    x = torch.tensor([1.0, 3.0, -2.0, -4.0])
    entry, recon = OneBit().compress(x)
    assert entry.sections["pos"].tolist() == [2.0] and entry.sections["neg"].tolist() == [-3.0]
    assert recon.tolist() == [2.0, 2.0, -3.0, -3.0]


def test_onebit_keeps_each_columns_sum():
    # Replacing each side by its mean keeps the column sum: the quantizer is unbiased per column.
    x = _rand((50, 20), seed=4)
    _, recon = OneBit().compress(x)
    torch.testing.assert_close(recon.sum(0), x.sum(0), atol=1e-4, rtol=1e-5)


def test_ef_signsgd_scale_is_the_mean_absolute_value():
    x = torch.tensor([1.0, -3.0, 0.0, 2.0])
    entry, recon = SignSGD().compress(x)
    assert entry.sections["scale"].tolist() == [1.5]
    assert recon.tolist() == [1.5, -1.5, 1.5, 1.5]
    # ... and the L1 norm is kept.
    x = _rand((1000,), seed=5)
    _, recon = SignSGD().compress(x)
    assert recon.abs().sum().item() == pytest.approx(x.abs().sum().item(), rel=1e-5)


def test_plain_signsgd_decodes_to_plus_minus_one():
    entry, recon = SignSGD("none").compress(torch.tensor([0.3, -7.0, 0.0]))
    assert entry.params == b"\x00" and entry.sections["scale"].tolist() == [1.0]
    assert recon.tolist() == [1.0, -1.0, 1.0]


def test_wire_cost():
    x = _rand((100, 64), seed=6)
    assert OneBit().compress(x)[0].nbytes() == 800 + 8 * 64
    assert SignSGD().compress(x)[0].nbytes() == 1 + 800 + 4


@pytest.mark.parametrize("codec", [OneBit(), SignSGD()], ids=repr)
def test_error_feedback_tracks_the_sum_of_inputs(codec):
    shape = (32, 16)
    ef = ErrorFeedback(codec)
    sum_in, sum_fb = torch.zeros(shape), torch.zeros(shape)
    gaps = []
    for t in range(80):
        g = _rand(shape, seed=100 + t) + torch.linspace(-1, 1, 16)  # per-column drift
        sum_in += g
        sum_fb += gradwire.decode(ef.encode(g, "w", round=t))
        gaps.append((sum_fb - sum_in).norm().item())
    assert gaps[-1] == pytest.approx(ef.residual("w").norm().item(), rel=1e-3)
    assert max(gaps[40:]) < 1.5 * max(gaps[10:40])  # bounded, not growing
    assert gaps[-1] < 0.1 * sum_in.norm()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_device_bit_packing_matches_the_rust_kernel(n):
    mask = _rand((n,), seed=n) >= 0
    # The GPU path, run on the CPU: same bytes as wire.pack_bits.
    from gradwire.codecs import sign

    nbytes = -(-n // 8)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8)
    padded[:n] = mask
    w = torch.tensor(sign._BIT_WEIGHTS, dtype=torch.uint8)
    device_path = (padded.view(nbytes, 8) * w).sum(dim=1, dtype=torch.uint8).numpy()
    assert device_path.tobytes() == pack_sign_bits(mask).tobytes() == wire.pack_bits(mask.numpy().astype(np.uint32), 1)


def test_bad_scale_mode_is_rejected():
    with pytest.raises(ValueError):
        SignSGD("l2")


def test_non_finite_input_is_rejected():
    for codec in CODECS[:2]:
        with pytest.raises(ValueError, match="non-finite"):
            codec.compress(torch.tensor([1.0, float("nan")]))


# ---------------------------------------------------------------------------------------------
# Hostile records


def _onebit(**sections):
    e = OneBit().compress(_rand((4, 5), seed=7), "w")[0]
    e.sections = {**e.sections, **sections}
    return e


def _sign(params=None, **sections):
    e = SignSGD().compress(_rand((13,), seed=8), "w")[0]
    e.sections = {**e.sections, **sections}
    if params is not None:
        e.params = params
    return e


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: _onebit(pos=np.zeros(4, np.float32)), "'pos' must hold"),
        (lambda: _onebit(neg=np.zeros(5, np.float16)), "element type float32"),
        (lambda: _onebit(pos=np.full(5, -1, np.float32)), "must be >= 0 in 'pos'"),
        (lambda: _onebit(neg=np.full(5, np.inf, np.float32)), "finite"),
        (lambda: _onebit(bits=np.zeros(2, np.uint8)), "ceil\\(numel / 8\\)"),
        (lambda: _onebit(bits=np.array([0, 0, 0xF0], np.uint8)), "padding"),
        (lambda: _sign(params=b""), "params must be 1 byte"),
        (lambda: _sign(params=b"\x02"), "scale_mode must be"),
        (lambda: _sign(params=b"\x00"), "scale must be 1"),
        (lambda: _sign(scale=np.array([-1.0], np.float32)), "finite and >= 0"),
        (lambda: _sign(scale=np.array([np.nan], np.float32)), "finite and >= 0"),
        (lambda: _sign(bits=np.array([0, 0x80], np.uint8)), "padding"),
        (lambda: _sign(extra=np.zeros(1, np.uint8)), "unexpected section"),
    ],
)
def test_malformed_records_raise_frame_errors_naming_the_rule(make, rule):
    with pytest.raises(FrameError, match=rule):
        gradwire.decode(write_frame([make()]))


def test_onebit_takes_no_params():
    e = _onebit()
    e.params = struct.pack("<I", 1)
    with pytest.raises(FrameError, match="params must be empty"):
        gradwire.decode(write_frame([e]))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_cuda_matches_cpu(codec):
    x = _rand((300, 17), seed=9)
    entry_c, recon_c = codec.compress(x.cuda())
    entry, recon = codec.compress(x)
    assert recon_c.device.type == "cuda"
    assert np.array_equal(entry.sections["bits"], entry_c.sections["bits"])
    assert torch.equal(gradwire.decode(write_frame([entry_c]), device="cuda"), recon_c)
    torch.testing.assert_close(recon_c.cpu(), recon)
