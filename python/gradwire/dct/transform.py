"""The orthonormal DCT-II (by cached basis matrices, or an FFT for long axes), per axis, per tensor, per chunk.

Everything here is plain torch and device-agnostic: the transforms are matrix products with the bases of
:mod:`.basis` (the one cache), so they run wherever the tensor lives. One exception: float32 batches of
2-D chunks with power-of-two sides on the CPU (the codecs' tiles, :func:`native_tiles`) go to
``gradwire._native.dct2_chunks`` (Lee's recursion): fewer multiplications than the products, and the
same bits whatever the thread count.

A chunk of shape ``(n_1, ..., n_d)`` is transformed by a 1-D DCT along each of *its* dimensions — never
across the chunk index of a batch of chunks (docs/FORMAT.md §5.2). This equals
``scipy.fft.dctn(x, norm="ortho")``; the inverse uses the transposed matrices.
"""

from __future__ import annotations

import math

import torch

from .. import _native
from .basis import cached, dct_basis, device_key
from .chunks import ChunkPlan, to_chunks

__all__ = [
    "MATMUL_MAX_N",
    "dct",
    "dct_chunks",
    "dct_nd",
    "encode_chunks",
    "idct",
    "idct_chunks",
    "idct_nd",
    "native_tiles",
]

#: Axes up to this length are transformed by a cached basis matrix; longer ones (a 1-D chunk of up
#: to 2^24 elements is a valid record) by an O(n log n) FFT, so no n×n matrix is ever built for them.
MATMUL_MAX_N = 1024


