"""gradwire.aggregation, the one home of the aggregation rules: clipping bounds a rogue update to the median
norm, the coordinate-wise rules have the bits of their brute-force definition, and the server's
``gradwire_server.aggregate`` is only a door into the library (the same bits as calling it directly)."""

from __future__ import annotations

import math
import statistics
import typing

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradwire
from gradwire import aggregation
from gradwire.accumulate import entry_norm, make_accumulator
from gradwire.frame import read_frame
from gradwire_server import aggregate as server_agg
from gradwire_server.config import AggregationConfig

SHAPES = {"w": (16, 24), "b": (24,), "v": (5, 3)}
NAMES = sorted(SHAPES)


def _codec(kind: str):
    if kind == "dct":
        return gradwire.DCTCodec(chunk_shape=(8, 8), topk=12)
    return gradwire.IdentityCodec()


def _frames(n: int, kind: str = "identity", seed: int = 0, scales=None) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = 1.0 if scales is None else scales[i]
        tensors = {name: torch.randn(shape, generator=gen) * s for name, shape in SHAPES.items()}
        out.append(read_frame(_codec(kind).encode_bundle(tensors, round=0, sender=i + 1)))
    return out


def _records(n: int, kind: str = "identity", seed: int = 0, scales=None) -> list[list]:
    return [f.entries for f in _frames(n, kind, seed, scales)]


def _norm(records_of_one_sender) -> float:
    return math.sqrt(sum(entry_norm(e) ** 2 for e in records_of_one_sender))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _updates(frames, weights) -> list[server_agg.Update]:
    return [
        server_agg.Update(f, weight=w, norm=_norm(f.entries), node_id=i + 1)
        for i, (f, w) in enumerate(zip(frames, weights))
    ]


# -- one list of rules ----------------------------------------------------------------------------


def test_the_rule_names_live_in_the_library_only():
    assert aggregation.RULES == ("bounded_mean", "mean", "clipped_mean", "trimmed_mean", "median")
    assert aggregation.DEFAULT_RULE == "bounded_mean" == AggregationConfig().rule
    assert server_agg.RULES is aggregation.RULES
    # The run config's accepted names are the library's.
    assert typing.get_args(AggregationConfig.model_fields["rule"].annotation) == aggregation.RULES


