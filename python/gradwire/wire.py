"""The typed face of the Rust kernels (``gradwire._native``).

Inputs are any bytes-like object or numpy array; they are viewed, not copied, and the GIL is
released while a kernel runs. Outputs are ``bytes`` or numpy arrays.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from . import _native

BytesLike = Union[bytes, bytearray, memoryview, np.ndarray]

__all__ = [
    "as_u8",
    "crc32c",
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


def unpack_bits(data: BytesLike, bits: int, count: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Read ``count`` values of ``bits`` bits from the front of ``data``; extra bytes are ignored.

    With ``out`` (a contiguous uint32 array of ``count`` elements) the values are written there and
    ``out`` is returned: a caller that decodes every step reuses one buffer.
    """
    return _native.unpack_bits(as_u8(data), bits, count, out)


def unpack_bits_exact(data: BytesLike, bits: int, count: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Like :func:`unpack_bits`, but ``data`` must be exactly the packed length with zero padding bits."""
    return _native.unpack_bits_exact(as_u8(data), bits, count, out)


def quartic_encode(trits) -> bytes:
    """3LC quartic encoding: five values of {-1, 0, 1} per byte, bytes in 0..=242."""
    return _native.quartic_encode(_as_array(trits, np.int8))


def quartic_decode(data: BytesLike, count: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Inverse of :func:`quartic_encode`: ``count`` int8 values in {-1, 0, 1} (into ``out`` if given)."""
    return _native.quartic_decode(as_u8(data), count, out)


def zero_run_encode(data: BytesLike) -> bytes:
    """3LC zero-run encoding of quartic bytes: runs of 121 become bytes 243..=255."""
    return _native.zero_run_encode(as_u8(data))


def zero_run_decode(data: BytesLike, expected_len: int | None = None, out: Optional[np.ndarray] = None):
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
