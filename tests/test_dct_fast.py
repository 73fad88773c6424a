"""The native 2-D DCT (gradwire._native.dct2_chunks, Lee's recursion) that dct_chunks/idct_chunks take for
float32 CPU tiles with power-of-two sides: the textbook transform within float32 rounding, the same bits
on any thread count, and a named error for a shape it cannot cut."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire import WireError, _native
from gradwire.dct import transform as T
from gradwire.dct.basis import basis_f64


def _reference(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The orthonormal 2-D transform of each chunk by float64 basis matrices."""
    rows, cols = x.shape[-2:]
    dr, dc = basis_f64(rows), basis_f64(cols)
    x64 = x.to(torch.float64)
    if inverse:
        return dr.T @ x64 @ dc
    return dr @ x64 @ dc.T


@pytest.mark.parametrize("rows, cols", [(64, 64), (8, 32), (32, 8), (1, 16), (16, 1), (2, 2), (128, 4)])
@pytest.mark.parametrize("inverse", [False, True])
def test_native_tiles_match_the_textbook_transform(rows, cols, inverse):
    x = torch.randn(5, rows, cols, generator=torch.Generator().manual_seed(rows * 7 + cols))
    assert T._fast_2d(x, 2)
    got = T.idct_chunks(x) if inverse else T.dct_chunks(x)
    want = _reference(x, inverse)
    norm = x.to(torch.float64).flatten(1).norm(dim=1).max()
    assert (got.to(torch.float64) - want).abs().max() <= 1e-6 * norm * max(rows, cols) ** 0.5
    back = T.dct_chunks(got) if inverse else T.idct_chunks(got)
    assert (back - x).abs().max() <= 1e-6 * norm


def test_native_bits_do_not_depend_on_the_thread_count():
    x = torch.randn(131, 64, 64, generator=torch.Generator().manual_seed(3)).reshape(-1).numpy()  # 8 threads' worth
    outs = []
    for threads in (1, 2, 5):
        y = x.copy()
        _native.dct2_chunks(y, 64, 64, False, threads)
        outs.append(y)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_other_tiles_keep_the_matrix_products():
    x = torch.randn(3, 6, 10, dtype=torch.float32)
    assert not T._fast_2d(x, 2)
    assert not T._fast_2d(x.to(torch.float64)[:, :4, :8], 2)
    torch.testing.assert_close(T.dct_chunks(x).to(torch.float64), _reference(x, False), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows, cols, n", [(3, 4, 24), (64, 64, 100), (2048, 1, 2048), (0, 8, 8)])
def test_a_shape_it_cannot_cut_is_a_named_error_and_writes_nothing(rows, cols, n):
    data = np.arange(n, dtype=np.float32)
    with pytest.raises(WireError, match="cannot transform") as info:
        _native.dct2_chunks(data, rows, cols, False, 1)
    assert info.value.kind == "transform_shape"
    assert np.array_equal(data, np.arange(n, dtype=np.float32))
