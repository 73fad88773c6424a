"""bounded_mean's per-node deviation histories (gradwire.sender_history): the sketch, the trust, the state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradwire
from gradwire.sender_history import SKETCH_BUCKETS, SenderHistory, trusted_weights, update_sketch

CODEC = gradwire.DCTCodec(chunk_shape=[64], topk=16)


def records(update: dict[str, torch.Tensor], codec=CODEC):
    return [codec.compress(t, name)[0] for name, t in update.items()]


def dense(update: dict[str, torch.Tensor]):
    return records(update, gradwire.IdentityCodec())


@given(st.integers(0, 2**31 - 1), st.floats(-3, 3, allow_nan=False))
@settings(max_examples=25, deadline=None)
def test_a_sketch_is_linear_in_the_dense_values(seed, a):
    g = torch.Generator().manual_seed(seed)
    u = {"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g)}
    v = {"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g)}
    combined = {n: (u[n].double() + a * v[n].double()).float() for n in u}
    left = update_sketch(dense(combined))
    right = update_sketch(dense(u)) + a * update_sketch(dense(v))
    assert np.allclose(left, right, atol=1e-5)


def test_a_sketch_keeps_the_norm_in_expectation():
    g = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(20):
        u = {"w": torch.randn(256, 64, generator=g)}
        ratios.append(np.linalg.norm(update_sketch(dense(u))) / float(u["w"].norm()))
    assert 0.9 < float(np.mean(ratios)) < 1.1


def test_a_sketch_is_the_same_bits_every_time_and_differs_by_tensor_name():
    u = {"w": torch.randn(4, 64)}
    first = update_sketch(records(u))
    assert first.shape == (SKETCH_BUCKETS,)
    assert first.tobytes() == update_sketch(records(u)).tobytes()
    renamed = update_sketch(records({"v": u["w"]}))
    assert not np.array_equal(first, renamed)


def honest_and_biased(rounds: int, n: int, biased: list[int], z: float, seed: int = 0):
    """Per round: n updates of one true gradient plus noise; the biased ones mean − z·std of the others
    (ALIE), every round pointing the same way."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(2048, generator=g) * 0.1
    for _ in range(rounds):
        honest = truth + torch.randn(n, 2048, generator=g)
        crafted = honest[[i for i in range(n) if i not in biased]]
        alie = crafted.mean(0) - z * crafted.std(0)
        yield [{"w": alie if i in biased else honest[i]} for i in range(n)]


def run_history(rounds, n, biased, z):
    history = SenderHistory()
    senders = list(range(1, n + 1))
    trusts = []
    for updates in honest_and_biased(rounds, n, biased, z):
        recs = [records(u) for u in updates]
        trust = history.trust(senders)
        coeffs = trusted_weights([1.0 / n] * n, [1.0] * n, trust)
        history.observe(senders, recs, coeffs)
        trusts.append(trust)
    return history, trusts


def test_colluders_inside_the_spread_lose_their_weight_within_a_few_rounds():
    n, biased = 8, [6, 7]
    _, trusts = run_history(20, n, biased, z=1.0)
    last = trusts[-1]
    assert all(last[i] == 0.0 for i in biased), last
    assert all(last[i] == 1.0 for i in range(n) if i not in biased), last
    first_zero = next(t for t, tr in enumerate(trusts) if all(tr[i] == 0.0 for i in biased))
    assert first_zero <= 12


def test_honest_nodes_keep_almost_all_their_weight():
    n = 8
    _, trusts = run_history(40, n, [], z=0.0)
    mean_trust = float(np.mean([t for tr in trusts for t in tr]))
    assert mean_trust > 0.99
    assert min(min(tr) for tr in trusts) > 0.5


def test_half_of_every_round_keeps_its_whole_weight():
    history = SenderHistory()
    for node, scale in zip(range(1, 7), [1, 2, 4, 8, 16, 32]):
        history.memory[node] = np.full(SKETCH_BUCKETS, float(scale))
    trust = history.trust(list(range(1, 7)))
    assert trust[:3] == [1.0, 1.0, 1.0]
    # level = 1.5 × the lower median (4) = 6: 8 keeps 2 − 8/6 of its weight, 16 and 32 none.
    assert trust[3:] == pytest.approx([2 - 8 / 6, 0.0, 0.0])


