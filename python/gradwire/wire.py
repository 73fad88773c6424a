"""The typed face of the Rust kernels (``gradwire._native``).

Inputs are any bytes-like object or numpy array; they are viewed, not copied, and the GIL is
released while a kernel runs. Outputs are ``bytes`` or numpy arrays.
"""

from __future__ import annotations

import numpy as np

from . import _native

BytesLike = bytes | bytearray | memoryview | np.ndarray

__all__ = [
    "as_u8",
    "crc32c",
    "elias_decode",
    "elias_encode",
    "gcomp_block_levels",
    "gcomp_encode",
    "gcomp_exponent_counts",
    "gcomp_metric",
    "huffman_book",
    "huffman_book_lengths",
    "huffman_decode",
    "huffman_encode",
    "rice_decode",
    "rice_encode",
    "rice_param",
    "rice_param_estimate",
    "sparse_levels_decode",
    "sparse_levels_encode",
    "pack_bits",
    "quartic_decode",
    "quartic_encode",
    "unpack_bits",
    "unpack_bits_exact",
    "zero_run_decode",
    "zero_run_encode",
]


def as_u8(data: BytesLike) -> np.ndarray:
    """A zero-copy 1-D uint8 view of ``data`` (bytes, bytearray, memoryview or a contiguous array)."""
    if isinstance(data, np.ndarray):
        if data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous:
            return data
        if not data.flags.c_contiguous:
            raise ValueError("array must be C-contiguous to be viewed as bytes")
        return data.reshape(-1).view(np.uint8)
    if isinstance(data, memoryview) and not data.c_contiguous:
        raise ValueError("memoryview must be C-contiguous")
    return np.frombuffer(data, dtype=np.uint8)


def _as_array(values, dtype) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1 and values.flags.c_contiguous:
        return values  # already what the kernel takes: per-call overhead matters for small tensors
    arr = np.asarray(values)
    if arr.dtype != dtype:
        if arr.size and arr.dtype.kind in "iu":
            info = np.iinfo(dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"values must lie in [{info.min}, {info.max}], got range [{lo}, {hi}]")
        elif arr.size and arr.dtype.kind not in "iub":
            raise ValueError(f"expected integer values, got dtype {arr.dtype}")
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr.reshape(-1))


def pack_bits(values, bits: int) -> bytes:
    """Pack unsigned integers at ``bits`` bits each into an LSB-first stream (docs/FORMAT.md §6)."""
    return _native.pack_bits(_as_array(values, np.uint32), bits)


