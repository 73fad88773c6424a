"""The two ways of cutting a tensor into chunks, and the plan that records a cut.

Everything here is plain shape arithmetic and torch reshapes: device-agnostic, no transform.

Chunking:

- mode 0, :data:`MODE_FLAT` (Panthalia): flatten, zero-pad to a multiple of ``C = prod(chunk_shape)``,
  cut into consecutive chunks;
- mode 1, :data:`MODE_TILES` (DeMo): view the tensor as a matrix ``(shape[0], numel / shape[0])`` (a
  vector if ``ndim <= 1``) and cut it into tiles whose sides are the largest divisors ``<= 64``.
  Where that gives small tiles (:func:`small_tiles`: a 431,463-element vector is 3 × 143,821, a
  103-row embedding has 1-row tiles) an encoder falls back to mode 0 (:func:`plan_tiles_or_flat`).

A :class:`ChunkPlan` records one such cut; :func:`to_chunks` and :func:`from_chunks` move between a
tensor and the flat-chunk layout ``(num_chunks, C)``; :func:`cut_into_chunks` and :func:`put_back_chunks`
do it for many tensors of one chunk shape at once, stacked in one buffer, by one ``_foreach_copy_``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MAX_TILE",
    "MODE_FLAT",
    "MODE_TILES",
    "ChunkPlan",
    "cut_into_chunks",
    "from_chunks",
    "largest_divisor_at_most",
    "plan_chunks",
    "plan_flat",
    "plan_tiles",
    "plan_tiles_or_flat",
    "put_back_chunks",
    "small_tiles",
    "tile_chunk_shape",
    "to_chunks",
]

MODE_FLAT = 0
MODE_TILES = 1
#: The largest tile side of mode 1.
MAX_TILE = 64


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
        return math.prod(self.chunk_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def plan_flat(shape: Sequence[int], chunk_shape: Sequence[int]) -> ChunkPlan:
    """Mode 0: flatten, zero-pad to a multiple of ``C``, consecutive chunks of ``chunk_shape``."""
    shape = tuple(int(d) for d in shape)
    chunk_shape = tuple(int(d) for d in chunk_shape)
    if not chunk_shape or any(d < 1 for d in chunk_shape):
        raise ValueError(f"chunk_shape must be non-empty with every dimension >= 1, got {chunk_shape}")
    c = math.prod(chunk_shape)
    numel = math.prod(shape)
    pad = (c - numel % c) % c
    return ChunkPlan(MODE_FLAT, shape, chunk_shape, pad, (numel + pad) // c)


def _matrix_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    numel = math.prod(shape)
    if len(shape) >= 2:
        return (shape[0], numel // shape[0])
    return (numel,)


def tile_chunk_shape(shape: Sequence[int], max_tile: int = MAX_TILE) -> tuple[int, ...]:
    """Mode 1's chunk shape for a tensor of ``shape`` (which must hold at least one element)."""
    shape = tuple(int(d) for d in shape)
    if math.prod(shape) < 1:
        raise ValueError(f"tile chunking needs at least one element, got shape {shape}")
    return tuple(largest_divisor_at_most(m, max_tile) for m in _matrix_view(shape))


