"""The orthonormal DCT-II by cached basis matrices, and the two ways of cutting a tensor into chunks.

Everything here is plain torch and device-agnostic: bases are built once in float64 and cached per
``(n, device, dtype)``; transforms are matrix products, so they run wherever the tensor lives.

Transform (docs/FORMAT.md §5.2). With ``D_N[f, n] = sqrt(2/N) cos(pi (2n + 1) f / (2N))`` for
``f >= 1`` and ``D_N[0, n] = sqrt(1/N)``, a chunk of shape ``(n_1, ..., n_d)`` is transformed by a 1-D
DCT along each of *its* dimensions — never across the chunk index of a batch of chunks. This equals
``scipy.fft.dctn(x, norm="ortho")``; the inverse uses the transposed matrices.

Chunking:

- mode 0, :data:`MODE_FLAT` (Panthalia): flatten, zero-pad to a multiple of ``C = prod(chunk_shape)``,
  cut into consecutive chunks;
- mode 1, :data:`MODE_TILES` (DeMo): view the tensor as a matrix ``(shape[0], numel / shape[0])`` (a
  vector if ``ndim <= 1``) and cut it into tiles whose sides are the largest divisors ``<= 64``.
  Where that gives small tiles (:func:`small_tiles`: a 431,463-element vector is 3 × 143,821, a
  103-row embedding has 1-row tiles) an encoder falls back to mode 0 (:func:`plan_tiles_or_flat`).

A :class:`ChunkPlan` records one such cut; :func:`to_chunks` and :func:`from_chunks` move between a
tensor and the flat-chunk layout ``(num_chunks, C)``.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import _native

__all__ = [
    "BASIS_CACHE_BYTES",
    "MATMUL_MAX_N",
    "MAX_TILE",
    "MIN_RANGE",
    "MODE_FLAT",
    "MODE_TILES",
    "ChunkPlan",
    "clear_basis_cache",
    "dct",
    "dct_basis",
    "dct_chunks",
    "dct_nd",
    "decode_chunks",
    "dequantize_int8",
    "encode_chunks",
    "from_chunks",
    "idct",
    "idct_chunks",
    "decode_levels",
    "decode_levels_weighted_sum",
    "fixed_point_bits",
    "idct_nd",
    "largest_divisor_at_most",
    "plan_chunks",
    "plan_flat",
    "plan_tiles",
    "plan_tiles_or_flat",
    "small_tiles",
    "quantize_int8",
    "select_topk",
    "tile_chunk_shape",
    "to_chunks",
]

MODE_FLAT = 0
MODE_TILES = 1
#: The largest tile side of mode 1.
MAX_TILE = 64

# ---------------------------------------------------------------------------------------------
# Bases

#: Axes up to this length are transformed by a cached basis matrix; longer ones (a 1-D chunk of up
#: to 2^24 elements is a valid record) by an O(n log n) FFT, so no n×n matrix is ever built for them.
MATMUL_MAX_N = 1024
#: Bytes of bases the cache keeps (least recently used evicted first). Bounded so that records with
#: many different chunk sizes cannot grow it without limit.
BASIS_CACHE_BYTES = 256 << 20

_BASES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_BASES_LOCK = threading.Lock()
_cache_bytes = 0


def _basis_f64(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2.0 * i[None, :] + 1.0) * i[:, None] / (2.0 * n))  # [f, n]
    d *= math.sqrt(2.0 / n)
    d[0] = math.sqrt(1.0 / n)
    return d


def _norm_device(device) -> torch.device:
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _cached(key: tuple, build) -> torch.Tensor:
    global _cache_bytes
    with _BASES_LOCK:
        t = _BASES.get(key)
        if t is not None:
            _BASES.move_to_end(key)
            return t
    t = build()
    size = t.numel() * t.element_size()
    with _BASES_LOCK:
        if key in _BASES:
            return _BASES[key]
        if size <= BASIS_CACHE_BYTES:
            _BASES[key] = t
            _cache_bytes += size
            while _cache_bytes > BASIS_CACHE_BYTES:
                _, old = _BASES.popitem(last=False)
                _cache_bytes -= old.numel() * old.element_size()
    return t


def dct_basis(n: int, device: Optional[torch.device | str] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D_n`` (``X = D_n @ x``), cached per ``(n, device, dtype)``.

    Built in float64 on the CPU and cast, so every device and dtype holds the same rounded basis.
    The returned tensor is shared: do not modify it in place.
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"DCT size must be >= 1, got {n}")
    if not dtype.is_floating_point:
        raise ValueError(f"DCT basis dtype must be floating point, got {dtype}")
    dev = _norm_device(device)
    return _cached(("basis", n, dev, dtype), lambda: _basis_f64(n).to(device=dev, dtype=dtype))


def _twiddle(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``s_k * exp(-i pi k / (2n))`` with the orthonormal scale ``s_k``, complex, for the FFT path."""

    def build():
        k = torch.arange(n, dtype=torch.float64)
        s = torch.full((n,), math.sqrt(2.0 / n), dtype=torch.float64)
        s[0] = math.sqrt(1.0 / n)
        w = torch.polar(s, -math.pi * k / (2.0 * n))
        return w.to(device=device, dtype=torch.complex128 if dtype == torch.float64 else torch.complex64)

    return _cached(("twiddle", n, device, dtype), build)


