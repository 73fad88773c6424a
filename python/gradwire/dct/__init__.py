"""The DCT codec (codec id 1) in one package: its math, its write side and its readers.

One namespace, ``gradwire.dct``, over twelve modules, each importing only the ones above it:

- the math, plain torch on any device: :mod:`.chunks` (the two chunkings, mode 0 flat and mode 1 tiles,
  :class:`ChunkPlan`), :mod:`.basis` (every basis the package uses, in the one cache that
  :func:`clear_basis_cache` empties), :mod:`.transform` (:func:`dct` / :func:`idct` along an axis,
  :func:`dct_nd`, the per-chunk :func:`dct_chunks` / :func:`idct_chunks`, :func:`encode_chunks`),
  :mod:`.integer` (exact int64 products through int8 digits, the decode's "integer" route),
  :mod:`.route_choice` (which exact route a GPU takes, measured on the device: :func:`set_exact_decode`,
  ``GRADWIRE_EXACT_DECODE``), :mod:`.decode` (:func:`decode_chunks`, and the bit-exact
  :func:`decode_levels` every node reproduces), :mod:`.quantize` (:func:`select_topk`, the int8 grid and a
  record's ``2^b`` levels);
- the record: :mod:`.layout` (FORMAT.md §5.2's params, sections, codes and limits), :mod:`.parse` (every
  record read as hostile input: :func:`parse_record`, :class:`ParseCache`, :func:`records_parsed_once`),
  :mod:`.domain` (records in their coefficient domain: :class:`DCTAccumulator`, the norm and coordinates,
  and :class:`CoefficientDomain`, where a mean is re-encoded), :mod:`.codec` (:class:`DCTCodec`, the write
  side), :mod:`.capabilities` (the capability object the frame readers find under id 1, and its decoders).

The public names are re-exported here (each module is an attribute too: ``gradwire.dct.decode``), so code
calls ``gradwire.dct.X`` (``gradwire.DCTCodec`` and
``gradwire.codecs.DCTCodec`` are the codec too). This is a plain re-export: assigning a name on
``gradwire.dct`` rebinds it here only. A setting such as ``MATMUL_MAX_N``, ``BASIS_CACHE_BYTES`` or
``_EXACT_BLOCK_ELEMS`` is read from the module that defines it (``gradwire.dct.transform``,
``gradwire.dct.basis``, ``gradwire.dct.decode``), and a function is looked up in the namespace its caller
imported it from. Patch a name there.
"""

from __future__ import annotations

from .basis import BASIS_CACHE_BYTES, clear_basis_cache, dct_basis
from .capabilities import CAPABILITIES  # the capability object of codec id 1, declared as it is imported
from .chunks import (
    MAX_TILE,
    MODE_FLAT,
    MODE_TILES,
    ChunkPlan,
    cut_into_chunks,
    from_chunks,
    largest_divisor_at_most,
    plan_chunks,
    plan_flat,
    plan_tiles,
    plan_tiles_or_flat,
    put_back_chunks,
    small_tiles,
    tile_chunk_shape,
    to_chunks,
)
from .codec import DCTCodec
from .decode import (
    decode_chunks,
    decode_level_chunks,
    decode_levels,
    decode_levels_weighted_sum,
    fixed_point_bits,
)
from .domain import CoefficientDomain, DCTAccumulator, dct_record_coefficients, dct_record_norm
from .integer import digit_count, exact_int_mm, int_digits, rows_level_sums_int
from .layout import (
    INDEX_CODING_FIXED,
    INDEX_CODING_RICE,
    MAX_CHUNK_NUMEL,
    VALUE_BITS,
    index_bits_for,
    index_stream_sizes,
    pack_params,
    unpack_params,
)
from .parse import ParseCache, ParsedRecord, decode_parsed, parse_record, records_parsed_once
from .quantize import MIN_RANGE, dequantize_int8, dequantize_levels, quantize_int8, quantize_levels, select_topk
from .route_choice import set_exact_decode
from .transform import MATMUL_MAX_N, dct, dct_chunks, dct_nd, encode_chunks, idct, idct_chunks, idct_nd

__all__ = [
    "BASIS_CACHE_BYTES",
    "CAPABILITIES",
    "INDEX_CODING_FIXED",
    "INDEX_CODING_RICE",
    "MATMUL_MAX_N",
    "MAX_CHUNK_NUMEL",
    "MAX_TILE",
    "MIN_RANGE",
    "MODE_FLAT",
    "MODE_TILES",
    "VALUE_BITS",
    "ChunkPlan",
    "CoefficientDomain",
    "DCTAccumulator",
    "DCTCodec",
    "ParseCache",
    "ParsedRecord",
    "clear_basis_cache",
    "cut_into_chunks",
    "dct",
    "dct_basis",
    "dct_chunks",
    "dct_nd",
    "dct_record_coefficients",
    "dct_record_norm",
    "decode_chunks",
    "decode_level_chunks",
    "decode_levels",
    "decode_levels_weighted_sum",
    "decode_parsed",
    "dequantize_int8",
    "dequantize_levels",
    "digit_count",
    "encode_chunks",
    "exact_int_mm",
    "fixed_point_bits",
    "from_chunks",
    "idct",
    "idct_chunks",
    "idct_nd",
    "index_bits_for",
    "index_stream_sizes",
    "int_digits",
    "largest_divisor_at_most",
    "pack_params",
    "parse_record",
    "plan_chunks",
    "plan_flat",
    "plan_tiles",
    "plan_tiles_or_flat",
    "put_back_chunks",
    "quantize_int8",
    "quantize_levels",
    "records_parsed_once",
    "rows_level_sums_int",
    "select_topk",
    "set_exact_decode",
    "small_tiles",
    "tile_chunk_shape",
    "to_chunks",
    "unpack_params",
]
