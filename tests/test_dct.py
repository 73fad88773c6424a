"""gradwire.dct: the orthonormal DCT-II by cached bases, chunking, top-k and int8 quantization."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire import dct as D
from gradwire.dct import basis as B  # owns the one basis cache and its bound; patch them here
from gradwire.dct import transform as T  # owns MATMUL_MAX_N; patch it here

SETTINGS = settings(max_examples=40, deadline=None)

chunk_shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


def _rand(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Basis and transforms


def test_basis_matches_format_definition():
    n = 7
    b = D.dct_basis(n, dtype=torch.float64)
    for f in range(n):
        for i in range(n):
            want = math.sqrt(1 / n) if f == 0 else math.sqrt(2 / n) * math.cos(math.pi * (2 * i + 1) * f / (2 * n))
            assert b[f, i].item() == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 17, 64])
def test_basis_is_orthonormal(n):
    b = D.dct_basis(n, dtype=torch.float64)
    torch.testing.assert_close(b @ b.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


def test_basis_cached_per_size_device_dtype():
    a = D.dct_basis(16, "cpu", torch.float32)
    assert D.dct_basis(16, torch.device("cpu"), torch.float32) is a
    assert D.dct_basis(16, None, torch.float32) is a
    b = D.dct_basis(16, "cpu", torch.float64)
    assert b is not a and b.dtype == torch.float64
    assert D.dct_basis(8, "cpu", torch.float32).shape == (8, 8)
    # The float32 basis is the float64 one rounded once, not computed in float32.
    assert torch.equal(a, b.to(torch.float32))


@given(chunk_shape=chunk_shapes, num_chunks=st.integers(0, 4), seed=st.integers(0, 2**16))
@SETTINGS
def test_dct_chunks_matches_scipy_dctn_per_chunk(chunk_shape, num_chunks, seed):
    x = _rand((num_chunks, *chunk_shape), seed=seed)
    axes = tuple(range(1, 1 + len(chunk_shape)))
    want = scipy.fft.dctn(x.numpy(), axes=axes, norm="ortho")
    got = D.dct_chunks(x)
    assert got.shape == x.shape
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk_shape", [(64,), (8, 8), (64, 64), (4, 5, 6)])
def test_dct_chunks_float32_matches_scipy(chunk_shape):
    x = _rand((3, *chunk_shape), dtype=torch.float32, seed=1)
    axes = tuple(range(1, 1 + len(chunk_shape)))
    want = scipy.fft.dctn(x.double().numpy(), axes=axes, norm="ortho")
    np.testing.assert_allclose(D.dct_chunks(x).double().numpy(), want, atol=2e-5, rtol=0)


@given(chunk_shape=chunk_shapes, num_chunks=st.integers(1, 4), seed=st.integers(0, 2**16))
@SETTINGS
def test_idct_chunks_inverts_dct_chunks(chunk_shape, num_chunks, seed):
    x = _rand((num_chunks, *chunk_shape), seed=seed)
    torch.testing.assert_close(D.idct_chunks(D.dct_chunks(x)), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(D.dct_chunks(D.idct_chunks(x)), x, atol=1e-12, rtol=0)


@given(chunk_shape=chunk_shapes, seed=st.integers(0, 2**16))
@SETTINGS
def test_dct_preserves_energy(chunk_shape, seed):
    x = _rand((3, *chunk_shape), seed=seed)
    X = D.dct_chunks(x)
    assert X.pow(2).sum().item() == pytest.approx(x.pow(2).sum().item(), rel=1e-12)
    # ... and per chunk: the transform is orthonormal within each chunk.
    torch.testing.assert_close(X.pow(2).flatten(1).sum(1), x.pow(2).flatten(1).sum(1), rtol=1e-12, atol=0)


def test_changing_one_chunk_changes_only_its_coefficients():
    x = _rand((5, 8, 8), seed=3)
    y = x.clone()
    y[2] += _rand((8, 8), seed=4)
    X, Y = D.dct_chunks(x), D.dct_chunks(y)
    for j in range(5):
        if j == 2:
            assert not torch.equal(X[j], Y[j])
        else:
            assert torch.equal(X[j], Y[j])


def test_chunk_index_is_never_transformed():
    # One published version also transformed across the chunk index; that would differ from this.
    x = _rand((4, 8, 8), seed=5)
    per_chunk = torch.stack([D.dct_nd(c) for c in x])
    torch.testing.assert_close(D.dct_chunks(x), per_chunk, atol=1e-12, rtol=0)
    assert not torch.allclose(D.dct_chunks(x), D.dct_nd(x))


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_dct_along_one_dim_matches_scipy_dct(dim):
    x = _rand((3, 5, 7), seed=6)
    want = scipy.fft.dct(x.numpy(), axis=dim, norm="ortho")
    np.testing.assert_allclose(D.dct(x, dim).numpy(), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(D.idct(D.dct(x, dim), dim), x, atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
def test_dct_nd_matches_scipy_dctn_over_every_dim(shape):
    x = _rand(shape, seed=7)
    np.testing.assert_allclose(D.dct_nd(x).numpy(), scipy.fft.dctn(x.numpy(), norm="ortho"), atol=1e-12, rtol=0)
    torch.testing.assert_close(D.idct_nd(D.dct_nd(x)), x, atol=1e-12, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 17, 64])
def test_fft_path_matches_scipy_for_every_length(monkeypatch, n):
    monkeypatch.setattr(T, "MATMUL_MAX_N", 0)  # force the FFT path used for long axes
    D.clear_basis_cache()
    x = _rand((3, n, 2), seed=n)
    want = scipy.fft.dctn(x.numpy(), axes=(1, 2), norm="ortho")
    np.testing.assert_allclose(D.dct_chunks(x).numpy(), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(D.idct_chunks(D.dct_chunks(x)), x, atol=1e-12, rtol=0)
    np.testing.assert_allclose(D.dct(x, 1).numpy(), scipy.fft.dct(x.numpy(), axis=1, norm="ortho"), atol=1e-12)
    torch.testing.assert_close(D.idct(D.dct(x, 1), 1), x, atol=1e-12, rtol=0)
    assert {key[0] for key in B._CACHE} == {"twiddle"}  # the FFT path ran, no basis matrix was built


def test_long_axes_never_build_a_basis_matrix():
    D.clear_basis_cache()
    n = T.MATMUL_MAX_N * 3 + 1
    x = _rand((2, n), dtype=torch.float32, seed=9)
    X = D.dct_chunks(x)
    np.testing.assert_allclose(X.double().numpy(), scipy.fft.dct(x.double().numpy(), axis=1, norm="ortho"), atol=1e-4)
    torch.testing.assert_close(D.idct_chunks(X), x, atol=1e-5, rtol=0)
    assert all(key[0] != "basis" for key in B._CACHE)
    assert any(key[0] == "twiddle" for key in B._CACHE)  # the cache looked at is the one the FFT filled


def test_basis_cache_is_bounded(monkeypatch):
    D.clear_basis_cache()
    monkeypatch.setattr(B, "BASIS_CACHE_BYTES", 3 * 64 * 64 * 4)
    for n in (64, 63, 62, 61, 60):
        D.dct_basis(n)
    assert B.cache_bytes() <= 3 * 64 * 64 * 4
    assert [key[1] for key in B._CACHE][-1] == 60  # the most recent stays
    D.clear_basis_cache()


def test_one_clear_basis_cache_forgets_every_basis_of_every_kind(monkeypatch):
    # float bases, the FFT's twiddles, the exact decode's fixed-point bases, whether they fold, and the
    # integer route's digit bases: one cache, one bound, one clear
    from gradwire.dct.integer import integer_basis

    D.clear_basis_cache()
    D.dct_basis(16)
    codec = D.DCTCodec(topk=5, mode="tiles")
    entry, recon = codec.compress(_rand((64, 64), dtype=torch.float32, seed=2))
    integer_basis(64, D.fixed_point_bits((64, 64)), "cpu")
    with monkeypatch.context() as m:
        m.setattr(T, "MATMUL_MAX_N", 0)
        D.dct(_rand((3, 5), seed=1))
    assert {key[0] for key in B._CACHE} == {"basis", "twiddle", "fixed_point", "folds", "integer"}
    assert B.cache_bytes() == sum(B._nbytes(v) for v in B._CACHE.values()) > 0
    D.clear_basis_cache()
    assert not B._CACHE and B.cache_bytes() == 0
    # rebuilt from the same float64 matrix: the same bits
    assert torch.equal(D.parse_record(entry).decode(), recon)


def test_dct_rejects_integer_tensors():
    with pytest.raises(TypeError):
        D.dct(torch.arange(4))


# ---------------------------------------------------------------------------------------------
# Chunking


@given(n=st.integers(1, 5000), cap=st.integers(1, 100))
@SETTINGS
def test_largest_divisor_at_most_is_the_largest_divisor_not_above_cap(n, cap):
    want = max(d for d in range(1, min(n, cap) + 1) if n % d == 0)
    assert D.largest_divisor_at_most(n, cap) == want


def test_largest_divisor_examples():
    assert D.largest_divisor_at_most(4096, 64) == 64
    assert D.largest_divisor_at_most(100, 64) == 50
    assert D.largest_divisor_at_most(97, 64) == 1  # prime
    assert D.largest_divisor_at_most(27, 64) == 27
    assert D.largest_divisor_at_most(1, 64) == 1
    with pytest.raises(ValueError):
        D.largest_divisor_at_most(0, 64)


@given(
    shape=st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple),
    chunk_shape=chunk_shapes,
    seed=st.integers(0, 2**16),
)
@SETTINGS
def test_flat_chunks_pad_and_round_trip(shape, chunk_shape, seed):
    plan = D.plan_flat(shape, chunk_shape)
    c = math.prod(chunk_shape)
    numel = math.prod(shape)
    assert plan.pad_count == (c - numel % c) % c
    assert plan.num_chunks * c == numel + plan.pad_count
    x = _rand(shape, seed=seed)
    chunks = D.to_chunks(x, plan)
    assert chunks.shape == (plan.num_chunks, c)
    # Chunk j is elements [j*C, (j+1)*C) of the flattened, zero-padded tensor.
    flat = torch.cat([x.reshape(-1), torch.zeros(plan.pad_count, dtype=x.dtype)])
    assert torch.equal(chunks.reshape(-1), flat)
    assert torch.equal(D.from_chunks(chunks, plan), x)


@pytest.mark.parametrize(
    "shape, chunk_shape",
    [
        ((4096, 1024), (64, 64)),
        ((100, 30), (50, 30)),
        ((97, 10), (1, 10)),
        ((64, 3, 3, 3), (64, 27)),
        ((6, 0, 5), None),
        ((4096,), (64,)),
        ((97,), (1,)),
        ((), (1,)),
        ((1, 1), (1, 1)),
    ],
)
def test_tile_chunk_shape(shape, chunk_shape):
    if chunk_shape is None:
        with pytest.raises(ValueError):
            D.tile_chunk_shape(shape)
    else:
        assert D.tile_chunk_shape(shape) == chunk_shape


@pytest.mark.parametrize("shape", [(12, 10), (128, 96), (6, 2, 5), (70,), (), (97, 3)])
def test_tiles_hold_their_rows_and_columns(shape):
    x = _rand(shape, seed=8)
    plan = D.plan_tiles(shape)
    chunks = D.to_chunks(x, plan)
    assert plan.pad_count == 0
    assert chunks.shape == (plan.num_chunks, plan.chunk_numel) and plan.num_chunks * plan.chunk_numel == x.numel()
    if len(plan.chunk_shape) == 2:
        (a, b), (gu, gv) = plan.chunk_shape, plan.grid
        m = x.reshape(shape[0], -1)
        for u in range(gu):
            for v in range(gv):
                tile = m[u * a : (u + 1) * a, v * b : (v + 1) * b]
                assert torch.equal(chunks[u * gv + v].reshape(a, b), tile)
    else:
        assert torch.equal(chunks.reshape(-1), x.reshape(-1))
    assert torch.equal(D.from_chunks(chunks, plan), x)


def test_from_chunks_checks_the_chunk_count():
    plan = D.plan_flat((10,), (4,))
    with pytest.raises(ValueError):
        D.from_chunks(torch.zeros(2, 4), plan)


# ---------------------------------------------------------------------------------------------
# Top-k and quantization


def test_select_topk_keeps_largest_magnitudes_sorted_ascending():
    coeffs = torch.tensor([[0.1, -5.0, 3.0, 0.2, -4.0], [1.0, 2.0, -3.0, 4.0, 0.0]])
    idx, vals = D.select_topk(coeffs, 3)
    assert idx.tolist() == [[1, 2, 4], [1, 2, 3]]
    assert vals.tolist() == [[-5.0, 3.0, -4.0], [2.0, -3.0, 4.0]]
    assert idx.dtype == torch.int64
    with pytest.raises(ValueError):
        D.select_topk(coeffs, 6)
    with pytest.raises(ValueError):
        D.select_topk(coeffs, 0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 70), k_frac=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_select_topk_on_the_cpu_picks_what_torch_topk_picks_where_magnitudes_differ(rows, cols, k_frac, seed):
    gen = torch.Generator().manual_seed(seed)
    coeffs = torch.randn(rows, cols, generator=gen)  # distinct magnitudes (almost surely)
    k = 1 + int((cols - 1) * k_frac)
    idx, vals = D.select_topk(coeffs, k)
    _, want = torch.topk(coeffs.abs(), k, dim=1)
    assert torch.equal(idx, torch.sort(want, dim=1).values)
    assert torch.equal(vals, torch.gather(coeffs, 1, idx)) and idx.dtype == torch.int64


def test_select_topk_on_the_cpu_gives_ties_to_the_lowest_positions_and_ranks_nan_first():
    coeffs = torch.tensor(
        [
            [0.0, -2.0, 2.0, 1.0, -2.0, 0.0],
            [0.0, 0.0, -0.0, 0.0, 0.0, 0.0],
            [1.0, float("nan"), -float("inf"), 3.0, 0.0, 2.0],
        ]
    )
    idx, vals = D.select_topk(coeffs, 2)
    assert idx.tolist() == [[1, 2], [0, 1], [1, 2]]
    assert vals[0].tolist() == [-2.0, 2.0] and math.isnan(vals[2, 0].item())
    # A strided view gives the same selection; so does float64 (torch.topk) where there is no tie.
    assert torch.equal(D.select_topk(coeffs.t().contiguous().t(), 2)[0], idx)
    assert torch.equal(D.select_topk(coeffs[2:].double(), 2)[0], idx[2:])


def test_quantize_maps_min_and_max_to_int8_ends():
    v = torch.tensor([[-1.0, 0.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    q, scales, mins = D.quantize_int8(v)
    assert q.dtype == torch.int8 and scales.shape == (2,) and mins.shape == (2,)
    assert q[0, 0] == -128 and q[0, 2] == 127
    assert scales[0].item() == pytest.approx(3.0 / 255)
    assert scales[1].item() == pytest.approx(1e-8 / 255)  # constant row: range floored at 1e-8
    assert torch.all(q[1] == -128)
    torch.testing.assert_close(D.dequantize_int8(q, scales, mins)[1], v[1])


def test_quantize_rounds_half_to_even():
    # min 0, max 255 -> scale 1; 0.5 -> 0 and 2.5 -> 2 (half-even), then -128.
    v = torch.tensor([[0.0, 0.5, 2.5, 3.5, 255.0]])
    q, scales, _ = D.quantize_int8(v)
    assert scales.item() == 1.0
    assert (q[0].to(torch.int32) + 128).tolist() == [0, 0, 2, 4, 255]


@given(seed=st.integers(0, 2**16), k=st.integers(1, 50))
@SETTINGS
def test_dequantize_within_half_a_step(seed, k):
    v = _rand((4, k), dtype=torch.float32, seed=seed) * 10
    q, scales, mins = D.quantize_int8(v)
    err = (D.dequantize_int8(q, scales, mins) - v).abs()
    assert torch.all(err <= scales[:, None] * 0.5 + 1e-5)
