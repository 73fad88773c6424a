"""The integer (int8 digits through torch._int_mm) level sums equal the float64 route's exact integers."""

import pytest
import torch

from gradwire.dct import decode
from gradwire.dct.integer import dense_level_sums_int, exact_int_mm, int_digits


@pytest.mark.parametrize("dims", [(64,), (37,), (8, 8), (16, 16), (64, 64), (5, 7), (3, 4, 5)])
@pytest.mark.parametrize("k", [1, 3, 17])
def test_integer_sums_equal_float64_route(dims, k):
    c = 1
    for d in dims:
        c *= d
    k = min(k, c)
    g = torch.Generator().manual_seed(hash((dims, k)) & 0xFFFF)
    nb = 3
    idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(nb)])
    levels = torch.randint(0, 256, (nb, k), generator=g)
    levels[0] = 255  # extreme levels
    s = decode.fixed_point_bits(dims)
    bases = [decode._int_basis(n, s, torch.device("cpu")) for n in dims]
    ref_l, ref_o = decode._dense_level_sums(idx, levels, dims, bases)
    got_l, got_o = dense_level_sums_int(idx, levels, dims, bases)
    assert got_l.dtype == torch.int64
    assert torch.equal(got_l, ref_l.to(torch.int64))
    assert torch.equal(got_o, ref_o.to(torch.int64))


def test_exact_int_mm_matches_int64_product():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-(1 << 40), 1 << 40, (19, 24), generator=g)
    b = torch.randint(-(1 << 20), 1 << 20, (24, 9), generator=g)
    assert torch.equal(exact_int_mm(a, b), a @ b)


def test_digits_reassemble():
    x = torch.tensor([0, 1, -1, 63, 64, -64, -65, (1 << 50) + 12345, -(1 << 50)])
    total = sum(d.to(torch.int64) << (7 * i) for i, d in enumerate(int_digits(x)))
    assert torch.equal(total, x)


@pytest.mark.parametrize("dims", [(64,), (8, 8), (16, 16), (64, 64), (5, 7)])
@pytest.mark.parametrize("k", [1, 9])
def test_integer_route_decodes_equal_bits(dims, k):
    c = 1
    for d in dims:
        c *= d
    g = torch.Generator().manual_seed(7 * c + k)
    n = 4
    idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(n)])
    levels = torch.randint(0, 256, (n, k), generator=g)
    scales = torch.rand(n, generator=g) * 1e-2
    mins = -torch.rand(n, generator=g)
    ref = decode.decode_level_chunks(idx, levels, scales, mins, dims, route="dense")
    got = decode.decode_level_chunks(idx, levels, scales, mins, dims, route="integer")
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