def test_the_trust_falls_linearly_between_the_level_and_twice_it():
    history = SenderHistory()
    for node, scale in zip(range(1, 4), [1.0, 1.0, 2.25]):
        history.memory[node] = np.full(SKETCH_BUCKETS, scale)
    assert history.trust([1, 2, 3]) == pytest.approx([1.0, 1.0, 0.5])


def test_nobody_is_judged_in_a_round_of_two_or_before_any_history():
    history = SenderHistory()
    assert history.trust([1, 2, 3]) == [1.0, 1.0, 1.0]
    history.memory[1] = np.ones(SKETCH_BUCKETS)
    history.memory[2] = 100 * np.ones(SKETCH_BUCKETS)
    assert history.trust([1, 2]) == [1.0, 1.0]


def test_trusted_weights_give_the_lost_share_to_the_others():
    coeffs = [0.25, 0.25, 0.25, 0.25]
    out = trusted_weights(coeffs, [1.0] * 4, [1.0, 1.0, 1.0, 0.0])
    assert out == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    # A sender the rule dropped (coefficient 0) stays dropped; clipping's shrink is kept.
    out = trusted_weights([0.2, 0.25, 0.0, 0.25], [1.0, 1.0, 1.0, 1.0], [1.0, 0.5, 1.0, 1.0])
    assert out == pytest.approx([0.2 * 3 / 2.5, 0.125 * 3 / 2.5, 0.0, 0.25 * 3 / 2.5])


def test_the_state_round_trips_and_a_restored_history_judges_alike():
    history, _ = run_history(12, 8, [7], z=1.0)
    state = history.state_dict()
    restored = SenderHistory()
    restored.load_state_dict(state)
    senders = list(range(1, 9))
    assert restored.trust(senders) == history.trust(senders)
    assert restored.scores(senders) == history.scores(senders)
    assert state["memory"].dtype == torch.float64 and tuple(state["memory"].shape) == (8, SKETCH_BUCKETS)


def test_a_state_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="sender history of shape"):
        SenderHistory().load_state_dict({"senders": torch.tensor([1, 2]), "memory": torch.zeros(2, 7)})


@pytest.mark.parametrize(
    "kwargs", [{"beta": 1.0}, {"beta": -0.1}, {"buckets": 0}, {"multiple": 0.5}, {"multiple": math.inf}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SenderHistory(**kwargs)


def test_senders_with_other_chunkings_are_compared_on_their_decoded_values():
    u = torch.randn(4, 64)
    a = records({"w": u})
    b = records({"w": u}, gradwire.DCTCodec(chunk_shape=[32], topk=32))
    history = SenderHistory()
    history.observe([1, 2, 3], [a, b, a], [1 / 3] * 3)
    assert all(np.isfinite(history.memory[i]).all() for i in (1, 2, 3))


def _views(recs):
    from gradwire.accumulate import entry_coefficients

    return [(e.name, entry_coefficients(e)) for e in recs]


def test_sketches_made_as_updates_arrive_fold_the_histories_into_the_same_bits():
    from gradwire.sender_history import history_sketch

    g = torch.Generator().manual_seed(3)
    rounds = [[records({"w": torch.randn(8, 16, generator=g)}) for _ in range(5)] for _ in range(3)]
    at_close, on_arrival = SenderHistory(), SenderHistory()
    for recs in rounds:
        coeffs = [0.2] * 5
        at_close.observe(range(5), recs, coeffs)
        on_arrival.observe(range(5), recs, coeffs, [history_sketch(_views(r)) for r in recs])
    for node in range(5):
        assert (at_close.memory[node] == on_arrival.memory[node]).all()


def test_a_round_whose_senders_cut_a_tensor_otherwise_reads_its_records_again():
    from gradwire.sender_history import history_sketch

    g = torch.Generator().manual_seed(4)
    ups = [{"w": torch.randn(8, 16, generator=g)} for _ in range(4)]
    recs = [records(u) for u in ups[:3]] + [records(ups[3], gradwire.DCTCodec(chunk_shape=[32], topk=8))]
    made = [history_sketch(_views(r)) for r in recs]
    assert made[0].bases != made[3].bases
    at_close, on_arrival = SenderHistory(), SenderHistory()
    at_close.observe(range(4), recs, [0.25] * 4)
    on_arrival.observe(range(4), recs, [0.25] * 4, made)  # not usable: the dense reading, as at the close
    for node in range(4):
        assert (at_close.memory[node] == on_arrival.memory[node]).all()
