"""DCT frames decode to the same bits on every thread count and by either route: nodes that apply the
same frames hold the same weights."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire import dct as D
from gradwire.dct import decode as dct_decode  # reads _EXACT_BLOCK_ELEMS; patch it here


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _levels(plan, k, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.sort(torch.rand(plan.num_chunks, plan.chunk_numel, generator=g).argsort(dim=1)[:, :k], dim=1).values
    levels = torch.randint(0, 256, (plan.num_chunks, k), generator=g, dtype=torch.int16)
    scales = torch.rand(plan.num_chunks, generator=g) * 0.01 + 1e-4
    mins = -torch.rand(plan.num_chunks, generator=g)
    return idx, levels, scales, mins


@pytest.mark.parametrize(
    "chunk, k", [((64, 64), 32), ((8, 8), 16), ((16,), 5), ((4, 4, 4), 7), ((8, 8), 60), ((1024,), 3)]
)
def test_exact_decode_matches_the_matrix_inverse(chunk, k):
    plan = D.plan_flat((3000,), chunk)
    idx, levels, scales, mins = _levels(plan, k, 0)
    values = levels.float() * scales[:, None] + mins[:, None]
    exact = D.decode_levels(idx, levels, scales, mins, plan)
    assert exact.dtype == torch.float32
    # the integer basis is round(D · 2^s): its error is ~2^-s, far below int8 quantization's 1/255
    torch.testing.assert_close(exact, D.decode_chunks(idx, values, plan), rtol=0, atol=2e-4 * values.abs().max().item())


@pytest.mark.parametrize(
    "chunk, k",
    [
        ((64, 64), 32),
        ((64, 64), 700),
        ((8, 8), 60),
        ((4, 4, 4), 7),
        ((4, 5, 6), 50),
        ((16,), 5),
        ((64,), 32),
        ((6, 10), 1),
    ],
)
def test_every_route_gives_the_same_bits(chunk, k):
    plan = D.plan_flat((20000,), chunk)
    args = _levels(plan, k, 1)
    dense = D.decode_levels(*args, plan, route="dense")
    for route in ("sparse", "rows"):
        assert torch.equal(D.decode_levels(*args, plan, route=route), dense), route


@pytest.mark.parametrize(
    "shape, k", [((192, 320), 40), ((64, 64), 100), ((130, 64 * 7), 30), ((96, 4, 5), 9), ((90, 252), 20)]
)
def test_tiles_decode_in_place_by_every_route(restore_threads, monkeypatch, shape, k):
    # The rows route combines tiles straight into the matrix (no tile-to-matrix copy); a block of
    # chunks may start and end inside a tile row, so small blocks and odd grids are tried too. Blocks
    # apply where the folded Rust pass does not (tiles with an odd side): (90, 252) has 45×63 tiles in
    # rows of 4, so a block of 3 starts inside a tile row.
    plan = D.plan_tiles(shape)
    assert plan.mode == D.MODE_TILES and len(plan.chunk_shape) == 2
    args = _levels(plan, min(k, plan.chunk_numel), 4)
    dense = D.decode_levels(*args, plan, route="dense")
    assert dense.shape == shape
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(D.decode_levels(*args, plan, route="rows"), dense), threads
    # decode_levels reads the block size from its own module, gradwire.dct.decode.
    monkeypatch.setattr(dct_decode, "_EXACT_BLOCK_ELEMS", 3 * 2 * plan.chunk_numel)  # blocks of 3 chunks
    assert torch.equal(D.decode_levels(*args, plan, route="rows"), dense)


def test_an_unknown_route_is_refused():
    plan = D.plan_flat((64,), (8, 8))
    with pytest.raises(ValueError, match="route"):
        D.decode_levels(*_levels(plan, 3, 0), plan, route="fast")


def test_the_rows_kernel_refuses_a_position_outside_the_chunk():
    import numpy as np

    from gradwire import _native

    out = np.zeros(2 * 2 * 4)
    with pytest.raises(_native.WireError) as err:
        _native.dct_scatter_basis_rows(np.array([0, 8]), np.array([1, 1], dtype=np.int16), 2, 2, 4, np.ones(16), out)
    assert err.value.kind == "index_out_of_range" and not out.any()


def test_fixed_point_sums_stay_below_2_to_the_53():
    for shape in [(64, 64), (1024,), (256, 256), (16, 16, 16), (8, 8, 8, 8), (2,) * 8]:
        s = D.fixed_point_bits(shape)
        c = 1
        for d in shape:
            c *= d
        assert c.bit_length() + 8 + len(shape) * s <= 52 and s >= 1


def test_decoding_a_frame_is_bit_identical_across_thread_counts(restore_threads):
    g = torch.Generator().manual_seed(2)
    tensors = {"w": torch.randn(300, 257, generator=g), "b": torch.randn(40, generator=g)}
    frame = gradwire.DCTCodec(topk=32).encode_bundle(tensors)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(gradwire.decode_bundle(frame))
    for name in tensors:
        assert torch.equal(results[0][name], results[1][name])


@pytest.mark.parametrize("chunk, k", [((64, 64), 300), ((4, 5, 6), 50)])
def test_the_rows_route_gives_the_same_bits_on_any_thread_count(restore_threads, chunk, k):
    # the Rust stages split rows and chunks between threads; exact sums make the split invisible
    plan = D.plan_flat((40000,), chunk)
    args = _levels(plan, k, 3)
    dense = D.decode_levels(*args, plan, route="dense")
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        assert torch.equal(D.decode_levels(*args, plan, route="rows"), dense), threads


def test_the_combine_kernel_refuses_mismatched_sizes():
    import numpy as np

    from gradwire import _native

    out = np.zeros(2 * 3 * 4, dtype=np.float32)
    with pytest.raises(_native.WireError) as err:
        _native.dct_combine_level_sums(np.zeros(47), np.ones(2), np.zeros(2), 3, 4, out)
    assert err.value.kind == "length_mismatch" and "47" in str(err.value) and not out.any()
    # chunks 3 and 4 of an output holding 4: outside the grid, nothing written
    with pytest.raises(_native.WireError) as err:
        _native.dct_combine_level_sums(np.zeros(48), np.ones(2), np.zeros(2), 3, 4, out, first=3)
    assert err.value.kind == "tile_layout" and "3..5" in str(err.value) and not out.any()
