"""Exact integer products for the bit-exact DCT decode, without float64.

The decode's fixed-point sums (see :mod:`.decode`) are integers. Here they are computed in integers: the
int64 operands are split into base-128 digits (int8), every pair of digit matrices is multiplied at once
by ONE ``torch._int_mm`` (int8 × int8 → int32, exact) over the digits stacked into one 2-D product, and the
partial products are shifted and summed in int64. An integer sum is the same in any order, so this gives
the same integers as the float64 route on any device, thread count or BLAS.

How many digits an operand needs follows from a bound known on the host (the basis's largest entry, the
levels' range, the number of terms), never from the data: a GPU decode makes no host round trip for it.

Why one product stays exact: the left operand's digits are balanced, in [-64, 63], the right's plain, in
[0, 127] (the right operand is offset by ``2^(7n-1)`` first, which is taken back exactly afterwards from
the left's row sums), so each digit product is at most 2^13 in magnitude and ``K`` terms stay below 2^31
while ``K < 2^18``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .basis import cached, device_key, fixed_point_basis

__all__ = [
    "int_digits",
    "digit_count",
    "exact_int_mm",
    "IntegerBasis",
    "integer_basis",
    "dense_last_axis",
    "rows_level_sums_int",
]

_BASE_BITS = 7
_HALF = 1 << (_BASE_BITS - 1)
#: Terms of one int32 sum: |d_a·d_b| ≤ 64·127 < 2^13, so 2^18 terms stay below 2^31.
_MAX_K = 1 << 18
#: Levels are integers in [0, 255] (FORMAT.md).
_MAX_LEVEL = 255


def digit_count(bound: int) -> int:
    """Balanced base-128 digits (each in [-64, 63]) that hold every integer of magnitude ``<= bound``."""
    n = 1
    while 63 * ((1 << (_BASE_BITS * n)) - 1) // 127 < bound:
        n += 1
    return n


def int_digits(x: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
    """Balanced base-128 digits of int64 ``x`` (least significant first), each int8 in [-64, 63].

    With ``count`` (from a bound: :func:`digit_count`) exactly that many, without looking at the data;
    without it, as many as the data needs (one host round trip per digit).
    """
    digits = []
    r = x.to(torch.int64)
    while True:
        d = torch.remainder(r + _HALF, 1 << _BASE_BITS) - _HALF
        digits.append(d.to(torch.int8))
        r = torch.div(r - d, 1 << _BASE_BITS, rounding_mode="floor")
        if count is not None:
            if len(digits) == count:
                return digits
        elif not bool(r.any()):
            return digits


def _plain_digits(b: torch.Tensor, count: int) -> torch.Tensor:
    """``(K, count, N)`` int8 digits in [0, 127] of ``b + 2^(7·count - 1)`` (``|b| < 2^(7·count - 1)``),
    least significant first: one shift and one mask over all digits."""
    shifts = torch.arange(0, _BASE_BITS * count, _BASE_BITS, device=b.device, dtype=torch.int64)
    offset = b + (1 << (_BASE_BITS * count - 1))
    return torch.bitwise_and(offset.unsqueeze(1) >> shifts.view(1, -1, 1), (1 << _BASE_BITS) - 1).to(torch.int8)


def _stacked_mm(a_digits: torch.Tensor, a_row_sums: torch.Tensor, b: torch.Tensor, b_count: int) -> torch.Tensor:
    """``a @ b`` exactly, int64, for ``a`` given as stacked balanced digits ``(na, M, K)`` (with its row
    sums) and int64 ``b`` ``(K, N)`` with ``|b| < 2^(7·b_count - 1)``: one ``_int_mm`` of every digit pair."""
    na, m, k = a_digits.shape
    n = b.shape[1]
    if k > _MAX_K:
        raise ValueError(f"inner size {k} above {_MAX_K}: an int32 partial sum could overflow")
    bd = _plain_digits(b, b_count).reshape(k, b_count * n)
    a2 = a_digits.reshape(na * m, k)
    cuda = b.device.type == "cuda"
    # CUDA's int8 kernel wants M > 16 and K, N multiples of 8: pad with zeros (exact), cut after.
    pm = max(17, na * m) if cuda else na * m
    pk = -(-k // 8) * 8 if cuda else k
    pn = -(-(b_count * n) // 8) * 8 if cuda else b_count * n
    if (pm, pk, pn) != (na * m, k, b_count * n):
        a2 = torch.nn.functional.pad(a2, (0, pk - k, 0, pm - na * m))
        bd = torch.nn.functional.pad(bd, (0, pn - b_count * n, 0, pk - k))
    prod = torch._int_mm(a2.contiguous(), bd.contiguous())
    if (pm, pn) != (na * m, b_count * n):
        prod = prod[: na * m, : b_count * n]
    # Every pair's product shifted by its digits' weight 2^(7(i+j)) and summed, in three kernels whatever
    # the digit counts (the int64 copy of the products is the block's largest scratch: decode's
    # _exact_block sizes blocks for it).
    parts = prod.reshape(na, m, b_count, n).to(torch.int64)
    shifts = torch.arange(na, device=b.device).view(na, 1, 1, 1) + torch.arange(b_count, device=b.device).view(
        1, 1, -1, 1
    )
    parts.bitwise_left_shift_(shifts * _BASE_BITS)
    out = parts.sum(dim=(0, 2))
    out -= a_row_sums.unsqueeze(1) * (1 << (_BASE_BITS * b_count - 1))
    return out


def exact_int_mm(
    a: torch.Tensor, b: torch.Tensor, a_bound: int | None = None, b_bound: int | None = None
) -> torch.Tensor:
    """``a @ b`` for int64 matrices, exactly (the caller keeps the result below 2^63).

    ``a_bound`` and ``b_bound`` bound the operands' magnitudes; without them they are read from the data
    (a host round trip each)."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"inner sizes differ: {k} and {k2}")
    a = a.to(torch.int64)
    b = b.to(torch.int64)
    a_bound = int(a.abs().max()) if a_bound is None and a.numel() else (a_bound or 0)
    b_bound = int(b.abs().max()) if b_bound is None and b.numel() else (b_bound or 0)
    a_digits = torch.stack(int_digits(a, digit_count(a_bound)))
    return _stacked_mm(a_digits, a.sum(dim=1), b, digit_count(b_bound))


