"""The PowerSGD math shared by the frame codec (:mod:`gradwire.codecs.powersgd`) and the collective hook
(:mod:`gradwire.torch.powersgd`): which matrices are compressed, how the first ``Q`` is drawn and how a
factor is orthogonalized. Both follow torch's ``powerSGD_hook`` here.

- :func:`should_compress`: a ``rows × cols`` matrix goes as rank-``r`` factors only when they are
  strictly smaller, ``(rows + cols) · r · min_compression < rows · cols`` (``r = min(rank, rows, cols)``).
- :func:`initial_q`: the first ``Q`` is a standard normal draw on the host from a seeded CPU generator,
  moved to the device afterwards, so every worker and device draws the same ``Q``.
- :func:`orthogonalize_`: Gram–Schmidt for ``r <= 2`` or half precision, the Q of a reduced QR
  factorization otherwise; a zero column stays zero instead of becoming NaN.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

__all__ = ["compressible", "initial_q", "matrix_shape", "name_seed", "orthogonalize_", "should_compress"]


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix view ``(shape[0], numel / shape[0])`` of a tensor; ``(numel, 1)`` for ``ndim <= 1``."""
    shape = tuple(int(d) for d in shape)
    rest = 1
    for d in shape[1:]:
        rest *= d
    if len(shape) <= 1:
        return (shape[0] if shape else 1), 1
    return shape[0], rest


def should_compress(rows: int, cols: int, rank: int, min_compression: float = 1.0) -> bool:
    """Whether a ``rows × cols`` matrix goes as rank-``rank`` factors: only when the factors,
    ``(rows + cols) · rank`` values, times ``min_compression`` are strictly fewer than ``rows · cols``
    (torch's ``powerSGD_hook`` rule)."""
    return rank >= 1 and (rows + cols) * rank * min_compression < rows * cols


def compressible(shape: Sequence[int], rank: int, min_compression: float = 1.0) -> bool:
    """:func:`should_compress` for a tensor of ``shape`` viewed as a matrix; vectors (``ndim <= 1``) never are."""
    if len(shape) < 2:
        return False
    rows, cols = matrix_shape(shape)
    return should_compress(rows, cols, min(rank, rows, cols), min_compression)


def name_seed(name: str, seed: int = 0) -> int:
    """A seed for tensor ``name``'s first ``Q``, the same on every worker: ``seed`` and the CRC-32 of the name."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def initial_q(
    cols: int,
    rank: int,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A first ``Q`` (``cols × rank``, i.i.d. standard normal) drawn on the host from ``generator`` (a CPU
    generator) and moved to ``device``: the same numbers on every device."""
    return torch.randn(cols, rank, generator=generator, dtype=dtype).to(device)


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalize the columns of ``matrix`` (n × r) in place and return it.

    Gram–Schmidt for ``r <= 2`` or half precision, the Q of a reduced QR factorization otherwise (torch's
    choice). With ``epsilon == 0`` a column of zeros stays zero instead of becoming NaN.
    """
    _, r = matrix.shape
    if r <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrix[:, i : i + 1]
            norm = torch.linalg.vector_norm(col, dim=0, keepdim=True)
            if epsilon == 0:
                col.div_(torch.where(norm == 0, torch.ones_like(norm), norm))
            else:
                col.div_(norm + epsilon)
            if i + 1 < r:
                rest = matrix[:, i + 1 :]
                rest.sub_(torch.sum(col * rest, dim=0, keepdim=True) * col)
    else:
        matrix.copy_(torch.linalg.qr(matrix, mode="reduced").Q)
    return matrix
