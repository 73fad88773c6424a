"""gradwire.panthalia: the Panthalia description's functions under their names and signatures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.panthalia import (
    chunked_dct_decode_int8,
    chunked_dct_encode_int8,
    dct_1d_naive,
    dct_nd_naive,
    float_to_int8,
    idct_1d_naive,
    idct_nd_naive,
    int8_to_float,
)

SETTINGS = settings(max_examples=25, deadline=None)


def _rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------------------------
# Transforms


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_dct_1d_naive_matches_scipy_and_inverts(dim):
    x = _rand((4, 6, 5), torch.float64, seed=1)
    X = dct_1d_naive(x, norm="ortho", dim=dim)
    np.testing.assert_allclose(X.numpy(), scipy.fft.dct(x.numpy(), axis=dim, norm="ortho"), atol=1e-12)
    torch.testing.assert_close(idct_1d_naive(X, norm="ortho", dim=dim), x, atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(9,), (4, 6), (3, 4, 5)])
def test_dct_nd_naive_transforms_every_dimension(shape):
    x = _rand(shape, torch.float64, seed=2)
    X = dct_nd_naive(x)
    np.testing.assert_allclose(X.numpy(), scipy.fft.dctn(x.numpy(), norm="ortho"), atol=1e-12)
    torch.testing.assert_close(idct_nd_naive(X), x, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: dct_1d_naive(x, norm=None),
        lambda x: idct_1d_naive(x, norm="backward"),
        lambda x: dct_nd_naive(x, norm="forward"),
        lambda x: idct_nd_naive(x, norm=None),
        lambda x: chunked_dct_encode_int8(x, (4, 4), 2, norm=None),
    ],
)
def test_norm_other_than_ortho_is_rejected(call):
    with pytest.raises(ValueError, match="ortho"):
        call(torch.randn(4, 4))


def test_decode_rejects_norm_other_than_ortho():
    enc = chunked_dct_encode_int8(torch.randn(4, 4), (4, 4), 2)
    with pytest.raises(ValueError, match="ortho"):
        chunked_dct_decode_int8(*enc[:4], (4, 4), (4, 4), norm=None)


# ---------------------------------------------------------------------------------------------
# Quantization


def test_float_to_int8_shapes_and_dtypes():
    v = _rand((5, 7), seed=3)
    q, scales, mins = float_to_int8(v)
    assert q.shape == (5, 7) and q.dtype == torch.int8
    assert scales.shape == (5,) and mins.shape == (5,)
    assert scales.dtype == torch.float32 and mins.dtype == torch.float32
    torch.testing.assert_close(mins, v.min(dim=1).values)
    torch.testing.assert_close(scales, (v.max(dim=1).values - v.min(dim=1).values) / 255)


@given(seed=st.integers(0, 2**16), batch=st.integers(1, 6), k=st.integers(1, 40))
@SETTINGS
def test_int8_round_trip_within_half_a_step(seed, batch, k):
    v = _rand((batch, k), seed=seed) * 3
    q, scales, mins = float_to_int8(v)
    back = int8_to_float(q, scales, mins)
    assert back.shape == v.shape and back.dtype == torch.float32
    assert torch.all((back - v).abs() <= 0.5 * scales[:, None] + 1e-6)
    # Requantizing the dequantized values gives the same codes.
    assert torch.equal(float_to_int8(back)[0], q)


def test_int8_to_float_formula():
    q = torch.tensor([[-128, 0, 127]], dtype=torch.int8)
    out = int8_to_float(q, torch.tensor([0.5]), torch.tensor([-1.0]))
    assert out.tolist() == [[-1.0, 63.0, 126.5]]


# ---------------------------------------------------------------------------------------------
# Chunked encode / decode


def test_encode_returns_panthalia_shapes_and_dtypes():
    x = _rand((100, 70), seed=4)
    idxs, vals, scales, mins, err, pad = chunked_dct_encode_int8(x, (64, 64), 8)
    n = math.ceil(7000 / 4096)
    assert idxs.shape == (n, 8) and idxs.dtype == torch.int64
    assert vals.shape == (n, 8) and vals.dtype == torch.int8
    assert scales.shape == (n,) and mins.shape == (n,)
    assert err.shape == x.shape and err.dtype == torch.float32
    assert pad == n * 4096 - 7000 and isinstance(pad, int)
    # Positions ascending within each chunk.
    assert torch.all(idxs[:, 1:] > idxs[:, :-1])


def test_new_error_is_input_minus_decoded():
    x = _rand((50, 33), seed=5)
    prev = _rand((50, 33), seed=6) * 0.1
    idxs, vals, scales, mins, err, pad = chunked_dct_encode_int8(x, (8, 8), 5, prev_error=prev)
    dec = chunked_dct_decode_int8(idxs, vals, scales, mins, x.shape, (8, 8), pad_count=pad)
    assert dec.shape == x.shape
    torch.testing.assert_close(err, (x + prev) - dec, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "shape, chunk_shape",
    [((64, 64), (64, 64)), ((100, 70), (64, 64)), ((37,), (8,)), ((3, 5, 7), (4, 4, 4)), ((10, 10), (16,))],
)
def test_full_k_reconstructs_within_quantization_error(shape, chunk_shape):
    x = _rand(shape, seed=7)
    c = math.prod(chunk_shape)
    idxs, vals, scales, mins, err, pad = chunked_dct_encode_int8(x, chunk_shape, c)
    dec = chunked_dct_decode_int8(idxs, vals, scales, mins, shape, chunk_shape, norm="ortho", pad_count=pad)
    # Orthonormal transform: each chunk's L2 error equals its coefficients' error, <= sqrt(C) * scale/2.
    flat = torch.cat([(x - dec).reshape(-1), torch.zeros(pad)]).reshape(-1, c)
    bound = math.sqrt(c) * scales / 2 + 1e-5
    assert torch.all(flat.norm(dim=1) <= bound)
    assert (x - dec).abs().max() < 0.1


def test_small_k_keeps_the_largest_coefficients():
    # A chunk that is exactly two DCT basis functions is captured by k=2.
    from gradwire.dct import idct_nd

    coeffs = torch.zeros(8, 8)
    coeffs[0, 1], coeffs[3, 2] = 5.0, -3.0
    x = idct_nd(coeffs)
    idxs, vals, scales, mins, err, pad = chunked_dct_encode_int8(x, (8, 8), 2)
    assert idxs.tolist() == [[1, 26]]
    assert err.abs().max() < 1e-5


def test_tensor_valued_chunk_shape_and_k_are_accepted():
    x = _rand((40, 30), seed=8)
    out_t = chunked_dct_encode_int8(x, torch.tensor([16, 16]), torch.tensor(10))
    out_i = chunked_dct_encode_int8(x, (16, 16), 10)
    for a, b in zip(out_t[:5], out_i[:5]):
        assert torch.equal(a, b)
    pad = out_t[5]
    assert isinstance(pad, torch.Tensor) and pad.ndim == 0 and pad.item() == out_i[5] == 256 * 5 - 1200
    dec_t = chunked_dct_decode_int8(*out_t[:4], (40, 30), torch.tensor([16, 16]), "ortho", pad)
    dec_i = chunked_dct_decode_int8(*out_i[:4], torch.Size([40, 30]), (16, 16), pad_count=out_i[5])
    assert torch.equal(dec_t, dec_i)


def test_int_chunk_shape_is_a_1d_chunk():
    x = _rand((130,), seed=9)
    idxs, vals, scales, mins, err, pad = chunked_dct_encode_int8(x, 64, 64)
    assert pad == 62 and idxs.shape == (3, 64)
    dec = chunked_dct_decode_int8(idxs, vals, scales, mins, (130,), 64, pad_count=pad)
    assert (dec - x).abs().max() < 0.1


@pytest.mark.parametrize("numel, c, pad", [(4096, 4096, 0), (4097, 4096, 4095), (1, 64, 63), (65, 64, 63)])
def test_pad_count_fills_the_last_chunk(numel, c, pad):
    _, _, _, _, err, got = chunked_dct_encode_int8(_rand((numel,), seed=10), (c,), 1)
    assert got == pad and err.shape == (numel,)


def test_decode_rejects_a_wrong_pad_count():
    enc = chunked_dct_encode_int8(_rand((10,), seed=11), (4,), 2)
    with pytest.raises(ValueError, match="pad_count"):
        chunked_dct_decode_int8(*enc[:4], (10,), (4,), pad_count=0)


def test_k_out_of_range_is_rejected():
    with pytest.raises(ValueError):
        chunked_dct_encode_int8(torch.randn(16), (4,), 5)
    with pytest.raises(ValueError):
        chunked_dct_encode_int8(torch.randn(16), (4,), 0)


def test_chunks_are_transformed_independently():
    # Changing one chunk changes only that chunk's coefficients and reconstruction.
    x = _rand((4, 64), seed=12)
    y = x.clone()
    y[2] += 1.0
    a = chunked_dct_encode_int8(x, (8, 8), 6)
    b = chunked_dct_encode_int8(y, (8, 8), 6)
    for j in (0, 1, 3):
        for t in range(4):
            assert torch.equal(a[t][j], b[t][j])
    assert not torch.equal(a[1][2], b[1][2]) or not torch.equal(a[2][2], b[2][2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype):
    x = _rand((20, 20), dtype, seed=13)
    idxs, vals, scales, mins, err, pad = chunked_dct_encode_int8(x, (8, 8), 64)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert err.dtype == want and scales.dtype == want
    dec = chunked_dct_decode_int8(idxs, vals, scales, mins, x.shape, (8, 8), pad_count=pad)
    assert (dec.to(torch.float64) - x.to(torch.float64)).abs().max() < 0.05
