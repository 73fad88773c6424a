"""The orthonormal DCT-II by cached basis matrices, and the two ways of cutting a tensor into chunks.

One namespace, ``gradwire.dct``, over four modules (each imports only the ones above it):

- :mod:`.chunks`: the two chunkings (mode 0 flat, mode 1 tiles), :class:`ChunkPlan`, :func:`to_chunks` /
  :func:`from_chunks`;
- :mod:`.transform`: the cached bases (the one basis cache), :func:`dct` / :func:`idct` along an axis,
  :func:`dct_nd`, the per-chunk :func:`dct_chunks` / :func:`idct_chunks`, :func:`encode_chunks`;
- :mod:`.quantize`: :func:`select_topk` and the per-row int8 grid (:func:`quantize_int8`);
- :mod:`.decode`: :func:`decode_chunks` (float) and the bit-exact :func:`decode_levels` with its routes.

Every name is used as ``gradwire.dct.X``, as when this was one module. Setting a name here (a test's
``monkeypatch.setattr(gradwire.dct, "MATMUL_MAX_N", 0)``, a benchmark wrapping ``decode_levels``) sets it
in every module of the package that holds it, so knobs and spies reach the code that reads them; private
names are read from the module that owns them, live (``gradwire.dct._cache_bytes``).
"""

from __future__ import annotations

import sys
import types

from . import chunks, decode, quantize, transform
from .chunks import (
    MAX_TILE,
    MODE_FLAT,
    MODE_TILES,
    ChunkPlan,
    from_chunks,
    largest_divisor_at_most,
    plan_chunks,
    plan_flat,
    plan_tiles,
    plan_tiles_or_flat,
    small_tiles,
    tile_chunk_shape,
    to_chunks,
)
from .decode import (
    _EXACT_BLOCK_ELEMS,
    decode_chunks,
    decode_levels,
    decode_levels_weighted_sum,
    fixed_point_bits,
)
from .quantize import MIN_RANGE, dequantize_int8, quantize_int8, select_topk
from .transform import (
    _BASES,
    BASIS_CACHE_BYTES,
    MATMUL_MAX_N,
    clear_basis_cache,
    dct,
    dct_basis,
    dct_chunks,
    dct_nd,
    encode_chunks,
    idct,
    idct_chunks,
    idct_nd,
)

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

#: The modules of the package, bottom to top.
_PARTS = (chunks, transform, quantize, decode)


def __getattr__(name: str):
    """Any other name of the modules (the private ones, e.g. ``_cache_bytes``, which the basis cache
    rebinds), read live from the module that holds it."""
    for part in _PARTS if not name.startswith("__") else ():
        if name in vars(part):
            return vars(part)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """``gradwire.dct``: setting a name sets it in every module that holds it (where it is defined and
    where it was imported), as setting it on the one module did; a name read live stays live. Dunder
    names (``__doc__``, ``__spec__``, …) are the package's own."""

    def __setattr__(self, name: str, value) -> None:
        held = [] if name.startswith("__") else [part for part in _PARTS if name in vars(part)]
        for part in held:
            setattr(part, name, value)
        if name in vars(self) or not held:
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
