"""The integer route (int8 digits through one stacked torch._int_mm) gives the float64 routes' exact integers and
bits; its digit counts come from bounds, not data; a device picks a route by measuring both."""

import pytest
import torch

from gradwire.dct import basis, decode, route_choice
from gradwire.dct.integer import digit_count, exact_int_mm, int_digits, integer_basis, rows_level_sums_int


@pytest.mark.parametrize("dims", [(64,), (37,), (8, 8), (16, 16), (64, 64), (5, 7), (3, 4, 5)])
@pytest.mark.parametrize("k", [1, 3, 17, 10_000])
def test_integer_sums_equal_float64_route(dims, k):
    c = 1
    for d in dims:
        c *= d
    k = min(k, c)
    g = torch.Generator().manual_seed(hash((dims, k)) & 0xFFFF)
    nb = 3
    idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(nb)])
    levels = torch.randint(0, 256, (nb, k), generator=g)
    levels[0] = 255  # extreme levels: with k = C (every position), the largest sums the bounds allow
    s = decode.fixed_point_bits(dims)
    bases = [basis.fixed_point_basis(n, s, "cpu") for n in dims]
    ref_l, ref_o = decode._dense_level_sums(idx, levels, dims, bases)
    got_l, got_o = rows_level_sums_int(idx, levels, dims, [integer_basis(n, s, torch.device("cpu")) for n in dims])
    assert got_l.dtype == torch.int64
    assert torch.equal(got_l.reshape(ref_l.shape), ref_l.to(torch.int64))
    assert torch.equal(got_o.reshape(ref_o.shape), ref_o.to(torch.int64))


def test_exact_int_mm_matches_int64_product():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-(1 << 40), 1 << 40, (19, 24), generator=g)
    b = torch.randint(-(1 << 20), 1 << 20, (24, 9), generator=g)
    assert torch.equal(exact_int_mm(a, b), a @ b)
    # with bounds given (no look at the data), at the bounds' very edge
    a[0, 0], b[0, 0] = -(1 << 40), (1 << 20)
    assert torch.equal(exact_int_mm(a, b, a_bound=1 << 40, b_bound=1 << 20), a @ b)


def test_digit_count_is_the_fewest_digits_that_hold_the_bound():
    for bound in [0, 1, 63, 64, 8127, 8128, (1 << 26) + 5, (1 << 52)]:
        n = digit_count(bound)
        for x in (bound, -bound):
            digits = int_digits(torch.tensor([x]), count=n)
            assert sum(int(d) << (7 * i) for i, d in enumerate(digits)) == x
        if n > 1:  # one digit fewer cannot hold it
            top = 63 * ((1 << (7 * (n - 1))) - 1) // 127
            assert bound > top


def test_digits_reassemble():
    x = torch.tensor([0, 1, -1, 63, 64, -64, -65, (1 << 50) + 12345, -(1 << 50)])
    total = sum(d.to(torch.int64) << (7 * i) for i, d in enumerate(int_digits(x)))
    assert torch.equal(total, x)


def _level_records(dims, k: int, n: int, seed: int):
    """``n`` chunks' ``(idx, levels, scales, mins)`` of ``k`` random positions each, as a record holds them."""
    c = 1
    for d in dims:
        c *= d
    g = torch.Generator().manual_seed(c + seed)
    idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(n)])
    levels = torch.randint(0, 256, (n, k), generator=g)
    return idx, levels, torch.rand(n, generator=g) * 1e-2, -torch.rand(n, generator=g)


@pytest.mark.parametrize("dims", [(64,), (8, 8), (16, 16), (64, 64), (5, 7)])
@pytest.mark.parametrize("k", [1, 9])
def test_integer_route_decodes_equal_bits(dims, k):
    idx, levels, scales, mins = _level_records(dims, k, 4, seed=7 * k)
    ref = decode.decode_level_chunks(idx, levels, scales, mins, dims, route="dense")
    got = decode.decode_level_chunks(idx, levels, scales, mins, dims, route="integer")
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_auto_picks_the_faster_route_once_per_shape_and_modes_override(monkeypatch):
    monkeypatch.delenv("GRADWIRE_EXACT_DECODE", raising=False)
    route_choice.set_exact_decode(None)
    calls = []

    def time_route(route):
        calls.append(route)
        return {"rows": 2.0, "integer": 1.0}[route]

    dev = torch.device("cuda", 0)  # only a key here: nothing runs on it
    try:
        assert route_choice.device_route(40, (64, 64), dev, "rows", time_route) == "integer"
        n = len(calls)
        assert set(calls) == {"rows", "integer"}
        # the same shape and k bucket (33..64): measured once
        assert route_choice.device_route(60, (64, 64), dev, "rows", time_route) == "integer" and len(calls) == n
        (row,) = route_choice.choices()
        assert row["route"] == "integer" and row["k_bucket"] == 64 and row["rows_ms"] > row["integer_ms"]
        assert (
            route_choice.kept_route(dev, (64, 64), 50) == "integer"
            and route_choice.kept_route(dev, (64, 64), 8) is None
        )

        # a device without the int8 kernel: auto keeps the float64 route
        def no_int8(route):
            if route == "integer":
                raise RuntimeError("_int_mm_out_cuda: not supported on this device")
            return 1.0

        assert route_choice.device_route(40, (8, 8), dev, "sparse", no_int8) == "sparse"
        route_choice.set_exact_decode("float64")
        assert route_choice.device_route(40, (64, 64), dev, "rows", time_route) == "rows"
        route_choice.set_exact_decode("integer")
        assert route_choice.device_route(40, (64, 64), dev, "sparse", time_route) == "integer"
        with pytest.raises(ValueError, match="exact decode mode"):
            route_choice.set_exact_decode("fast")
        route_choice.set_exact_decode(None)
        monkeypatch.setenv("GRADWIRE_EXACT_DECODE", "quick")
        with pytest.raises(ValueError, match="GRADWIRE_EXACT_DECODE='quick'"):
            route_choice.exact_decode_mode()
    finally:
        route_choice.set_exact_decode(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dims,k", [((64, 64), 32), ((64, 64), 472), ((8, 8), 4), ((64,), 8)])
def test_cuda_routes_give_the_cpus_bits(dims, k):
    """On a GPU the integer route (stacked _int_mm), the float64 route and the measured choice all give the bits
    of the CPU's decode."""
    idx, levels, scales, mins = _level_records(dims, k, 300, seed=k)
    ref = decode.decode_level_chunks(idx, levels, scales, mins, dims, route="dense")
    cuda = [t.cuda() for t in (idx, levels, scales, mins)]
    float_route = decode._choose_route(k, dims, torch.device("cuda"))
    for route in ("integer", float_route, None):
        got = decode.decode_level_chunks(*cuda, dims, route=route).cpu()
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), route
    print(route_choice.choices())
