"""Exact integer products for the bit-exact DCT decode, without float64.

The decode's fixed-point sums (see :mod:`.decode`) are integers. Here they are computed in integers:
each int64 operand is split into balanced base-128 digits in [-64, 63] (int8), every pair of digit
matrices is multiplied by ``torch._int_mm`` (int8 × int8 → int32, exact: |digit products| ≤ 2^12 and
K < 2^18 terms keep each int32 sum below 2^31), and the partial products are shifted and summed in
int64. An integer sum is the same in any order, so this gives the same integers as the float64 route
on any device, thread count or BLAS.
"""

from __future__ import annotations

import torch

__all__ = ["int_digits", "exact_int_mm", "dense_level_sums_int"]

_BASE_BITS = 7
_HALF = 1 << (_BASE_BITS - 1)
#: Terms of one int32 sum: |d_a·d_b| ≤ 2^12, so 2^18 terms stay below 2^30.
_MAX_K = 1 << 18


def int_digits(x: torch.Tensor) -> list[torch.Tensor]:
    """Balanced base-128 digits of int64 ``x`` (least significant first), each int8 in [-64, 63]."""
    digits = []
    r = x.to(torch.int64)
    while True:
        d = torch.remainder(r + _HALF, 1 << _BASE_BITS) - _HALF
        digits.append(d.to(torch.int8))
        r = torch.div(r - d, 1 << _BASE_BITS, rounding_mode="floor")
        if not bool(r.any()):
            return digits


def exact_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int64 matrices, exactly (the caller keeps the result below 2^63)."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"inner sizes differ: {k} and {k2}")
    if k > _MAX_K:
        raise ValueError(f"inner size {k} above {_MAX_K}: an int32 partial sum could overflow")
    # CUDA's int8 kernel wants M > 16 and K, N multiples of 8: pad with zeros (exact), cut after.
    pm = max(17, m) if a.device.type == "cuda" else m
    pk = -(-k // 8) * 8 if a.device.type == "cuda" else k
    pn = -(-n // 8) * 8 if a.device.type == "cuda" else n
    if (pm, pk, pn) != (m, k, n):
        a = torch.nn.functional.pad(a, (0, pk - k, 0, pm - m))
        b = torch.nn.functional.pad(b, (0, pn - n, 0, pk - k))
    da = int_digits(a)
    db = int_digits(b)
    out = torch.zeros((pm, pn), dtype=torch.int64, device=a.device)
    for i, x in enumerate(da):
        for j, y in enumerate(db):
            out += torch._int_mm(x, y).to(torch.int64) << (_BASE_BITS * (i + j))
    return out[:m, :n]


def dense_level_sums_int(idx: torch.Tensor, levels: torch.Tensor, dims: tuple[int, ...], bases: list[torch.Tensor]):
    """The "dense" route of :mod:`.decode` in integers: ``(L, O)`` int64, the levels' and the ones'
    transforms, equal to the float64 route's exact integers."""
    nb = idx.shape[0]
    c = 1
    for d in dims:
        c *= d
    grid = torch.zeros((2, nb, c), dtype=torch.int64, device=levels.device)
    grid[0].scatter_(1, idx, levels.to(torch.int64))
    grid[1].scatter_(1, idx, torch.ones_like(levels, dtype=torch.int64))
    y = grid.reshape(2 * nb, *dims)
    for axis, basis in enumerate(bases, start=1):
        moved = torch.movedim(y, axis, -1)
        shape = moved.shape
        prod = exact_int_mm(moved.reshape(-1, shape[-1]), basis.to(torch.int64))
        y = torch.movedim(prod.reshape(shape), -1, axis)
    return y[:nb], y[nb:]
