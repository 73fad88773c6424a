"""gradwire.QSGD (id 4): stochastic quantization to s levels per bucket, Elias-coded (FORMAT.md §5.5)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import QSGD, ErrorFeedback, FrameError, wire
from gradwire.codecs.qsgd import unpack_params
from gradwire.frame import write_frame

CUDA = torch.cuda.is_available()


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", [(1000,), (64, 33), (3, 4, 5), (), (1,), (0, 3)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_frame_decodes_to_the_reconstruction_compress_reports(shape, dtype):
    codec = QSGD(levels=4, bucket=100)
    x = _rand(shape, 1, dtype)
    entry, recon = codec.compress(x, "w")
    out = gradwire.decode(write_frame([entry]))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, recon)


@pytest.mark.parametrize("levels,bucket", [(1, 512), (4, 100), (16, 37), (255, 4096)])
def test_values_are_bucket_norm_times_a_level_over_s(levels, bucket):
    x = _rand((5000,), 2)
    entry, recon = QSGD(levels=levels, bucket=bucket).compress(x)
    norms = torch.from_numpy(entry.sections["norm"].copy())
    nb = -(-5000 // bucket)
    assert norms.numel() == nb
    padded = torch.zeros(nb * bucket)
    padded[:5000] = x
    torch.testing.assert_close(norms, padded.view(nb, bucket).norm(dim=1))
    q = recon / norms.repeat_interleave(bucket)[:5000] * levels
    assert torch.allclose(q, q.round(), atol=1e-3)
    assert q.abs().max() <= levels + 1e-3
    # Signs are kept; a level is floor(s|x|/‖v‖) or one more.
    r = x.abs() / norms.repeat_interleave(bucket)[:5000] * levels
    assert bool(((q.abs().round() == r.floor()) | (q.abs().round() == r.floor() + 1)).all())
    assert bool((torch.sign(q) * torch.sign(x) >= 0).all())


def test_quantization_is_unbiased():
    # The mean of many independent decodes approaches the input; each element's z-score uses its exact
    # variance (‖v‖/s)² p(1 − p), p the fractional part of s|x|/‖v‖.
    levels, bucket, trials = 2, 64, 3000
    x = _rand((256,), 3)
    codec = QSGD(levels=levels, bucket=bucket, seed=11)
    total = torch.zeros(256, dtype=torch.float64)
    for _ in range(trials):
        _, recon = codec.compress(x)
        total += recon.double()
    mean = total / trials
    norms = x.view(-1, bucket).norm(dim=1).repeat_interleave(bucket).double()
    r = x.abs().double() / norms * levels
    p = r - r.floor()
    var = (norms / levels) ** 2 * p * (1 - p)
    exact = var == 0
    assert torch.allclose(mean[exact], x.double()[exact], atol=1e-6)
    z = (mean - x.double())[~exact] / (var[~exact] / trials).sqrt()
    n = int(z.numel())
    assert float(z.abs().max()) < 5.0
    # Σ z² is χ² with n degrees of freedom: mean n, standard deviation √(2n).
    assert abs(float((z**2).sum()) - n) < 5 * (2 * n) ** 0.5
    # A biased rounding (to nearest) would fail the same test by far.
    biased = norms / levels * r.round() * torch.sign(x.double())
    zb = (biased - x.double())[~exact] / (var[~exact] / trials).sqrt()
    assert float(zb.abs().max()) > 20


def test_same_seed_same_frames_and_draws_advance():
    x = _rand((2000,), 4)
    a, b = QSGD(seed=5), QSGD(seed=5)
    fa = [a.encode(x, name="w") for _ in range(3)]
    fb = [b.encode(x, name="w") for _ in range(3)]
    assert fa == fb
    assert len(set(fa)) == 3  # each call draws afresh
    assert QSGD(seed=6).encode(x, name="w") != fa[0]


@pytest.mark.parametrize("elias", ["omega", "gamma"])
def test_payload_is_the_sparse_level_stream_of_the_nonzero_levels(elias):
    x = _rand((3000,), 5)
    codec = QSGD(levels=4, bucket=256, elias=elias)
    entry, recon = codec.compress(x)
    p = unpack_params(entry.params)
    assert p == dict(levels=4, bucket=256, elias=elias, nnz=int((recon != 0).sum()))
    norms = torch.from_numpy(entry.sections["norm"].copy()).repeat_interleave(256)[:3000]
    q = (recon / norms * 4).round().to(torch.int32)
    pos = torch.nonzero(q).flatten()
    want = wire.sparse_levels_encode(pos.numpy().astype(np.uint64), q[pos].numpy(), elias)
    assert entry.sections["data"].tobytes() == want


def test_fewer_levels_and_larger_buckets_send_fewer_bytes():
    x = _rand((1 << 16,), 6)
    size = lambda **kw: len(QSGD(**kw).encode(x))  # noqa: E731
    assert size(levels=1, bucket=4096) < size(levels=4, bucket=4096) < size(levels=16, bucket=4096)
    assert size(levels=2, bucket=8192) < size(levels=2, bucket=512)
    # s = 1 with large buckets: about √d nonzeros per bucket, far below one byte per element.
    assert size(levels=1, bucket=8192) < x.numel() / 8


def test_error_feedback_carries_what_quantization_changed():
    codec = QSGD(levels=2, bucket=128)
    ef = ErrorFeedback(codec)
    x = _rand((1000,), 7)
    entry = ef.compress(x, "w")
    torch.testing.assert_close(ef.residual("w"), x - gradwire.decode_entry(entry))


def test_zero_tensor_and_zero_buckets():
    x = torch.zeros(300)
    x[250] = 3.0
    entry, recon = QSGD(levels=4, bucket=100).compress(x)
    assert entry.sections["norm"].tolist() == [0.0, 0.0, 3.0]
    assert torch.equal(recon, x)  # |x| = ‖v‖: the top level, exactly
    assert unpack_params(entry.params)["nnz"] == 1


def test_constructor_rejects_bad_settings():
    with pytest.raises(ValueError, match="levels"):
        QSGD(levels=0)
    with pytest.raises(ValueError, match="bucket"):
        QSGD(bucket=0)
    with pytest.raises(ValueError, match="elias"):
        QSGD(elias="delta")
    with pytest.raises(ValueError, match="non-finite"):
        QSGD().compress(torch.tensor([1.0, float("nan")]))


# ------------------------------------------------------------------------------------------------
# Hostile records


def _entry():
    return QSGD(levels=4, bucket=64).compress(_rand((500,), 8), "w")[0]


def _decode(entry):
    return gradwire.decode(write_frame([entry]))


def _params(entry, **changes):
    p = dict(zip(("levels", "bucket", "elias", "nnz"), struct.unpack("<IIBQ", entry.params)))
    p.update(changes)
    entry.params = struct.pack("<IIBQ", p["levels"], p["bucket"], p["elias"], p["nnz"])
    return entry


@pytest.mark.parametrize(
    "edit,rule",
    [
        (lambda e: _params(e, levels=0), r"levels must lie in \[1, 2\^24\]"),
        (lambda e: _params(e, bucket=0), "bucket must be >= 1"),
        (lambda e: _params(e, elias=2), "elias must be 0 \\(omega\\) or 1 \\(gamma\\)"),
        (lambda e: _params(e, nnz=501), "nnz must be <= numel = 500"),
        (lambda e: _params(e, nnz=1 << 40), "nnz must be <= numel"),
        (lambda e: _params(e, nnz=3), "section 'data'"),
        (lambda e: _params(e, levels=1), "section 'data'.*outside"),
        (lambda e: _params(e, bucket=100), "section 'norm' must hold ceil\\(numel / bucket\\)"),
        (lambda e: setattr(e, "params", e.params + b"\0") or e, "params must be 17 bytes"),
    ],
)
def test_malformed_params_raise_frame_error(edit, rule):
    with pytest.raises(FrameError, match=rule):
        _decode(edit(_entry()))


def test_malformed_sections_raise_frame_error():
    e = _entry()
    e.sections["norm"] = e.sections["norm"].copy()
    e.sections["norm"][0] = -1.0
    with pytest.raises(FrameError, match="norms must be finite and >= 0"):
        _decode(e)
    e = _entry()
    e.sections["norm"] = e.sections["norm"].copy()
    e.sections["norm"][1] = np.inf
    with pytest.raises(FrameError, match="norms must be finite"):
        _decode(e)
    e = _entry()
    e.sections["data"] = e.sections["data"][:-2]
    with pytest.raises(FrameError, match="section 'data'"):
        _decode(e)
    e = _entry()
    e.sections["data"] = np.concatenate([e.sections["data"], np.zeros(1, np.uint8)])
    with pytest.raises(FrameError, match="section 'data'.*length mismatch"):
        _decode(e)
    e = _entry()
    e.sections = {"data": e.sections["data"], "norm": e.sections["norm"]}
    with pytest.raises(FrameError, match="order"):
        _decode(e)


def test_positions_past_the_tensor_are_rejected():
    e = _entry()
    e.sections["data"] = np.frombuffer(wire.sparse_levels_encode([10, 600], [1, -2]), np.uint8)
    _params(e, nnz=2)
    with pytest.raises(FrameError, match="not below the universe 500"):
        _decode(e)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_tensors_quantize_on_their_device():
    x = _rand((10_000,), 9).cuda()
    codec = QSGD(levels=8, bucket=512)
    entry, recon = codec.compress(x, "w")
    assert recon.device == x.device
    out = gradwire.decode(write_frame([entry]), device="cuda")
    assert torch.equal(out, recon)