def unpack_bits(data: BytesLike, bits: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """Read ``count`` values of ``bits`` bits from the front of ``data``; extra bytes are ignored.

    With ``out`` (a contiguous uint32 array of ``count`` elements) the values are written there and
    ``out`` is returned: a caller that decodes every step reuses one buffer.
    """
    return _native.unpack_bits(as_u8(data), bits, count, out)


def unpack_bits_exact(data: BytesLike, bits: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """Like :func:`unpack_bits`, but ``data`` must be exactly the packed length with zero padding bits."""
    return _native.unpack_bits_exact(as_u8(data), bits, count, out)


def quartic_encode(trits) -> bytes:
    """3LC quartic encoding: five values of {-1, 0, 1} per byte, bytes in 0..=242."""
    return _native.quartic_encode(_as_array(trits, np.int8))


def quartic_decode(data: BytesLike, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`quartic_encode`: ``count`` int8 values in {-1, 0, 1} (into ``out`` if given)."""
    return _native.quartic_decode(as_u8(data), count, out)


def zero_run_encode(data: BytesLike) -> bytes:
    """3LC zero-run encoding of quartic bytes: runs of 121 become bytes 243..=255."""
    return _native.zero_run_encode(as_u8(data))


def zero_run_decode(data: BytesLike, expected_len: int | None = None, out: np.ndarray | None = None):
    """Inverse of :func:`zero_run_encode`; ``expected_len`` bounds and checks the output length.

    Returns ``bytes``; with ``out`` (a contiguous uint8 array whose length is the expected decoded
    length) the bytes are written there and ``out`` is returned instead.
    """
    if out is not None:
        if expected_len is not None and expected_len != len(out):
            raise ValueError(f"expected_len {expected_len} disagrees with len(out) {len(out)}")
        return _native.zero_run_decode_into(as_u8(data), out)
    return _native.zero_run_decode(as_u8(data), expected_len)


def crc32c(data: BytesLike, value: int = 0) -> int:
    """CRC-32C (Castagnoli); ``value`` continues a running checksum."""
    return _native.crc32c(as_u8(data), value)


# ------------------------------------------------------------------------------------------------
# Entropy coders (docs/FORMAT.md §6.2–6.4). Index sets are ``sets`` consecutive sets of ``set_len``
# indices each, strictly ascending within a set and below ``universe``; ``set_len=None`` means one
# set of all of them.


def _set_len(set_len: int | None, count: int) -> int:
    return count if set_len is None else int(set_len)


def rice_param(indices, universe: int, set_len: int | None = None) -> tuple[int, int]:
    """The Rice parameter coding the sets in the fewest bits, and the stream's length in bytes."""
    idx = _as_array(indices, np.uint32)
    return _native.rice_param(idx, _set_len(set_len, idx.size), int(universe))


def rice_param_estimate(set_len: int, universe: int) -> int:
    """A Rice parameter for sets of ``set_len`` random indices below ``universe``, without the data."""
    return _native.rice_param_estimate(int(set_len), int(universe))


def rice_encode(indices, universe: int, param: int, set_len: int | None = None) -> bytes:
    """Golomb-Rice code of sorted index sets: remainders at ``param`` bits, then unary quotients."""
    idx = _as_array(indices, np.uint32)
    return _native.rice_encode(idx, _set_len(set_len, idx.size), int(universe), int(param))


def rice_decode(
    data: BytesLike,
    count: int,
    universe: int,
    param: int,
    set_len: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``count`` uint32 indices from a Rice stream (into ``out`` if given); the stream must be exact."""
    return _native.rice_decode(as_u8(data), int(count), _set_len(set_len, count), int(universe), int(param), out)


def elias_encode(values, kind: str = "omega") -> bytes:
    """Elias-γ (``kind="gamma"``) or Elias-ω codes of positive integers as one bit stream."""
    return _native.elias_encode(_as_array(values, np.uint64), kind)


def elias_decode(data: BytesLike, count: int, kind: str = "omega") -> np.ndarray:
    """Exactly ``count`` Elias codes (uint64); the stream must end with the last one."""
    return _native.elias_decode(as_u8(data), int(count), kind)


def sparse_levels_encode(positions, levels, kind: str = "omega") -> bytes:
    """QSGD's stream: per nonzero level, the Elias code of the distance to the previous position,
    a sign bit and the Elias code of the magnitude."""
    return _native.sparse_levels_encode(_as_array(positions, np.uint64), _as_array(levels, np.int32), kind)


def sparse_levels_decode(
    data: BytesLike, count: int, universe: int, max_level: int, kind: str = "omega"
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` entries of a sparse level stream: ``(positions uint64, levels int32)``."""
    return _native.sparse_levels_decode(as_u8(data), int(count), int(universe), int(max_level), kind)


def huffman_book(counts, cap: int) -> bytes:
    """The serialized canonical Huffman codebook of 256 byte counts, codes at most ``cap`` bits
    (longer ones escaped: the escape code then the raw byte)."""
    c = _as_array(counts, np.uint64)
    if c.size != 256:
        raise ValueError(f"counts must hold 256 values, got {c.size}")
    return _native.huffman_book(c, int(cap))


def huffman_book_lengths(book: BytesLike) -> tuple[int, np.ndarray]:
    """Validate a serialized codebook: ``(cap, 257 code lengths)``, the escape's last, 0 = no code."""
    return _native.huffman_book_lengths(as_u8(book))


def huffman_encode(symbols, book: BytesLike) -> bytes:
    """Huffman-code bytes with a serialized codebook."""
    return _native.huffman_encode(_as_array(symbols, np.uint8), as_u8(book))


def huffman_decode(data: BytesLike, count: int, book: BytesLike) -> np.ndarray:
    """Exactly ``count`` uint8 symbols of a Huffman stream (table lookup, no tree walk)."""
    return _native.huffman_decode(as_u8(data), int(count), as_u8(book))


# ------------------------------------------------------------------------------------------------
# GComp's per-element work (docs/FORMAT.md §5.4): f32 bit patterns in (``uint32``), one pass each.


def gcomp_exponent_counts(bits: np.ndarray) -> np.ndarray:
    """How many of the f32 bit patterns ``bits`` have each biased exponent (256 uint64 counts)."""
    return _native.gcomp_exponent_counts(_as_array(bits, np.uint32))


def gcomp_metric(kind: str, grad_bits, param, first=None, second=None, **scalars: float) -> np.ndarray:
    """δ of the paper's Table 2 per element (float64), computed as ``gcomp.quantization_metric``
    computes it; ``first``/``second`` are the optimizer state (None = zeros), ``scalars`` its
    hyperparameters (``lr``, ``weight_decay``, ``momentum``, ``dampening``, ``beta1``, ``beta2``,
    ``eps``, ``alpha``, ``bias_correction1`` = 1 − β1^t)."""
    return _native.gcomp_metric(kind, *_metric_operands(grad_bits, param, first, second), **scalars)


def gcomp_block_levels(
    kind: str, grad_bits, param, first=None, second=None, *, block: int, thresholds, **scalars: float
) -> np.ndarray:
    """Per block, the largest level 1..3 whose threshold its smallest |δ| over nonzero elements
    reaches, else 0 (uint8); arguments as for :func:`gcomp_metric`."""
    return _native.gcomp_block_levels(
        kind,
        *_metric_operands(grad_bits, param, first, second),
        block=int(block),
        thresholds=thresholds if type(thresholds) is tuple else tuple(thresholds),
        **scalars,
    )


def _metric_operands(grad_bits, param, first, second):
    return _as_array(grad_bits, np.uint32), _f32_or_none(param), _f32_or_none(first), _f32_or_none(second)


def _f32_or_none(a) -> np.ndarray | None:
    if a is None or (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 1 and a.flags.c_contiguous):
        return a
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1)


def gcomp_encode(
    bits, format: int, block: int, levels, book: BytesLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """GComp's ``exp``, ``level``, ``sign`` and ``mant`` sections (uint8 arrays) of the f32 bit
    patterns ``bits`` (one level 0..3 per block of ``block``, the exponents coded with ``book``)
    and the f32 bit patterns (uint32) a receiver decodes."""
    return _native.gcomp_encode(
        _as_array(bits, np.uint32), int(format), int(block), _as_array(levels, np.uint8), as_u8(book)
    )
