"""The fused exact mean: DCT records averaged in one Rust pass (``gradwire.dct.decode_levels_weighted_sum``,
``_native.dct_decode_folded_mean``) give the bits of decoding every record and combining the tensors
elementwise, which is how ``exact_mean`` defines the mean; anything the fused pass does not take falls
back to that definition."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradwire
from gradwire import _native
from gradwire import aggregation as agg
from gradwire.algorithms import exact_mean
from gradwire.frame import read_frame, weighted_sum_fused


def _records(shapes: dict, ks: list[int], mode: str = "tiles", seed: int = 0, dtype=torch.float32) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, k in enumerate(ks):
        codec = gradwire.DCTCodec(chunk_shape=(8, 8), topk=k, mode=mode)
        tensors = {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}
        out.append(read_frame(codec.encode_bundle(tensors, round=0, sender=i + 1)).entries)
    return out


def _one_by_one(records, weights=None) -> dict[str, torch.Tensor]:
    """exact_mean's definition, record by record: the fused path switched off."""
    real = agg.weighted_sum_fused
    agg.weighted_sum_fused = lambda *a, **k: None
    try:
        return exact_mean(records, weights)
    finally:
        agg.weighted_sum_fused = real


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@settings(max_examples=25, deadline=None)
@given(
    ks=st.lists(st.integers(1, 64), min_size=1, max_size=5),
    mode=st.sampled_from(["tiles", "flat"]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_mean_has_the_bits_of_decoding_each_record_then_combining(ks, mode, weighted, seed):
    shapes = {"w": (24, 40), "b": (70,), "v": (16, 8)}
    records = _records(shapes, ks, mode, seed)
    weights = [0.1 + 0.37 * i for i in range(len(ks))] if weighted else None
    fused = exact_mean(records, weights)
    want = _one_by_one(records, weights)
    assert set(fused) == set(want)
    for name in want:
        assert _same_bits(fused[name], want[name]), name


def test_fused_mean_runs_for_float32_dct_records_on_the_cpu():
    records = _records({"w": (16, 16)}, [4, 9])
    entries = [r[0] for r in records]
    got = weighted_sum_fused(entries, [0.5, 0.5])
    assert got is not None and got.shape == (16, 16)
    want = gradwire.decode_entry(entries[0]) * 0.5 + gradwire.decode_entry(entries[1]) * 0.5
    assert _same_bits(got, want)


def test_records_the_fused_pass_does_not_take_fall_back_to_the_definition():
    # half-precision records: exact_mean decodes to float16 first, which the fused pass does not
    half = _records({"w": (16, 16)}, [4, 9], dtype=torch.float16)
    assert weighted_sum_fused([r[0] for r in half], [0.5, 0.5]) is None
    assert _same_bits(exact_mean(half)["w"], _one_by_one(half)["w"])
    # senders chunked differently (one flat, one in tiles) and mixed codecs
    tiles = _records({"w": (16, 16)}, [4])[0][0]
    flat = _records({"w": (16, 16)}, [4], mode="flat")[0][0]
    assert weighted_sum_fused([tiles, flat], [0.5, 0.5]) is None
    assert _same_bits(exact_mean([[tiles], [flat]])["w"], _one_by_one([[tiles], [flat]])["w"])
    sign = read_frame(gradwire.build_codec("topk", k=10).encode_bundle({"w": torch.randn(16, 16)})).entries[0]
    assert weighted_sum_fused([tiles, sign], [0.5, 0.5]) is None
    mixed = exact_mean([[tiles], [sign]])["w"]
    assert _same_bits(mixed, _one_by_one([[tiles], [sign]])["w"])


def test_a_hostile_record_is_refused_before_anything_is_summed():
    records = _records({"w": (16, 16)}, [4, 4])
    bad = records[1][0]
    scales = bad.sections["scale"].copy()
    scales[-1] = -scales[-1]  # a negative scale in the last chunk
    broken = dataclasses.replace(bad, sections={**bad.sections, "scale": scales})
    with pytest.raises(gradwire.FrameError, match="scales must be > 0"):
        exact_mean([records[0], [broken]])


def test_the_native_mean_names_bad_senders_and_writes_nothing():
    basis = np.eye(4)
    basis[:] = [[1, 1, 1, 1], [2, 1, -1, -2], [1, -1, -1, 1], [1, -2, 2, -1]]
    one = (np.array([0, 5]), np.array([1, 2], dtype=np.int16), 1, np.ones(2), np.zeros(2))
    three = (np.array([0, 5, 7]), np.array([1, 2, 3], dtype=np.int16), 1, np.ones(3), np.zeros(3))
    out = np.full(32, 7.0, dtype=np.float32)
    w2 = np.array([0.5, 0.5], dtype=np.float32)
    flat = basis.reshape(-1)
    with pytest.raises(_native.WireError) as err:
        _native.dct_decode_folded_mean([], np.array([], dtype=np.float32), 4, 4, flat, flat, out)
    assert err.value.kind == "no_senders"
    with pytest.raises(_native.WireError) as err:
        _native.dct_decode_folded_mean([one, three], w2, 4, 4, flat, flat, out)
    assert err.value.kind == "sender_chunks_mismatch" and "sender 1 has 3 chunks" in str(err.value)
    with pytest.raises(_native.WireError) as err:
        _native.dct_decode_folded_mean([one, one], w2[:1], 4, 4, flat, flat, out)
    assert err.value.kind == "length_mismatch"
    assert (out == 7.0).all()


def test_one_weighted_sum_serves_the_exact_mean_the_transform_domain_sum_and_every_codec():
    shapes = {"w": (16, 24), "b": (24,)}
    senders = _records(shapes, [3, 5, 7], seed=4)
    weights = [0.5, 0.3, 0.2]
    mean = exact_mean(senders, weights)
    for j, name in enumerate(shapes):
        column = [recs[j] for recs in senders]
        exact = agg.weighted_sum(column, weights)
        assert torch.equal(exact, mean[name])  # the fused pass and the definition: the same bits
        inexact = agg.weighted_sum(column, weights, exact=False)
        assert torch.equal(inexact, agg.transform_domain_sum(column, weights))
        # The exact decode's basis is fixed-point (2^-s): the float transform agrees to about 1e-5.
        assert torch.allclose(inexact, exact, atol=2e-5)
    # A codec with no fused pass and no accumulator: the same sum, record by record, either way.
    gen = torch.Generator().manual_seed(5)
    qs = [gradwire.QSGD(levels=8).compress(torch.randn(40, generator=gen), "q")[0] for _ in range(3)]
    by_hand = sum(gradwire.decode_entry(e) * w for e, w in zip(qs, weights))
    assert torch.allclose(agg.weighted_sum(qs, weights), by_hand, atol=1e-6)
    assert torch.allclose(agg.weighted_sum(qs, weights, exact=False), by_hand, atol=1e-6)
    with pytest.raises(ValueError, match="got 2 weights for 3 records"):
        agg.weighted_sum(qs, weights[:2])
    with pytest.raises(ValueError, match="at least one record"):
        agg.weighted_sum([], [])