def clear_basis_cache() -> None:
    """Forget every cached basis (frees their memory)."""
    global _cache_bytes
    with _BASES_LOCK:
        _BASES.clear()
        _cache_bytes = 0


# ---------------------------------------------------------------------------------------------
# Transforms


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


def _transform_trailing(x: torch.Tensor, ndim: int, inverse: bool) -> torch.Tensor:
    """1-D transforms along each of the last ``ndim`` dimensions of ``x``."""
    _check_float(x)
    if ndim > x.ndim:
        raise ValueError(f"cannot transform {ndim} dimensions of a {x.ndim}-D tensor")
    lead = x.ndim - ndim
    shape = tuple(x.shape)
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
            trailing = _prod(shape[axis + 1:])
            y = torch.matmul(d.T if inverse else d, y.reshape(-1, n, trailing)).reshape(shape)
    return y.reshape(shape)


def dct_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """Transform a batch of chunks ``(num_chunks, *chunk_shape)``: an n-D DCT per chunk.

    Each chunk is transformed along each of its own dimensions; dimension 0, the chunk index, is never
    transformed, so changing one chunk changes only that chunk's coefficients.
    """
    if chunks.ndim < 2:
        raise ValueError(f"expected (num_chunks, *chunk_shape), got shape {tuple(chunks.shape)}")
    return _transform_trailing(chunks, chunks.ndim - 1, inverse=False)


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