def plan_tiles(shape: Sequence[int], max_tile: int = MAX_TILE) -> ChunkPlan:
    """Mode 1: the tensor as a matrix ``(shape[0], numel / shape[0])`` (or a vector) cut into tiles."""
    shape = tuple(int(d) for d in shape)
    chunk_shape = tile_chunk_shape(shape, max_tile)
    matrix = _matrix_view(shape)
    grid = tuple(m // c for m, c in zip(matrix, chunk_shape))
    return ChunkPlan(MODE_TILES, shape, chunk_shape, 0, math.prod(grid), grid)


def small_tiles(shape: Sequence[int], max_tile: int = MAX_TILE) -> bool:
    """Whether mode 1 would cut a tensor of ``shape`` into *small* tiles: tiles of fewer than a quarter of
    ``min(numel, max_tile^d)`` elements, ``d`` the matrix view's rank (1 for vectors, else 2).

    A full tile (64×64, or 64 for a vector) or a whole tensor that fits in one is never small; tiles
    below a quarter of that are: the 3-element tiles of a 431,463-element vector (3 × 143,821, a prime),
    the 1×64 tiles of a 103×64 embedding (103 is prime). 48×10 tiles of a 96×10 matrix are not (480 of
    its 960 elements). Empty tensors have no tiles and count as small.
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if numel < 1:
        return True
    view = _matrix_view(shape)
    full = int(max_tile) ** len(view)
    return 4 * math.prod(tile_chunk_shape(shape, max_tile)) < min(numel, full)


def plan_tiles_or_flat(shape: Sequence[int], chunk_shape: Sequence[int], max_tile: int = MAX_TILE) -> ChunkPlan:
    """The tile-mode encoder's plan: :func:`plan_tiles`, or :func:`plan_flat` with ``chunk_shape`` where
    the tiles would be small (:func:`small_tiles`). The record's params say which mode it used, so a
    decoder needs nothing else."""
    if small_tiles(shape, max_tile):
        return plan_flat(shape, chunk_shape)
    return plan_tiles(shape, max_tile)


def plan_chunks(mode: int, shape: Sequence[int], chunk_shape: Sequence[int] | None = None) -> ChunkPlan:
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
        raise ValueError(f"expected {plan.num_chunks} chunks of {c} elements, got shape {tuple(chunks.shape)}")
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
# Many tensors' chunks stacked: ``members`` are ``(name, tensor, plan)`` of one chunk shape, in order.


def _chunk_views(members, chunk_rows: torch.Tensor, flat_of, into_chunks: bool):
    """``(destinations, sources, padding)`` views moving every member's elements between the chunk layout
    and its tensor's: ``chunk_rows`` holds every member's chunks ``(rows, C)`` in order, ``flat_of(i)``
    member i's elements in tensor order (a flat view); ``into_chunks`` says which way. Tiles pair a
    ``(grid_u, grid_v, a, b)`` view of the rows with the tensor's tiles, the permutation always on the
    source side (a strided read into a contiguous write: the fast copy on the CPU). Views only, so one
    ``_foreach_copy_`` moves them all."""
    dst, src, pads = [], [], []
    row = 0
    for i, (_, _, plan) in enumerate(members):
        n, c = plan.num_chunks, plan.chunk_numel
        rows = chunk_rows[row : row + n]
        row += n
        flat = flat_of(i)
        if plan.mode == MODE_TILES and len(plan.chunk_shape) == 2:
            (a, b), (gu, gv) = plan.chunk_shape, plan.grid
            tiles, tensor = rows.view(gu, gv, a, b), flat.view(gu, a, gv, b)
            if into_chunks:
                dst.append(tiles)
                src.append(tensor.permute(0, 2, 1, 3))
            else:
                dst.append(tensor)
                src.append(tiles.permute(0, 2, 1, 3))
        else:
            numel = flat.numel()
            chunked = rows.view(-1)[:numel]
            dst.append(chunked if into_chunks else flat)
            src.append(flat if into_chunks else chunked)
            if n * c > numel:
                pads.append(rows.view(-1)[numel:])
    return dst, src, pads


def cut_into_chunks(members, dims, c: int) -> torch.Tensor:
    """Every member's chunks (:func:`to_chunks` of each, float32) stacked ``(rows, C)``, written in place into
    one new buffer: one ``_foreach_copy_`` (and one ``_foreach_zero_`` for flat chunks' padding) whatever
    the number of tensors. Copies and float32 widening are exact: the same values as ``to_chunks``."""
    total = sum(plan.num_chunks for _, _, plan in members)
    device = members[0][1].device
    out = torch.empty((total, c), dtype=torch.float32, device=device)
    sources = [t.detach().reshape(-1) for _, t, _ in members]
    dst, src, pads = _chunk_views(members, out, lambda i: sources[i], into_chunks=True)
    torch._foreach_copy_(dst, src)
    if pads:
        torch._foreach_zero_(pads)
    return out


def put_back_chunks(decoded: torch.Tensor, members, dims) -> list[torch.Tensor]:
    """Each member's decoded chunks put back into its tensor's shape (:func:`from_chunks`), float32: views of
    one new buffer, written by one ``_foreach_copy_``."""
    sizes = [math.prod(plan.shape) for _, _, plan in members]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=decoded.device)
    parts = list(torch.split(flat, sizes)) if members else []
    dst, src, _ = _chunk_views(members, decoded, lambda i: parts[i], into_chunks=False)
    torch._foreach_copy_(dst, src)
    return [p.view(plan.shape) for p, (_, _, plan) in zip(parts, members)]