@dataclass(frozen=True)
class IntegerBasis:
    """One axis's integer basis ``B`` (``round(D·2^s)``) ready for the integer route: ``B`` as int64, the
    digits of ``B^T`` stacked ``(na, n, n)``, the row sums of ``B^T``, and ``max |B|`` (known on the host)."""

    basis: torch.Tensor
    t_digits: torch.Tensor
    t_row_sums: torch.Tensor
    max_abs: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.basis, self.t_digits, self.t_row_sums))


def integer_basis(n: int, s: int, device: torch.device) -> IntegerBasis:
    """The :class:`IntegerBasis` of size ``n`` on the grid ``2^-s`` (the same integers as the float64
    route's :func:`.basis.fixed_point_basis`), built on the host once per device, in the one basis cache."""
    dev = device_key(device)

    def build() -> IntegerBasis:
        host = fixed_point_basis(n, s, "cpu").to(torch.int64)
        max_abs = int(host.abs().max())
        t = host.T.contiguous()
        digits = torch.stack(int_digits(t, digit_count(max_abs)))
        return IntegerBasis(host.to(dev), digits.to(dev), t.sum(dim=1).to(dev), max_abs)

    return cached(("integer", n, s, dev), build)


def dense_last_axis(k: int, dims: Sequence[int]) -> bool:
    """Whether the integer route transforms the last axis densely (levels scattered into the chunk grid, one
    stacked ``_int_mm``) rather than adding a gathered basis row per coefficient: above ``2·C/last``
    coefficients per chunk the gathered rows (``4·k·last`` int64 per chunk) outweigh the grid's product."""
    return k * dims[-1] > 2 * math.prod(dims)


def rows_level_sums_int(idx: torch.Tensor, levels: torch.Tensor, dims: tuple[int, ...], bases: Sequence[IntegerBasis]):
    """The decode's level sums in integers: the last axis first, then every other axis by one stacked
    ``_int_mm`` over the whole block. The last axis by the float64 "rows" route's method (each
    coefficient's basis row added into its chunk row, in int64) at small ``k``; at large ``k``
    (:func:`dense_last_axis`) the levels are scattered into the chunks' grid and the last axis is one more
    stacked product. Returns ``(L, O)``, ``(nb, *dims)`` int64 views, equal to the float64 routes' exact
    integers."""
    nb, k = idx.shape
    last = dims[-1]
    rest = math.prod(dims[:-1])
    device = idx.device
    ib = bases
    if dense_last_axis(k, dims):
        # grid[f_last, (row, chunk, channel)]: the levels (channel 0) and ones (channel 1) at their positions
        grid = torch.zeros((last, rest * nb * 2), dtype=torch.int64, device=device)
        at = (idx % last) * (rest * nb * 2) + ((idx // last) * nb + torch.arange(nb, device=device).unsqueeze(1)) * 2
        flat = grid.view(-1)
        flat[at.reshape(-1)] = levels.to(torch.int64).reshape(-1)
        flat[at.reshape(-1) + 1] = 1
        b = ib[-1]
        y = _stacked_mm(b.t_digits, b.t_row_sums, grid, digit_count(_MAX_LEVEL))  # (last position, rest·nb·2)
        t = y.reshape(last, rest * nb, 2).permute(1, 2, 0).reshape(rest * nb, 2 * last)
    else:
        t = torch.zeros((rest * nb, 2 * last), dtype=torch.int64, device=device)
        rowvecs = ib[-1].basis.index_select(0, (idx % last).reshape(-1)).reshape(nb, k, 1, last)
        u = levels.to(torch.int64).reshape(nb, k, 1, 1)
        vals = torch.cat([u * rowvecs, rowvecs], dim=2).reshape(nb * k, 2 * last)
        at = ((idx // last) * nb + torch.arange(nb, device=device).unsqueeze(1)).reshape(-1)
        t.index_add_(0, at, vals)
    # At most min(k, last) coefficients of a chunk share one of its rows.
    bound = _MAX_LEVEL * ib[-1].max_abs * min(k, last)
    y = t.reshape(*dims[:-1], -1)
    for axis in range(len(dims) - 1):
        b = ib[axis]
        shape = y.shape
        y = _stacked_mm(b.t_digits, b.t_row_sums, y.reshape(dims[axis], -1), digit_count(bound)).reshape(shape)
        bound *= b.max_abs * dims[axis]
        if len(dims) > 2:
            y = torch.movedim(y, 0, len(dims) - 2)
    y = torch.movedim(y.contiguous().reshape(*dims[:-1], nb, 2, last), len(dims) - 1, 0)
    return y.select(-2, 0), y.select(-2, 1)