# ---------------------------------------------------------------------------------------------
# Chunking


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is ``<= cap`` (``n >= 1``, ``cap >= 1``)."""
    n, cap = int(n), int(cap)
    if n < 1 or cap < 1:
        raise ValueError(f"need n >= 1 and cap >= 1, got n={n}, cap={cap}")
    if n <= cap:
        return n
    # Scan divisor pairs up to sqrt(n): O(sqrt(n)) rather than O(cap) for large caps.
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            if i <= cap and i > best:
                best = i
            j = n // i
            if j <= cap and j > best:
                best = j
        i += 1
    return best


def _prod(dims: Sequence[int]) -> int:
    p = 1
    for d in dims:
        p *= int(d)
    return p


@dataclass(frozen=True)
class ChunkPlan:
    """How a tensor of ``shape`` is cut into ``num_chunks`` chunks of ``chunk_shape``.

    ``grid`` is the tile grid ``(R // a, S // b)`` (or ``(numel // a,)``) of mode 1, and ``()`` in
    mode 0.
    """

    mode: int
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    pad_count: int
    num_chunks: int
    grid: tuple[int, ...] = ()

    @property
    def chunk_numel(self) -> int:
        """``C``, the element count of one chunk."""
        return _prod(self.chunk_shape)

    @property
    def numel(self) -> int:
        return _prod(self.shape)


def plan_flat(shape: Sequence[int], chunk_shape: Sequence[int]) -> ChunkPlan:
    """Mode 0: flatten, zero-pad to a multiple of ``C``, consecutive chunks of ``chunk_shape``."""
    shape = tuple(int(d) for d in shape)
    chunk_shape = tuple(int(d) for d in chunk_shape)
    if not chunk_shape or any(d < 1 for d in chunk_shape):
        raise ValueError(f"chunk_shape must be non-empty with every dimension >= 1, got {chunk_shape}")
    c = _prod(chunk_shape)
    numel = _prod(shape)
    pad = (c - numel % c) % c
    return ChunkPlan(MODE_FLAT, shape, chunk_shape, pad, (numel + pad) // c)


def _matrix_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    numel = _prod(shape)
    if len(shape) >= 2:
        return (shape[0], numel // shape[0])
    return (numel,)


def tile_chunk_shape(shape: Sequence[int], max_tile: int = MAX_TILE) -> tuple[int, ...]:
    """Mode 1's chunk shape for a tensor of ``shape`` (which must hold at least one element)."""
    shape = tuple(int(d) for d in shape)
    if _prod(shape) < 1:
        raise ValueError(f"tile chunking needs at least one element, got shape {shape}")
    return tuple(largest_divisor_at_most(m, max_tile) for m in _matrix_view(shape))


def plan_tiles(shape: Sequence[int], max_tile: int = MAX_TILE) -> ChunkPlan:
    """Mode 1: the tensor as a matrix ``(shape[0], numel / shape[0])`` (or a vector) cut into tiles."""
    shape = tuple(int(d) for d in shape)
    chunk_shape = tile_chunk_shape(shape, max_tile)
    matrix = _matrix_view(shape)
    grid = tuple(m // c for m, c in zip(matrix, chunk_shape))
    return ChunkPlan(MODE_TILES, shape, chunk_shape, 0, _prod(grid), grid)


def small_tiles(shape: Sequence[int], max_tile: int = MAX_TILE) -> bool:
    """Whether mode 1 would cut a tensor of ``shape`` into *small* tiles: tiles of fewer than a quarter of
    ``min(numel, max_tile^d)`` elements, ``d`` the matrix view's rank (1 for vectors, else 2).

    A full tile (64×64, or 64 for a vector) or a whole tensor that fits in one is never small; tiles
    below a quarter of that are: the 3-element tiles of a 431,463-element vector (3 × 143,821, a prime),
    the 1×64 tiles of a 103×64 embedding (103 is prime). 48×10 tiles of a 96×10 matrix are not (480 of
    its 960 elements). Empty tensors have no tiles and count as small.
    """
    shape = tuple(int(d) for d in shape)
    numel = _prod(shape)
    if numel < 1:
        return True
    view = _matrix_view(shape)
    full = int(max_tile) ** len(view)
    return 4 * _prod(tile_chunk_shape(shape, max_tile)) < min(numel, full)


def plan_tiles_or_flat(
    shape: Sequence[int], chunk_shape: Sequence[int], max_tile: int = MAX_TILE
) -> ChunkPlan:
    """The tile-mode encoder's plan: :func:`plan_tiles`, or :func:`plan_flat` with ``chunk_shape`` where
    the tiles would be small (:func:`small_tiles`). The record's params say which mode it used, so a
    decoder needs nothing else."""
    if small_tiles(shape, max_tile):
        return plan_flat(shape, chunk_shape)
    return plan_tiles(shape, max_tile)


def plan_chunks(mode: int, shape: Sequence[int], chunk_shape: Optional[Sequence[int]] = None) -> ChunkPlan:
    """:func:`plan_flat` (mode 0, needs ``chunk_shape``) or :func:`plan_tiles` (mode 1)."""
    if mode == MODE_FLAT:
        if chunk_shape is None:
            raise ValueError("mode 0 (flat) needs a chunk_shape")
        return plan_flat(shape, chunk_shape)
    if mode == MODE_TILES:
        return plan_tiles(shape)
    raise ValueError(f"unknown chunking mode {mode}")


def to_chunks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Cut ``x`` (of ``plan.shape``) into the flat-chunk layout ``(num_chunks, C)``."""
    if tuple(x.shape) != plan.shape:
        raise ValueError(f"tensor shape {tuple(x.shape)} does not match the plan's {plan.shape}")
    c = plan.chunk_numel
    if plan.mode == MODE_FLAT:
        flat = x.reshape(-1)
        if plan.pad_count:
            flat = torch.cat([flat, flat.new_zeros(plan.pad_count)])
        return flat.reshape(plan.num_chunks, c)
    if len(plan.chunk_shape) == 1:
        return x.reshape(plan.num_chunks, c)
    (a, b), (gu, gv) = plan.chunk_shape, plan.grid
    tiles = x.reshape(gu, a, gv, b).permute(0, 2, 1, 3)  # (u, v, row-in-tile, col-in-tile)
    return tiles.reshape(plan.num_chunks, c)


def from_chunks(chunks: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Put chunks ``(num_chunks, C)`` (or ``(num_chunks, *chunk_shape)``) back into ``plan.shape``.

    Mode 0 drops the padding; mode 1 puts every tile back in place.
    """
    c = plan.chunk_numel
    if chunks.ndim < 1 or chunks.shape[0] != plan.num_chunks or chunks.numel() != plan.num_chunks * c:
        raise ValueError(
            f"expected {plan.num_chunks} chunks of {c} elements, got shape {tuple(chunks.shape)}"
        )
    flat = chunks.reshape(plan.num_chunks, c)
    if plan.mode == MODE_FLAT:
        out = flat.reshape(-1)
        if plan.pad_count:
            out = out[: out.shape[0] - plan.pad_count]
        return out.reshape(plan.shape)
    if len(plan.chunk_shape) == 1:
        return flat.reshape(plan.shape)
    (a, b), (gu, gv) = plan.chunk_shape, plan.grid
    return flat.reshape(gu, gv, a, b).permute(0, 2, 1, 3).reshape(plan.shape)


# ---------------------------------------------------------------------------------------------
# Top-k selection and per-chunk int8 quantization: the math the DCT codec and the Panthalia API share.

#: Floor of a chunk's value range before it is divided into 255 steps.
MIN_RANGE = 1e-8


def select_topk(coeffs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest magnitude of each row of ``coeffs`` ``(num_chunks, C)``.

    Returns ``(idx, vals)``, both ``(num_chunks, k)``: ``idx`` (int64) ascending within each row, so the
    index set is canonical and decoding is deterministic, and ``vals`` the coefficients at ``idx``.
    Float32 rows on the CPU go through one Rust pass (a select on the magnitudes' bits, then an ascending
    scan: no sort, no abs copy), where ties at the threshold go to the lowest positions; elsewhere
    ``torch.topk`` picks among ties as it likes. NaN counts as the largest magnitude in both.
    """
    if coeffs.ndim != 2:
        raise ValueError(f"expected (num_chunks, C) coefficients, got shape {tuple(coeffs.shape)}")
    k = int(k)
    if not 1 <= k <= coeffs.shape[1]:
        raise ValueError(f"k must lie in [1, {coeffs.shape[1]}] (the chunk size), got {k}")
    if coeffs.device.type == "cpu" and coeffs.dtype == torch.float32:
        n, c = coeffs.shape
        pos, kept = _native.select_topk_rows(coeffs.detach().contiguous().reshape(-1).numpy(), c, k,
                                             torch.get_num_threads())
        return torch.from_numpy(pos).reshape(n, k), torch.from_numpy(kept).reshape(n, k)
    _, idx = torch.topk(coeffs.abs(), k, dim=1, largest=True, sorted=False)
    idx, _ = torch.sort(idx, dim=1)
    return idx, torch.gather(coeffs, 1, idx)


def _quant_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def quantize_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row linear int8 quantization of ``values`` ``(batch, k)``.

    ``scale = max(max - min, 1e-8) / 255`` and ``q = clamp(round((v - min) / scale) - 128, -128, 127)``
    with round-half-even, computed in float32 (float64 input stays float64). Returns
    ``(q int8 (batch, k), scales (batch,), mins (batch,))``.
    """
    if values.ndim != 2:
        raise ValueError(f"expected (batch, k) values, got shape {tuple(values.shape)}")
    if values.shape[1] < 1:
        raise ValueError("cannot quantize rows of zero values")
    v = values.to(_quant_dtype(values.dtype))
    mins = v.amin(dim=1)
    maxs = v.amax(dim=1)
    scales = (maxs - mins).clamp_min(MIN_RANGE) / 255.0
    q = torch.round((v - mins[:, None]) / scales[:, None]) - 128.0
    return q.clamp_(-128.0, 127.0).to(torch.int8), scales, mins


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``(q + 128) * scale + min`` per row.

    Computed in the dtype of ``scales`` (float32 on the wire). ``scales``/``mins`` may be ``(batch,)``
    or ``(batch, 1)``.
    """
    dtype = _quant_dtype(scales.dtype)
    s = scales.to(dtype).reshape(-1, 1)
    m = mins.to(dtype).reshape(-1, 1)
    return (q.to(dtype) + 128.0) * s + m


def decode_chunks(idx: torch.Tensor, values: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Dense tensor of ``plan.shape`` from each chunk's coefficients ``values`` at positions ``idx``.

    A zero ``(num_chunks, C)`` array gets the values scattered in, then the inverse transform per chunk
    (matrix products) and the chunks put back. Runs on ``values``' device in ``values``' dtype. Fast,
    but its last bits follow the matrix library; decoding a frame uses :func:`decode_levels`.
    """
    c = plan.chunk_numel
    n = plan.num_chunks
    _check_pairs(idx, values, n)
    dense = torch.zeros((n, c), dtype=values.dtype, device=values.device)
    dense.scatter_(1, idx.to(device=values.device, dtype=torch.int64), values)
    chunks = idct_chunks(dense.reshape(n, *plan.chunk_shape))
    return from_chunks(chunks, plan)


def _check_pairs(idx: torch.Tensor, values: torch.Tensor, n: int) -> None:
    if idx.shape != values.shape or idx.ndim != 2 or idx.shape[0] != n:
        raise ValueError(
            f"expected ({n}, k) positions and values, got {tuple(idx.shape)} and {tuple(values.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# Decoding that every node reproduces bit for bit.
#
# Nodes that apply the same frames must hold bit-identical weights, whatever their thread count, CPU
# or GPU. A float32 matrix product does not promise that: BLAS libraries order their sums by thread
# count and instruction set. So a frame is decoded with integers: its coefficients are levels ``u`` on
# a per-chunk grid (``coefficient = u * scale + min``), the basis is rounded to integers on a 2^-s grid,
# and the inverse transform of the levels (and of the grid's offsets) is computed in float64 where every
# product and partial sum is an integer below 2^53 — exact, so any summation order, any BLAS, any
# device gives the same numbers. Only the final ``scale``/``min`` combination rounds, elementwise.

_INT_BASES: "OrderedDict[tuple[int, int, torch.device], torch.Tensor]" = OrderedDict()
#: Output elements (float64) of one block of chunks: bounds the scratch memory of a decode.
_EXACT_BLOCK_ELEMS = 1 << 18


def fixed_point_bits(chunk_shape: Sequence[int]) -> int:
    """``s``: the decoding basis is ``round(D * 2^s)``, as fine as float64 can sum exactly.

    A chunk's sum has at most ``C`` terms of at most ``2^8 · 2^(d·s)`` (levels below 2^8, ``|D| <= 1``),
    so ``bit_length(C) + 8 + d·s <= 52`` keeps it exact; ``s`` is capped at 24 (float32's precision).
    """
    d = len(chunk_shape)
    c = _prod(chunk_shape)
    return max(1, min(24, (44 - c.bit_length()) // d))


def _int_basis(n: int, s: int, device: torch.device) -> torch.Tensor:
    key = (n, s, device)
    basis = _INT_BASES.get(key)
    if basis is None:
        basis = torch.round(_basis_f64(n) * float(2**s)).to(device)
        with _BASES_LOCK:
            _INT_BASES[key] = basis
            while len(_INT_BASES) > 64:
                _INT_BASES.popitem(last=False)
    return basis


def decode_levels(
    idx: torch.Tensor,
    levels: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    plan: ChunkPlan,
    route: Optional[str] = None,
) -> torch.Tensor:
    """The float32 tensor of ``plan.shape`` whose chunk ``c`` has coefficient ``levels[c, j] * scales[c]
    + mins[c]`` at position ``idx[c, j]``: bit-identical on every device, thread count and BLAS.

    ``levels`` are integers in ``[0, 255]``, ``idx`` strictly ascending per chunk (the decoder checks
    both). Runs on ``levels``' device. See the section comment for why it is exact; FORMAT.md §5.2 gives
    the same computation for independent readers. ``route`` ("sparse", "rows" or "dense") overrides the
    choice of method (:func:`_choose_route`), which only changes the time taken.
    """
    n = plan.num_chunks
    _check_pairs(idx, levels, n)
    dims = plan.chunk_shape
    device = levels.device
    k = idx.shape[1]
    c = _prod(dims)
    s = fixed_point_bits(dims)
    bases = [_int_basis(size, s, device) for size in dims]
    unscale = 2.0 ** (-s * len(dims))
    out = torch.empty((n, *dims), dtype=torch.float32, device=device)
    idx = idx.to(device=device, dtype=torch.int64)
    # Every route computes the same exact integers, so which one runs changes the time, never the bits.
    route = _choose_route(k, dims, device) if route is None else route
    if route not in _ROUTES:
        raise ValueError(f"route must be one of {sorted(_ROUTES)}, got {route!r}")
    block = max(1, _EXACT_BLOCK_ELEMS // (2 * c))
    shape1 = (-1,) + (1,) * len(dims)
    # (L·scale + O·min)·2^(-d·s) as FORMAT.md writes it, with the power of two folded into scale and
    # min: scaling by 2^j is exact in float64 (no subnormals at these magnitudes), so each product
    # and the sum round exactly as in the formula. No fused multiply-add: it would round once, not twice.
    sc_all = scales.to(device=device, dtype=torch.float64) * unscale
    mn_all = mins.to(device=device, dtype=torch.float64) * unscale
    if route == "rows" and device.type == "cpu":
        # Tiles of a matrix are decoded straight into the matrix: no tile-to-matrix copy follows.
        tiled = plan.mode == MODE_TILES and len(dims) == 2
        grid_cols = plan.grid[1] if tiled else 1
        if len(dims) == 2 and _folds(bases[0]) and _folds(bases[1]):
            # One Rust pass, the bases folded in half: its own threads, each on blocks in cache.
            _native.dct_decode_folded(
                idx.contiguous().reshape(-1).numpy(), levels.to(torch.int16).contiguous().reshape(-1).numpy(),
                k, dims[0], dims[1], bases[0].reshape(-1).numpy(), bases[1].reshape(-1).numpy(),
                sc_all.contiguous().numpy(), mn_all.contiguous().numpy(), out.reshape(-1).numpy(),
                torch.get_num_threads(), grid_cols,
            )
            return out.reshape(plan.shape) if tiled else from_chunks(out, plan)
        # Both stages in Rust, the matrix product between them in place.
        _rows_decode_cpu(idx, levels, sc_all, mn_all, dims, bases, block, out, grid_cols)
        if tiled:
            return out.reshape(plan.shape)
        return from_chunks(out, plan)
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        nb = b1 - b0
        level_sum, offset_sum = _ROUTES[route](idx[b0:b1], levels[b0:b1], dims, bases)
        chunk = level_sum.reshape(nb, *dims) * sc_all[b0:b1].reshape(shape1)
        chunk += offset_sum.reshape(nb, *dims) * mn_all[b0:b1].reshape(shape1)
        out[b0:b1] = chunk
    return from_chunks(out, plan)


def decode_levels_weighted_sum(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    weights: Sequence[float],
    plan: ChunkPlan,
) -> Optional[torch.Tensor]:
    """``acc = float32(d_0 · w_0)``, then ``acc = acc + float32(d_i · w_i)`` in order, ``d_i`` what
    :func:`decode_levels` returns for ``parts[i] = (idx, levels, scales, mins)`` and each weight a
    float32 value: the same bits as decoding each part and combining the tensors, in one Rust pass
    that decodes each chunk for every sender while the chunk's output stays in cache.

    Only where :func:`decode_levels` takes the folded route (CPU, 2-D chunks of even sides); ``None``
    elsewhere, for the caller to decode part by part. Every part shares ``plan``; ``k`` may differ.
    """
    dims = plan.chunk_shape
    if len(dims) != 2 or not parts or len(weights) != len(parts):
        return None
    if any(lv.device.type != "cpu" for _, lv, _, _ in parts) or _choose_route(1, dims) != "rows":
        return None
    s = fixed_point_bits(dims)
    device = torch.device("cpu")
    bases = [_int_basis(size, s, device) for size in dims]
    if not (_folds(bases[0]) and _folds(bases[1])):
        return None
    unscale = 2.0 ** (-s * len(dims))
    senders = []
    for idx, levels, scales, mins in parts:
        _check_pairs(idx, levels, plan.num_chunks)
        senders.append((
            idx.to(torch.int64).contiguous().reshape(-1).numpy(),
            levels.to(torch.int16).contiguous().reshape(-1).numpy(),
            idx.shape[1],
            # as decode_levels: the power of two folded in exactly, in float64
            (scales.to(torch.float64) * unscale).contiguous().numpy(),
            (mins.to(torch.float64) * unscale).contiguous().numpy(),
        ))
    tiled = plan.mode == MODE_TILES
    out = torch.empty((plan.num_chunks, *dims), dtype=torch.float32)
    _native.dct_decode_folded_mean(
        senders, torch.tensor([float(w) for w in weights], dtype=torch.float32).numpy(), dims[0], dims[1],
        bases[0].reshape(-1).numpy(), bases[1].reshape(-1).numpy(), out.reshape(-1).numpy(),
        torch.get_num_threads(), plan.grid[1] if tiled else 1,
    )
    return out.reshape(plan.shape) if tiled else from_chunks(out, plan)


def _choose_route(k: int, dims: tuple[int, ...], device: torch.device = torch.device("cpu")) -> str:
    """The fastest exact route for ``k`` coefficients per chunk of shape ``dims``.

    On the CPU, 2-D chunks with even sides take "rows" at every ``k``: there it is one Rust pass with
    the basis folded in half (``_native.dct_decode_folded``), measured faster than "sparse" from
    k = 1 on 64×64 tiles. Otherwise, per chunk of ``C`` elements, "sparse" costs about ``2·k·C``
    multiply-adds (one basis product per coefficient), "rows" ``2·k·last`` additions plus
    ``2·C·(d_1 + … + d_{n-1})`` for the dense transforms of the other axes, "dense" ``2·C·(d_1 + … +
    d_n)``. Sparse wins while ``k`` is below about half of ``d_1 + … + d_{n-1}`` (32 for 64×64
    chunks, measured on x86 BLAS); 1-D chunks have no other axes: "rows" on the CPU (its Rust scatter),
    else "sparse".
    """
    if device.type == "cpu" and len(dims) == 2 and dims[0] % 2 == 0 and dims[1] % 2 == 0:
        return "rows"
    if device.type == "cpu" and len(dims) == 1:
        # The same k·C additions either way, but "rows" adds the basis rows in one Rust pass where
        # "sparse" gathers them through torch: 0.27 s against 2.6 s for 10 M values in chunks of 64 at k = 32.
        return "rows"
    if len(dims) == 1 or 2 * k <= sum(dims[:-1]):
        return "sparse"
    return "rows"


def _dense_level_sums(idx: torch.Tensor, levels: torch.Tensor, dims: tuple[int, ...], bases: list[torch.Tensor]):
    """Both channels by a dense transform of the scattered levels and ones, every axis by a matrix."""
    nb = idx.shape[0]
    c = _prod(dims)
    u = levels.to(torch.float64)
    grid = torch.zeros((2, nb, c), dtype=torch.float64, device=u.device)
    grid[0].scatter_(1, idx, u)
    grid[1].scatter_(1, idx, torch.ones_like(u))
    y = grid.reshape(2 * nb, *dims)
    for axis, basis in enumerate(bases, start=1):
        y = torch.movedim(torch.movedim(y, axis, -1) @ basis, -1, axis)
    return y[:nb], y[nb:]


def _rows_level_sums(idx: torch.Tensor, levels: torch.Tensor, dims: tuple[int, ...], bases: list[torch.Tensor]):
    """Both channels: the last axis sparse (each coefficient's basis row added into its chunk row,
    ``k · last`` additions), then the other axes by matrix products over the whole block."""
    nb, k = idx.shape
    last = dims[-1]
    rest = _prod(dims[:-1])
    device = idx.device
    # (rows, chunks, channel, last): the leading axis is the one the next matrix product contracts.
    t = torch.zeros(rest * nb * 2 * last, dtype=torch.float64, device=device)
    if device.type == "cpu":
        _scatter_rows_cpu(idx, levels, k, rest, last, bases[-1], t)
    else:
        rowvecs = bases[-1].index_select(0, (idx % last).reshape(-1)).reshape(nb, k, 1, last)
        u = levels.to(torch.float64).reshape(nb, k, 1, 1)
        vals = torch.cat([u * rowvecs, rowvecs], dim=2).reshape(nb * k, 2 * last)
        at = ((idx // last) * nb + torch.arange(nb, device=device).unsqueeze(1)).reshape(-1)
        t.view(rest * nb, 2 * last).index_add_(0, at, vals)
    y = _transform_rest_axes(t, dims, bases)
    y = torch.movedim(y.reshape(*dims[:-1], nb, 2, last), len(dims) - 1, 0)  # (nb, *rest_dims, 2, last)
    return y.select(-2, 0), y.select(-2, 1)


def _scatter_rows_cpu(idx, levels, k: int, rest: int, last: int, basis: torch.Tensor, out: torch.Tensor) -> None:
    _native.dct_scatter_basis_rows(
        idx.contiguous().reshape(-1).numpy(), levels.to(torch.int16).contiguous().reshape(-1).numpy(),
        k, rest, last, basis.reshape(-1).numpy(), out.numpy(), torch.get_num_threads(),
    )


def _transform_rest_axes(t: torch.Tensor, dims: tuple[int, ...], bases: list[torch.Tensor], out: Optional[torch.Tensor] = None):
    """The inverse integer transform of every axis but the last of ``t``, laid out ``(*dims[:-1], nb
    · 2 · last)``: one matrix product per axis, contracting the leading one. Returns the result in
    the same layout, contiguous (in ``out`` when given and there is one axis to transform)."""
    y = t.reshape(*dims[:-1], -1)
    if len(dims) == 2:
        return torch.mm(bases[0].T, y, out=out)
    for axis, basis in enumerate(bases[:-1]):
        # contract the leading axis, then move the new one behind the axes still to transform
        y = (basis.T @ y.reshape(dims[axis], -1)).reshape(y.shape)
        y = torch.movedim(y, 0, len(dims) - 2)
    return y.contiguous()


def _rows_decode_cpu(idx, levels, scales, mins, dims, bases, block: int, out: torch.Tensor, grid_cols: int = 1) -> None:
    """The "rows" route on the CPU for chunks the folded decode does not take (odd sides, more than
    two axes), block by block: the Rust scatter, the matrix products, and the Rust combine writing
    float32 values straight into ``out``, the whole tensor as a grid of ``grid_cols`` tiles per tile
    row (1: chunk-major, ``(chunks, *dims)``). Buffers are reused across blocks."""
    n, k = idx.shape
    last, rest = dims[-1], _prod(dims[:-1])
    threads = torch.get_num_threads()
    cap = min(block, n) * rest * 2 * last
    scattered = torch.empty(cap, dtype=torch.float64)
    transformed = torch.empty(cap, dtype=torch.float64) if len(dims) == 2 else None
    flat_out = out.reshape(-1).numpy()
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        size = (b1 - b0) * rest * 2 * last
        t = scattered[:size]
        _scatter_rows_cpu(idx[b0:b1], levels[b0:b1], k, rest, last, bases[-1], t)
        y = _transform_rest_axes(t, dims, bases, None if transformed is None else transformed[:size].view(rest, -1))
        _native.dct_combine_level_sums(
            y.reshape(-1).numpy(), scales[b0:b1].contiguous().numpy(), mins[b0:b1].contiguous().numpy(),
            rest, last, flat_out, threads, first=b0, grid_cols=grid_cols,
        )


_FOLDS: "dict[tuple, bool]" = {}
def _folds(basis: torch.Tensor) -> bool:
    """Whether the integer basis is exactly symmetric (``B[f, n-1-i] = (-1)^f B[f, i]``, ``n`` even),
    so the decode may fold it in half. Checked once per basis."""
    n = basis.shape[0]
    key = (n, float(basis[0, 0]))  # the size and round(2^s / √n), which names the grid 2^s
    if key not in _FOLDS:
        _FOLDS[key] = bool(_native.dct_basis_folds(basis.cpu().reshape(-1).numpy(), n))
    return _FOLDS[key]


def _sparse_level_sums(idx: torch.Tensor, levels: torch.Tensor, dims: tuple[int, ...], bases: list[torch.Tensor]):
    """``(Σ_j u_j B[f_j], Σ_j B[f_j])`` per chunk, ``B[f]`` the integer basis product of position ``f``."""
    nb, k = idx.shape
    u = levels.to(torch.float64)
    freqs = _unravel(idx, dims)
    # Row j of `first` is D_1[f_1] and of `others` the Kronecker product D_2[f_2] ⊗ … ⊗ D_d[f_d].
    first = bases[0].index_select(0, freqs[0].reshape(-1)).reshape(nb, k, dims[0])
    others = torch.ones((nb, k, 1), dtype=torch.float64, device=idx.device)
    for size, basis, f in zip(dims[1:], bases[1:], freqs[1:]):
        rows = basis.index_select(0, f.reshape(-1)).reshape(nb, k, size)
        others = (others.unsqueeze(-1) * rows.unsqueeze(-2)).reshape(nb, k, -1)
    rest = others.shape[-1]
    sums = torch.bmm(first.transpose(1, 2), torch.cat([u.unsqueeze(-1) * others, others], dim=2))
    return sums[..., :rest], sums[..., rest:]


_ROUTES = {"sparse": _sparse_level_sums, "rows": _rows_level_sums, "dense": _dense_level_sums}


def _unravel(idx: torch.Tensor, dims: Sequence[int]) -> list[torch.Tensor]:
    """Per-dimension frequencies of row-major flat positions inside a chunk."""
    out = []
    rem = idx
    for size in reversed(dims):
        out.append(rem % size)
        rem = rem // size
    return out[::-1]


def encode_chunks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """The DCT coefficients ``(num_chunks, C)`` of ``x`` cut per ``plan`` (in ``x``'s dtype)."""
    n = plan.num_chunks
    chunks = to_chunks(x, plan).reshape(n, *plan.chunk_shape)
    return dct_chunks(chunks).reshape(n, plan.chunk_numel)