def test_an_unknown_rule_is_refused_everywhere():
    recs = _records(3)
    calls = [
        lambda: aggregation.check_rule("mode"),
        lambda: aggregation.trim_count("mode", 3),
        lambda: aggregation.rule_weights("mode", [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]),
        lambda: aggregation.weights_and_trim("mode", [1.0, 1.0, 1.0]),
        lambda: aggregation.aggregate(recs, NAMES, "mode"),
        lambda: server_agg.aggregate(_updates(_frames(3), [1.0] * 3), NAMES, "mode"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="unknown aggregation rule 'mode'"):
            call()
    with pytest.raises(ValueError, match="no weighted mean"):
        aggregation.rule_weights("median", [1.0], [1.0])
    with pytest.raises(ValueError):
        aggregation.aggregate([], NAMES)


# -- clipping -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=9))
def test_clip_factors_bound_every_update_to_the_median_norm(norms):
    med = statistics.median(norms)
    for n, c in zip(norms, aggregation.clip_factors(norms)):
        assert 0.0 <= c <= 1.0  # 0 only when the median norm is 0
        assert n * c <= med * (1 + 1e-12) + 1e-300
        if n <= med:
            assert c == 1.0


@pytest.mark.parametrize("kind", ["identity", "dct"])
def test_a_rogue_update_weighs_no_more_than_a_median_one_under_the_clipped_mean(kind):
    records = _records(5, kind, seed=3, scales=[1.0, 1.5, 0.5, 2.0, 1000.0])
    norms = [_norm(r) for r in records]
    med = statistics.median(norms)
    coeffs = aggregation.rule_weights("clipped_mean", [1.0] * 5, norms)
    # The rogue's share is its update scaled to the median norm, over n.
    assert coeffs[4] * norms[4] == pytest.approx(med / 5, rel=1e-12)
    assert all(c * n <= med / 5 * (1 + 1e-12) for c, n in zip(coeffs, norms))
    # So the clipped mean, a mean of updates of norm <= median, has norm <= median (the norms from the
    # codec's domain are the dense norms or, for padded DCT chunks, an upper bound on them).
    got = aggregation.aggregate(records, NAMES, "clipped_mean", norms=norms)
    total = math.sqrt(sum(float(got[n].double().norm()) ** 2 for n in NAMES))
    assert total <= med * (1 + 1e-5)
    plain = aggregation.aggregate(records, NAMES, "mean")
    assert math.sqrt(sum(float(plain[n].double().norm()) ** 2 for n in NAMES)) > 100 * med  # the mean is hijacked


def test_staleness_weights_enter_the_means_and_not_the_coordinate_wise_rules():
    weights, norms = [1.0, 0.5, 0.25], [1.0, 2.0, 8.0]
    assert aggregation.rule_weights("mean", weights) == [1 / 1.75, 0.5 / 1.75, 0.25 / 1.75]
    assert aggregation.rule_weights("clipped_mean", weights, norms) == pytest.approx(
        [1 / 1.75, 0.5 / 1.75, 0.25 * (2 / 8) / 1.75]
    )
    assert aggregation.weights_and_trim("median", weights, norms) == ([1 / 1.75, 0.5 / 1.75, 0.25 / 1.75], 1)
    assert aggregation.weights_and_trim("trimmed_mean", weights, norms, 0.34) == (
        [1 / 1.75, 0.5 / 1.75, 0.25 / 1.75],
        1,
    )
    assert aggregation.weights_and_trim("clipped_mean", weights, norms, 0.34) == (
        aggregation.rule_weights("clipped_mean", weights, norms),
        0,
    )
    records = _records(3, seed=1)
    a = aggregation.aggregate(records, NAMES, "median", weights=weights)
    b = aggregation.aggregate(records, NAMES, "median")
    assert all(_same_bits(a[n], b[n]) for n in NAMES)


# -- the coordinate-wise rules against their definition ---------------------------------------------


def _brute_force(records, trim: int) -> dict[str, torch.Tensor]:
    """Coordinate by coordinate, in Python: the decoded values (``-0.0`` made ``+0.0``) sorted, ``trim``
    dropped from each end, the rest summed in sorted order in float32 and divided once by their count."""
    dec = [{e.name: gradwire.decode_entry(e).to(torch.float32).numpy() for e in recs} for recs in records]
    out = {}
    for name in NAMES:
        cols = np.stack([d[name].reshape(-1) for d in dec])
        res = np.empty(cols.shape[1], dtype=np.float32)
        for j in range(cols.shape[1]):
            vals = sorted(np.float32(v) + np.float32(0.0) for v in cols[:, j])
            kept = vals[trim : len(vals) - trim]
            acc = np.float32(kept[0])
            for v in kept[1:]:
                acc = np.float32(acc + v)
            res[j] = acc if len(kept) == 1 else np.float32(acc / np.float32(len(kept)))
        out[name] = torch.from_numpy(res.reshape(SHAPES[name]))
    return out


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 7),
    rule=st.sampled_from(["trimmed_mean", "median"]),
    trim_fraction=st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.49]),
    kind=st.sampled_from(["identity", "dct"]),
    seed=st.integers(0, 2**16),
)
def test_trimmed_mean_and_median_have_the_bits_of_the_brute_force_definition(n, rule, trim_fraction, kind, seed):
    records = _records(n, kind, seed)
    trim = aggregation.trim_count(rule, n, trim_fraction)
    want = _brute_force(records, trim)
    got = aggregation.aggregate(records, NAMES, rule, trim_fraction=trim_fraction)
    assert list(got) == NAMES
    for name in NAMES:
        assert _same_bits(got[name], want[name]), (name, rule, n, trim)
    if rule == "median":  # and it is the median, as numpy defines it (up to the rounding of the pair's mean)
        dec = [{e.name: gradwire.decode_entry(e) for e in recs} for recs in records]
        for name in NAMES:
            stacked = np.stack([d[name].to(torch.float32).numpy() for d in dec])
            np.testing.assert_allclose(got[name].numpy(), np.median(stacked, axis=0), rtol=1e-6, atol=1e-7)


# -- the server goes through the library ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["identity", "dct"])
@pytest.mark.parametrize("rule", ["bounded_mean", "mean", "clipped_mean", "trimmed_mean", "median"])
def test_the_servers_aggregate_is_the_librarys(kind, rule):
    frames = _frames(5, kind, seed=7, scales=[1.0, 2.0, 0.5, 30.0, 1.0])
    records = [f.entries for f in frames]
    weights = [1.0, 1.0, 0.5, 1.0, 0.25]
    ups = _updates(frames, weights)
    norms = [u.norm for u in ups]
    got = server_agg.aggregate(ups, NAMES, rule, trim_fraction=0.2)
    lib = aggregation.aggregate(records, NAMES, rule, weights, norms, 0.2)
    assert list(got) == NAMES
    for name in NAMES:
        assert _same_bits(got[name], lib[name])
    if rule in ("bounded_mean", "mean", "clipped_mean"):
        # The fast path as it always was: one accumulator per tensor, the updates added in order.
        coeffs = aggregation.rule_weights(rule, weights, norms)
        assert server_agg.mean_weights(ups, rule) == coeffs
        by_name = [{e.name: e for e in recs} for recs in records]
        for name in NAMES:
            acc = make_accumulator(by_name[0][name], None)
            for mine, c in zip(by_name, coeffs):
                acc.add(mine[name], c)
            assert _same_bits(got[name], acc.finish())
    else:
        exact = aggregation.exact_trimmed_mean(records, aggregation.trim_count(rule, 5, 0.2))
        for name in NAMES:
            assert _same_bits(got[name], exact[name])
    assert server_agg.published_weights(ups, rule, 0.2) == aggregation.weights_and_trim(rule, weights, norms, 0.2)
    assert server_agg.clip_factors(norms) == aggregation.clip_factors(norms)


def test_the_algorithms_package_still_exports_the_exact_functions():
    from gradwire import algorithms

    for name in ("exact_mean", "exact_trimmed_mean", "exact_aggregate", "trim_count"):
        assert getattr(algorithms, name) is getattr(aggregation, name)