def _twiddle(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``s_k * exp(-i pi k / (2n))`` with the orthonormal scale ``s_k``, complex, for the FFT path."""

    def build():
        k = torch.arange(n, dtype=torch.float64)
        s = torch.full((n,), math.sqrt(2.0 / n), dtype=torch.float64)
        s[0] = math.sqrt(1.0 / n)
        w = torch.polar(s, -math.pi * k / (2.0 * n))
        return w.to(device=device, dtype=torch.complex128 if dtype == torch.float64 else torch.complex64)

    return cached(("twiddle", n, device_key(device), dtype), build)


def _fft_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dct_last_fft(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II along the last axis by one complex FFT (Makhoul's reordering)."""
    n = x.shape[-1]
    y = x.to(_fft_dtype(x.dtype))
    v = torch.cat([y[..., ::2], y[..., 1::2].flip(-1)], dim=-1)
    out = (torch.fft.fft(v, dim=-1) * _twiddle(n, y.device, y.dtype)).real
    return out.to(x.dtype)


def _idct_last_fft(X: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_dct_last_fft` along the last axis."""
    n = X.shape[-1]
    Y = X.to(_fft_dtype(X.dtype))
    w = _twiddle(n, Y.device, Y.dtype)
    c = Y / w.abs()  # undo the orthonormal scale: the cosine sums C_k
    c_rev = torch.cat([torch.zeros_like(c[..., :1]), c.flip(-1)[..., :-1]], dim=-1)  # C_{n-k}, C_n = 0
    # exp(-i pi k/2n) V_k = C_k - i C_{n-k}, so V_k = conj(w_k / s_k) (C_k - i C_{n-k})
    v = torch.fft.ifft(torch.complex(c, -c_rev) * (w / w.abs()).conj(), dim=-1).real
    m = (n + 1) // 2
    out = torch.empty_like(v)
    out[..., ::2] = v[..., :m]
    out[..., 1::2] = v[..., m:].flip(-1)
    return out.to(X.dtype)


def _apply_last(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The 1-D transform along the last axis of ``x``."""
    n = x.shape[-1]
    if n > MATMUL_MAX_N:
        return _idct_last_fft(x) if inverse else _dct_last_fft(x)
    d = dct_basis(n, x.device, x.dtype)
    # forward: X[..., f] = sum_n D[f, n] x[..., n]; inverse: x[..., n] = sum_f D[f, n] X[..., f]
    return x @ (d if inverse else d.T)


def _apply_along(x: torch.Tensor, dim: int, inverse: bool) -> torch.Tensor:
    return torch.movedim(_apply_last(torch.movedim(x, dim, -1), inverse), -1, dim)


def _check_float(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"DCT needs a floating-point tensor, got {x.dtype}")


def dct(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Orthonormal DCT-II of ``x`` along ``dim`` (``scipy.fft.dct(x, norm="ortho", axis=dim)``)."""
    _check_float(x)
    return _apply_along(x, dim, inverse=False)


def idct(X: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`dct` along ``dim`` (orthonormal DCT-III)."""
    _check_float(X)
    return _apply_along(X, dim, inverse=True)


def native_tiles(dims) -> bool:
    """Whether float32 chunks of shape ``dims`` take the CPU's Rust transform: two dimensions, each a power
    of two up to :data:`MATMUL_MAX_N` (the codecs' tiles). It transforms chunk by chunk, so its bits do not
    depend on how many chunks a batch holds."""
    return len(dims) == 2 and all(0 < n <= MATMUL_MAX_N and n & (n - 1) == 0 for n in dims)


def _fast_2d(x: torch.Tensor, ndim: int) -> bool:
    """Whether :func:`_transform_trailing` takes the native route: float32 on the CPU, chunks of
    :func:`native_tiles`."""
    if ndim != 2 or x.device.type != "cpu" or x.dtype != torch.float32 or x.numel() == 0:
        return False
    return native_tiles(x.shape[-2:])


def _transform_trailing(x: torch.Tensor, ndim: int, inverse: bool, overwrite: bool = False) -> torch.Tensor:
    """1-D transforms along each of the last ``ndim`` dimensions of ``x``; with ``overwrite`` (``x`` is the
    caller's own scratch tensor) the native route transforms ``x`` itself, in place, where it can."""
    _check_float(x)
    if ndim > x.ndim:
        raise ValueError(f"cannot transform {ndim} dimensions of a {x.ndim}-D tensor")
    lead = x.ndim - ndim
    shape = tuple(x.shape)
    if _fast_2d(x, ndim):
        # Lee's recursion in gradwire._native: n/2·log2(n) multiplications per length-n transform against
        # the products' n², and the same bits on every CPU and thread count (the server's AdamW close
        # runs two of these over the whole model each round).
        if overwrite and x.is_contiguous() and not x.requires_grad:
            y = x  # the caller's scratch (a tile cut copies already): no second pass over memory
        else:
            y = torch.empty(shape, dtype=x.dtype).copy_(x.detach())  # one copy, contiguous, the input untouched
        _native.dct2_chunks(y.view(-1).numpy(), shape[-2], shape[-1], inverse, torch.get_num_threads())
        return y
    y = x.contiguous()
    for axis in range(lead, x.ndim):
        n = shape[axis]
        if n > MATMUL_MAX_N:
            y = _apply_along(y, axis, inverse).contiguous()
            continue
        d = dct_basis(n, y.device, y.dtype)
        # forward: X[f] = sum_n D[f, n] x[n]; inverse: x[n] = sum_f D[f, n] X[f]. Each product keeps
        # the layout (no permuted copies): the last axis as (rows, n) @ (n, n), any other axis as a
        # batch of (n, n) @ (n, trailing) products.
        if axis == x.ndim - 1:
            y = (y.reshape(-1, n) @ (d if inverse else d.T)).reshape(shape)
        else:
            trailing = math.prod(shape[axis + 1 :])
            y = torch.matmul(d.T if inverse else d, y.reshape(-1, n, trailing)).reshape(shape)
    return y.reshape(shape)


def dct_chunks(chunks: torch.Tensor, *, overwrite: bool = False) -> torch.Tensor:
    """Transform a batch of chunks ``(num_chunks, *chunk_shape)``: an n-D DCT per chunk.

    Each chunk is transformed along each of its own dimensions; dimension 0, the chunk index, is never
    transformed, so changing one chunk changes only that chunk's coefficients. ``overwrite``: ``chunks``
    is the caller's scratch, which the CPU's Rust transform may turn into the result in place (the same
    bits, one pass over memory fewer).
    """
    if chunks.ndim < 2:
        raise ValueError(f"expected (num_chunks, *chunk_shape), got shape {tuple(chunks.shape)}")
    return _transform_trailing(chunks, chunks.ndim - 1, inverse=False, overwrite=overwrite)


def idct_chunks(coeffs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct_chunks`."""
    if coeffs.ndim < 2:
        raise ValueError(f"expected (num_chunks, *chunk_shape), got shape {tuple(coeffs.shape)}")
    return _transform_trailing(coeffs, coeffs.ndim - 1, inverse=True)


def dct_nd(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II along every dimension of ``x`` (``scipy.fft.dctn(x, norm="ortho")``)."""
    if x.ndim == 0 or x.numel() == 0:
        _check_float(x)
        return x.clone()
    return _transform_trailing(x.unsqueeze(0), x.ndim, inverse=False).squeeze(0)


def idct_nd(X: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct_nd`."""
    if X.ndim == 0 or X.numel() == 0:
        _check_float(X)
        return X.clone()
    return _transform_trailing(X.unsqueeze(0), X.ndim, inverse=True).squeeze(0)


def encode_chunks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """The DCT coefficients ``(num_chunks, C)`` of ``x`` cut per ``plan`` (in ``x``'s dtype)."""
    n = plan.num_chunks
    chunks = to_chunks(x, plan).reshape(n, *plan.chunk_shape)
    if chunks.ndim < 2:
        raise ValueError(f"expected (num_chunks, *chunk_shape), got shape {tuple(chunks.shape)}")
    # Cutting tiles (or padding) copies already: that copy is transformed in place, never x itself.
    fresh = chunks.numel() > 0 and chunks.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    return _transform_trailing(chunks, chunks.ndim - 1, inverse=False, overwrite=fresh).reshape(n, plan.chunk_numel)
