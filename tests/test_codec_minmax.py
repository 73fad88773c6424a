"""gradwire.MinMaxUInt8 (id 10): Bagua's per-chunk min/max uint8 quantizer (FORMAT.md §5.11)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire
from gradwire import ErrorFeedback, FrameError, MinMaxUInt8
from gradwire.frame import write_frame

CUDA = torch.cuda.is_available()


def _rand(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", [(1000,), (64, 33), (3, 4, 5), (), (1,), (0, 7)], ids=str)
@pytest.mark.parametrize("chunk", [1, 7, 256, 1024])
def test_frame_decodes_to_the_reconstruction_compress_reports(shape, chunk):
    codec = MinMaxUInt8(chunk=chunk)
    x = _rand(shape, seed=1)
    entry, recon = codec.compress(x, "w")
    out = gradwire.decode(write_frame([entry]))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, recon)


def test_error_is_at_most_half_a_step_per_chunk():
    x = _rand((10_000,), seed=2) * 3
    chunk = 500
    out = gradwire.decode(MinMaxUInt8(chunk=chunk).encode(x))
    xc = x.view(-1, chunk)
    step = (xc.amax(1) - xc.amin(1)) / 255
    err = (out.view(-1, chunk) - xc).abs()
    assert bool((err <= step[:, None] * 0.5 + 1e-6).all())
    assert err.max() > 0.3 * step.min()  # really quantized, not sent raw


def test_minimum_maps_to_code_0_and_maximum_to_255_in_every_chunk():
    g = torch.Generator().manual_seed(3)
    # Ranges where (x - min) * 255 / (max - min) can round below 0 or above 255 in float32.
    x = torch.cat([torch.rand(4096, generator=g) * 1e-7 - 1.0, torch.rand(4096, generator=g) * 3e5 + 1e9])
    entry, _ = MinMaxUInt8(chunk=512).compress(x)
    codes = entry.sections["codes"].reshape(-1, 512)
    xc = x.view(-1, 512)
    for c in range(codes.shape[0]):
        assert codes[c, int(xc[c].argmin())] == 0
        assert codes[c, int(xc[c].argmax())] == 255
    assert np.array_equal(entry.sections["min"], xc.amin(1).numpy())
    assert np.array_equal(entry.sections["max"], xc.amax(1).numpy())


def test_codes_follow_the_formula():
    x = torch.tensor([-1.0, 0.0, 0.5, 1.0, 0.25, -0.5])
    entry, recon = MinMaxUInt8(chunk=6).compress(x)
    expect = np.clip(np.round((x.numpy() + 1.0) * 255 / 2.0), 0, 255).astype(np.uint8)
    assert entry.sections["codes"].tolist() == expect.tolist()
    step = np.float32(2.0) / np.float32(255.0)
    torch.testing.assert_close(recon, torch.from_numpy(np.float32(-1.0) + expect.astype(np.float32) * step))


def test_constant_chunks_decode_exactly():
    x = torch.cat([torch.full((100,), 3.25), torch.zeros(100), torch.full((37,), -7e-3)])
    out = gradwire.decode(MinMaxUInt8(chunk=100).encode(x))
    assert torch.equal(out, x)


def test_short_last_chunk_keeps_its_own_range():
    x = torch.cat([torch.linspace(-5, 5, 1024), torch.tensor([0.1, 0.2, 0.3])])
    entry, recon = MinMaxUInt8(chunk=1024).compress(x)
    assert entry.sections["min"].tolist() == pytest.approx([-5.0, 0.1])
    assert entry.sections["max"].tolist() == pytest.approx([5.0, 0.3])
    assert (recon[-3:] - x[-3:]).abs().max() < 0.2 / 255


def test_a_chunk_far_larger_than_the_tensor_allocates_nothing_of_its_size():
    # 2^31 - 1 floats would be 8 GiB; the chunk is only ever the tensor's own length.
    x = _rand((10,), seed=8)
    entry, recon = MinMaxUInt8(chunk=(1 << 31) - 1).compress(x)
    assert entry.sections["min"].shape == (1,)
    assert torch.equal(gradwire.decode(write_frame([entry])), recon)


def test_wire_cost_is_one_byte_per_element_plus_eight_per_chunk():
    entry, _ = MinMaxUInt8(chunk=1024).compress(_rand((5000,), seed=4))
    assert entry.nbytes() == 4 + 5000 + 8 * 5
    assert list(entry.sections) == ["min", "max", "codes"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_decode_in_their_dtype(dtype):
    x = _rand((300,), seed=5, dtype=dtype)
    entry, recon = MinMaxUInt8(chunk=64).compress(x)
    out = gradwire.decode(write_frame([entry]))
    assert out.dtype == dtype and torch.equal(out, recon)


def test_error_feedback_keeps_the_sum_of_decoded_updates_on_the_sum_of_inputs():
    ef = ErrorFeedback(MinMaxUInt8(chunk=256))
    sum_in, sum_out = torch.zeros(2048), torch.zeros(2048)
    for t in range(20):
        g = _rand((2048,), seed=100 + t) + 0.01
        sum_in += g
        sum_out += gradwire.decode(ef.encode(g, "w", round=t))
    gap = (sum_out - sum_in).norm()
    assert gap == pytest.approx(ef.residual("w").norm().item(), rel=1e-3, abs=1e-5)
    assert gap < 0.01 * sum_in.norm()


def test_non_finite_input_is_rejected():
    x = _rand((10,))
    x[2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        MinMaxUInt8().compress(x)
    with pytest.raises(ValueError, match="non-finite"):
        MinMaxUInt8().compress(torch.tensor([-3e38, 3e38]))


@pytest.mark.parametrize("chunk", [0, -1, 1 << 31])
def test_bad_chunk_is_rejected(chunk):
    with pytest.raises(ValueError):
        MinMaxUInt8(chunk=chunk)


def test_make_codec_and_top_level_export():
    assert isinstance(gradwire.make_codec("minmax", chunk=8), gradwire.MinMaxUInt8)


# ---------------------------------------------------------------------------------------------
# Hostile records


def _good():
    return MinMaxUInt8(chunk=4).compress(_rand((10,), seed=6), "w")[0]


def _mutate(**kw):
    e = _good()
    for k, v in kw.items():
        setattr(e, k, v)
    return e


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: _mutate(params=b""), "params must be 4 bytes"),
        (lambda: _mutate(params=struct.pack("<I", 0)), "chunk must lie"),
        (lambda: _mutate(params=struct.pack("<I", 3)), "ceil\\(numel / chunk\\)"),
        (lambda: _mutate(sections={k: v for k, v in _good().sections.items() if k != "max"}), "'max' is missing"),
        (lambda: _mutate(sections={**_good().sections, "x": np.zeros(1, np.uint8)}), "unexpected section"),
        (
            lambda: _mutate(
                sections={
                    "max": _good().sections["max"],
                    "min": _good().sections["min"],
                    "codes": _good().sections["codes"],
                }
            ),
            "order",
        ),
        (lambda: _mutate(sections={**_good().sections, "codes": np.zeros(9, np.uint8)}), "numel"),
        (
            lambda: _mutate(sections={**_good().sections, "min": _good().sections["min"].astype(np.float64)}),
            "element type",
        ),
        (lambda: _mutate(sections={**_good().sections, "min": np.array([0, np.nan, 0], np.float32)}), "finite"),
        (lambda: _mutate(sections={**_good().sections, "min": np.array([9, 9, 9], np.float32)}), "max must be >="),
        (
            lambda: _mutate(
                sections={**_good().sections, "min": np.full(3, -3e38, np.float32), "max": np.full(3, 3e38, np.float32)}
            ),
            "max - min",
        ),
    ],
)
def test_malformed_records_raise_frame_errors_naming_the_rule(make, rule):
    frame = write_frame([make()])
    with pytest.raises(FrameError, match=rule):
        gradwire.decode(frame)


def test_hand_built_entry_with_an_integer_dtype_is_rejected():
    e = _good()
    e.dtype = torch.int32  # frames cannot carry this, but decode_entry takes hand-built entries too
    with pytest.raises(FrameError, match="dtype"):
        gradwire.decode_entry(e)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_matches_cpu():
    x = _rand((5000,), seed=7)
    entry_c, recon_c = MinMaxUInt8(chunk=512).compress(x.cuda())
    entry, recon = MinMaxUInt8(chunk=512).compress(x)
    assert recon_c.device.type == "cuda"
    assert np.array_equal(entry.sections["codes"], entry_c.sections["codes"])
    out = gradwire.decode(write_frame([entry_c]), device="cuda")
    assert torch.equal(out, recon_c)
    torch.testing.assert_close(recon_c.cpu(), recon)
