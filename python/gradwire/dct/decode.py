"""Decoding a chunked DCT record: the fast float decode and the bit-exact decode every node reproduces.

:func:`decode_chunks` scatters float coefficients and runs the float inverse transform (fast; its last
bits follow the matrix library). :func:`decode_levels` decodes quantized levels in integers held exactly
in float64 (routes "sparse", "rows", "dense"; :func:`_choose_route`) or in int64 through int8 digits
(route "integer", :mod:`.integer`; a GPU picks it or a float64 route by measuring both,
:mod:`.route_choice`), the same bits on every device, thread count and BLAS;
:func:`decode_levels_weighted_sum` is the exact weighted sum of several records in one Rust pass. The
section comment below says why the integer decode is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .. import _native
from . import route_choice
from .basis import basis_folds, fixed_point_basis
from .chunks import MODE_TILES, ChunkPlan, from_chunks
from .integer import dense_last_axis, integer_basis, rows_level_sums_int
from .transform import idct_chunks

__all__ = [
    "decode_chunks",
    "decode_level_chunks",
    "decode_levels",
    "decode_levels_weighted_sum",
    "fixed_point_bits",
    "subtract_decoded_levels",
]


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
        raise ValueError(f"expected ({n}, k) positions and values, got {tuple(idx.shape)} and {tuple(values.shape)}")


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

#: Output elements (float64) of one block of chunks on the CPU: bounds the scratch memory of a decode
#: and keeps a block in cache.
_EXACT_BLOCK_ELEMS = 1 << 18
#: Scratch elements (float64) of one block on a GPU, 256 MiB. There each block costs a dozen kernel
#: launches whatever its size, so blocks are as large as this allows: with the CPU's blocks a 4096×4096
#: tensor in 64×64 tiles took 128 blocks, 33–58 ms an encode or a decode on an H200 against DeMo's 1–2 ms.
_EXACT_BLOCK_ELEMS_GPU = 1 << 25
#: The default device of a route choice (one object, not a call in the signature).
_CPU = torch.device("cpu")


def _exact_block(device: torch.device, k: int, dims: tuple[int, ...], route: str = "") -> int:
    """Chunks per block of an exact decode on ``device``, ``k`` coefficients per chunk of shape ``dims``."""
    c = math.prod(dims)
    if device.type == "cpu":
        return max(1, _EXACT_BLOCK_ELEMS // (2 * c))
    if route == "integer":
        # In 8-byte elements per chunk: both int64 channels (2·C), their digits (int8, about 4 each), the
        # stacked int32 product of every digit pair (about 8 pairs: 8·C) and its int64 copy (16·C), the
        # result; at small k the gathered basis rows (at large k the last axis is a product too:
        # dense_last_axis).
        gathered = 0 if dense_last_axis(k, dims) else 4 * k * dims[-1]
        return max(1, _EXACT_BLOCK_ELEMS_GPU // (30 * c + gathered))
    # Per chunk, the largest route's scratch: both channels and their transforms (about 6·C), and the
    # basis rows gathered per coefficient (sparse: k·(d_1 + 4·C/d_1); rows: 4·k·last).
    per_chunk = 6 * c + k * max(dims[0] + 4 * (c // dims[0]), 4 * dims[-1])
    return max(1, _EXACT_BLOCK_ELEMS_GPU // per_chunk)


def fixed_point_bits(chunk_shape: Sequence[int]) -> int:
    """``s``: the decoding basis is ``round(D * 2^s)``, as fine as float64 can sum exactly.

    A chunk's sum has at most ``C`` terms of at most ``2^8 · 2^(d·s)`` (levels below 2^8, ``|D| <= 1``),
    so ``bit_length(C) + 8 + d·s <= 52`` keeps it exact; ``s`` is capped at 24 (float32's precision).
    """
    d = len(chunk_shape)
    c = math.prod(chunk_shape)
    return max(1, min(24, (44 - c.bit_length()) // d))


def decode_levels(
    idx: torch.Tensor,
    levels: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    plan: ChunkPlan,
    route: str | None = None,
) -> torch.Tensor:
    """The float32 tensor of ``plan.shape`` whose chunk ``c`` has coefficient ``levels[c, j] * scales[c]
    + mins[c]`` at position ``idx[c, j]``: bit-identical on every device, thread count and BLAS.

    ``levels`` are integers in ``[0, 255]``, ``idx`` strictly ascending per chunk (the decoder checks
    both). Runs on ``levels``' device. See the section comment for why it is exact; FORMAT.md §5.2 gives
    the same computation for independent readers. ``route`` ("sparse", "rows", "dense" or "integer")
    overrides the choice of method (:func:`_choose_route`, and on a GPU :mod:`.route_choice`), which only
    changes the time taken.
    """
    n = plan.num_chunks
    _check_pairs(idx, levels, n)
    dims = plan.chunk_shape
    device = levels.device
    if route is not None and route not in _ROUTES:
        raise ValueError(f"route must be one of {sorted(_ROUTES)}, got {route!r}")
    if device.type == "cpu" and (route or _choose_route(idx.shape[1], dims, device)) == "rows":
        return _decode_rows_cpu(idx, levels, scales, mins, plan)
    return from_chunks(decode_level_chunks(idx, levels, scales, mins, dims, route), plan)


def decode_level_chunks(
    idx: torch.Tensor,
    levels: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    dims: Sequence[int],
    route: str | None = None,
) -> torch.Tensor:
    """:func:`decode_levels` before the chunks are put back: ``(n, *dims)`` float32, chunk ``c`` decoded
    from row ``c`` of ``idx``, ``levels``, ``scales`` and ``mins``.

    Each chunk is decoded on its own, exactly, so the chunks of several records stacked together decode
    to the same bits as each record alone: a bundle's records on a GPU are decoded in one batch
    (:meth:`gradwire.DCTCodec.compress_bundle`). Runs the routes through torch on ``levels``' device
    (on the CPU, :func:`decode_levels` takes a faster Rust pass for a whole record).
    """
    dims = tuple(int(d) for d in dims)
    n = idx.shape[0]
    _check_pairs(idx, levels, n)
    device = levels.device
    k = idx.shape[1]
    if route is None:
        route = _choose_route(k, dims, device)
        if device.type != "cpu" and n:
            m = min(n, _exact_block(device, k, dims, "integer"))  # a test block of the caller's own data
            route = route_choice.device_route(
                k,
                dims,
                device,
                route,
                lambda r: route_choice.timed(
                    lambda: _level_chunks(idx[:m], levels[:m], scales[:m], mins[:m], dims, r), device
                ),
            )
    if route not in _ROUTES:
        raise ValueError(f"route must be one of {sorted(_ROUTES)}, got {route!r}")
    return _level_chunks(idx, levels, scales, mins, dims, route)


def _level_chunks(idx, levels, scales, mins, dims: tuple[int, ...], route: str) -> torch.Tensor:
    """:func:`decode_level_chunks` by ``route``."""
    n = idx.shape[0]
    device = levels.device
    k = idx.shape[1]
    s = fixed_point_bits(dims)
    if route == "integer":
        bases = [integer_basis(size, s, device) for size in dims]
    else:
        bases = [fixed_point_basis(size, s, device) for size in dims]
    sc_all, mn_all = _unscaled(scales, mins, dims, device)
    out = torch.empty((n, *dims), dtype=torch.float32, device=device)
    idx = idx.to(device=device, dtype=torch.int64)
    # Every route computes the same exact integers, so which one runs changes the time, never the bits.
    block = _exact_block(device, k, dims, route)
    shape1 = (-1,) + (1,) * len(dims)
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        nb = b1 - b0
        level_sum, offset_sum = _ROUTES[route](idx[b0:b1], levels[b0:b1], dims, bases)
        # The integer route's sums are int64 (each below 2^53, so exact in float64): multiplied by the
        # float64 scale and min they are promoted inside the kernel, with no float64 copy of their own. The
        # roundings are FORMAT.md's: (L·scale)·2^-ds + (O·min)·2^-ds in float64, then float32, elementwise
        # over the output only. (Emulating those two roundings in integers would take about a hundred int64
        # operations per element: an elementwise float64 pass is memory-bound on every GPU, so it stays.)
        chunk = level_sum.reshape(nb, *dims) * sc_all[b0:b1].reshape(shape1)
        chunk += offset_sum.reshape(nb, *dims) * mn_all[b0:b1].reshape(shape1)
        out[b0:b1] = chunk
    return out


def _unscaled(scales: torch.Tensor, mins: torch.Tensor, dims: tuple[int, ...], device: torch.device):
    # (L·scale + O·min)·2^(-d·s) as FORMAT.md writes it, with the power of two folded into scale and
    # min: scaling by 2^j is exact in float64 (no subnormals at these magnitudes), so each product
    # and the sum round exactly as in the formula. No fused multiply-add: it would round once, not twice.
    unscale = 2.0 ** (-fixed_point_bits(dims) * len(dims))
    return (
        scales.to(device=device, dtype=torch.float64) * unscale,
        mins.to(device=device, dtype=torch.float64) * unscale,
    )


def _decode_rows_cpu(idx, levels, scales, mins, plan: ChunkPlan) -> torch.Tensor:
    """The "rows" route of :func:`decode_levels` on the CPU: Rust passes writing the whole record."""
    n = plan.num_chunks
    dims = plan.chunk_shape
    device = levels.device
    k = idx.shape[1]
    s = fixed_point_bits(dims)
    bases = [fixed_point_basis(size, s, device) for size in dims]
    sc_all, mn_all = _unscaled(scales, mins, dims, device)
    out = torch.empty((n, *dims), dtype=torch.float32, device=device)
    idx = idx.to(device=device, dtype=torch.int64)
    # Tiles of a matrix are decoded straight into the matrix: no tile-to-matrix copy follows.
    tiled = plan.mode == MODE_TILES and len(dims) == 2
    grid_cols = plan.grid[1] if tiled else 1
    if len(dims) == 2 and basis_folds(dims[0], s) and basis_folds(dims[1], s):
        # One Rust pass, the bases folded in half: its own threads, each on blocks in cache.
        _native.dct_decode_folded(
            idx.contiguous().reshape(-1).numpy(),
            levels.to(torch.int16).contiguous().reshape(-1).numpy(),
            k,
            dims[0],
            dims[1],
            bases[0].reshape(-1).numpy(),
            bases[1].reshape(-1).numpy(),
            sc_all.contiguous().numpy(),
            mn_all.contiguous().numpy(),
            out.reshape(-1).numpy(),
            torch.get_num_threads(),
            grid_cols,
        )
        return out.reshape(plan.shape) if tiled else from_chunks(out, plan)
    # Both stages in Rust, the matrix product between them in place.
    _rows_decode_cpu(idx, levels, sc_all, mn_all, dims, bases, _exact_block(device, k, dims), out, grid_cols)
    return out.reshape(plan.shape) if tiled else from_chunks(out, plan)


def subtract_decoded_levels(
    target: torch.Tensor,
    idx: torch.Tensor,
    levels: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    plan: ChunkPlan,
) -> bool:
    """``target −= decode_levels(idx, levels, scales, mins, plan)`` in place, in one Rust pass that
    decodes each chunk straight into ``target`` (``_native.dct_decode_folded_mean`` with one sender at
    weight −1, ``accumulate``): the same bits as decoding and then subtracting, with no decoded tensor
    written out. Only where :func:`decode_levels` takes the folded route and ``target`` (contiguous
    float32 on the CPU, of ``plan.shape``) is laid out as the decode writes it (tiles of a matrix, or
    flat chunks without padding); ``False`` elsewhere, with ``target`` untouched, for the caller to
    subtract :func:`decode_levels`."""
    dims = plan.chunk_shape
    n = plan.num_chunks
    _check_pairs(idx, levels, n)
    if len(dims) != 2 or target.device.type != "cpu" or levels.device.type != "cpu":
        return False
    if target.dtype != torch.float32 or not target.is_contiguous() or tuple(target.shape) != tuple(plan.shape):
        return False
    tiled = plan.mode == MODE_TILES
    if not tiled and plan.pad_count:
        return False
    if _choose_route(idx.shape[1], dims) != "rows":
        return False
    s = fixed_point_bits(dims)
    bases = [fixed_point_basis(size, s, _CPU) for size in dims]
    if not (basis_folds(dims[0], s) and basis_folds(dims[1], s)):
        return False
    sc, mn = _unscaled(scales, mins, dims, _CPU)  # as decode_levels: the power of two folded in exactly
    sender = (
        idx.to(torch.int64).contiguous().reshape(-1).numpy(),
        levels.to(torch.int16).contiguous().reshape(-1).numpy(),
        idx.shape[1],
        sc.contiguous().numpy(),
        mn.contiguous().numpy(),
    )
    _native.dct_decode_folded_mean(
        [sender],
        _MINUS_ONE,
        dims[0],
        dims[1],
        bases[0].reshape(-1).numpy(),
        bases[1].reshape(-1).numpy(),
        target.view(-1).numpy(),
        torch.get_num_threads(),
        plan.grid[1] if tiled else 1,
        accumulate=True,
    )
    return True


#: The one weight of :func:`subtract_decoded_levels`: ``out + d · (−1)`` is ``out − d``, exactly.
_MINUS_ONE = np.array([-1.0], dtype=np.float32)


def decode_levels_weighted_sum(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    weights: Sequence[float],
    plan: ChunkPlan,
) -> torch.Tensor | None:
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
    bases = [fixed_point_basis(size, s, device) for size in dims]
    if not (basis_folds(dims[0], s) and basis_folds(dims[1], s)):
        return None
    senders = []
    for idx, levels, scales, mins in parts:
        _check_pairs(idx, levels, plan.num_chunks)
        sc, mn = _unscaled(scales, mins, dims, device)  # as decode_levels: the power of two folded in exactly
        senders.append(
            (
                idx.to(torch.int64).contiguous().reshape(-1).numpy(),
                levels.to(torch.int16).contiguous().reshape(-1).numpy(),
                idx.shape[1],
                sc.contiguous().numpy(),
                mn.contiguous().numpy(),
            )
        )
    tiled = plan.mode == MODE_TILES
    out = torch.empty((plan.num_chunks, *dims), dtype=torch.float32)
    _native.dct_decode_folded_mean(
        senders,
        torch.tensor([float(w) for w in weights], dtype=torch.float32).numpy(),
        dims[0],
        dims[1],
        bases[0].reshape(-1).numpy(),
        bases[1].reshape(-1).numpy(),
        out.reshape(-1).numpy(),
        torch.get_num_threads(),
        plan.grid[1] if tiled else 1,
    )
    return out.reshape(plan.shape) if tiled else from_chunks(out, plan)


def _choose_route(k: int, dims: tuple[int, ...], device: torch.device = _CPU) -> str:
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
    c = math.prod(dims)
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
    rest = math.prod(dims[:-1])
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


def _scatter_rows_cpu(
    idx, levels, k: int, rest: int, last: int, basis: torch.Tensor, out: torch.Tensor, threads: int | None = None
) -> None:
    _native.dct_scatter_basis_rows(
        idx.contiguous().reshape(-1).numpy(),
        levels.to(torch.int16).contiguous().reshape(-1).numpy(),
        k,
        rest,
        last,
        basis.reshape(-1).numpy(),
        out.numpy(),
        torch.get_num_threads() if threads is None else threads,
    )


def _transform_rest_axes(
    t: torch.Tensor, dims: tuple[int, ...], bases: list[torch.Tensor], out: torch.Tensor | None = None
):
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
    last, rest = dims[-1], math.prod(dims[:-1])
    # 1-D chunks: the two Rust stages per block are all the work (no matrix product between them), a few
    # milliseconds of one core per block, so threads would cost a spawn and a join per call, and on a busy
    # machine each join waits for a core: 0.012–0.09 s on 2 threads against 0.011 s on one for a
    # 1.6 M-element vector of 64-element chunks at k = 32 (2 cores, under load).
    threads = 1 if len(dims) == 1 else torch.get_num_threads()
    cap = min(block, n) * rest * 2 * last
    scattered = torch.empty(cap, dtype=torch.float64)
    transformed = torch.empty(cap, dtype=torch.float64) if len(dims) == 2 else None
    flat_out = out.reshape(-1).numpy()
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        size = (b1 - b0) * rest * 2 * last
        t = scattered[:size]
        _scatter_rows_cpu(idx[b0:b1], levels[b0:b1], k, rest, last, bases[-1], t, threads)
        y = _transform_rest_axes(t, dims, bases, None if transformed is None else transformed[:size].view(rest, -1))
        _native.dct_combine_level_sums(
            y.reshape(-1).numpy(),
            scales[b0:b1].contiguous().numpy(),
            mins[b0:b1].contiguous().numpy(),
            rest,
            last,
            flat_out,
            threads,
            first=b0,
            grid_cols=grid_cols,
        )


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


# Bases of the integer route are :class:`.integer.IntegerBasis` objects (the caller builds them per route).
_ROUTES["integer"] = rows_level_sums_int


def _unravel(idx: torch.Tensor, dims: Sequence[int]) -> list[torch.Tensor]:
    """Per-dimension frequencies of row-major flat positions inside a chunk."""
    out = []
    rem = idx
    for size in reversed(dims):
        out.append(rem % size)
        rem = rem // size
    return out[::-1]
