"""The open round's running sum (gradwire_server.round_sum) and the sketched direction check
(gradwire.sketch): a large round's close that starts from a sum kept as updates were acknowledged publishes
the bytes of a close that sums everything at the end, and its replay makes them again; the sketch reads the
cosines the exact pass reads, and drops the same flipped update; a small round's bytes do not depend on the
order its updates arrived in. The rounds here are small; ``large`` makes every round a large one."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from gradwire import DCTCodec, read_frame
from gradwire.aggregation import opposed_senders, sender_alignment, update_norm
from gradwire.dct import decode_parsed, parse_record
from gradwire.sketch import sketch_update, sketched_alignment
from gradwire_server import aggregate
from gradwire_server.aggregate import Update, published_weights
from gradwire_server.config import RunConfig
from gradwire_server.metrics import Metrics
from gradwire_server.round_sum import RoundSum, scale_and_corrections
from gradwire_server.rounds import RoundEngine
from gradwire_server.settings import ServerSettings
from gradwire_server.store import Store
from gradwire_server.transition import RunState
from server_helpers import SHAPES, dct_frame, random_grads, tiny_state

DOWNLINK = {"codec": "dct", "params": {"chunk_shape": [64], "topk": 4}}
MODES = {
    "adamw": {},
    "demo": {"algorithm": "demo", "downlink": DOWNLINK},
    "sparseloco": {
        "algorithm": "sparseloco",
        "sparseloco": {"sync_every": 2, "outer_momentum": 0.9, "nesterov": True},
        "downlink": DOWNLINK,
    },
}


def _round(seed: int = 0, big: float = 10.0) -> list[Update]:
    """A round of 7: 4 honest updates, a copy of the first (counted once), one ``big`` × larger (clipped)
    and one flipped and scaled (caught by the direction check)."""
    grads = [random_grads(seed * 10 + i, 1e-2) for i in range(4)]
    honest_sum = {n: sum(g[n] for g in grads) for n in SHAPES}
    grads.append(grads[0])
    grads.append({n: t * big for n, t in random_grads(seed * 10 + 7, 1e-2).items()})
    grads.append({n: -3 * t for n, t in honest_sum.items()})
    updates = []
    for i, g in enumerate(grads):
        frame = read_frame(dct_frame(g, 0, i + 1))
        updates.append(Update(frame, 1.0, update_norm(frame.entries), i + 1))
    # The copy carries the first update's records, byte for byte.
    updates[4] = Update(updates[0].frame, 1.0, updates[0].norm, 5)
    return updates


@pytest.fixture
def large(monkeypatch):
    """Every round is a large round (aggregate.LARGE_ROUND_BYTES 0): the running sum, commit order, sketches."""
    monkeypatch.setattr(aggregate, "LARGE_ROUND_BYTES", 0)


def _state(mode: str) -> RunState:
    return RunState.load(RunConfig.model_validate(MODES[mode]), 0, tiny_state(), None, {}, torch.device("cpu"))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_close_from_the_running_sum_publishes_the_bytes_of_a_close_that_sums_at_the_end(mode, large):
    for seed in range(2):
        updates = _round(seed)
        live, at_end = _state(mode), _state(mode)
        rs = live.new_round_sum()
        assert rs is not None
        for u in updates:  # as each is acknowledged
            rs.add(u)
        assert rs.base == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # the copy counts once
        published = live.close(updates, round_sum=rs)
        assert rs.spent
        assert published == at_end.close(updates)
        assert live.weights_hash() == at_end.weights_hash()
        # Its replay (a restart) builds the sum again from the logged updates: the same bytes.
        replayed = _state(mode)
        assert replayed.replay(lambda u=updates: u, published) is True
        assert replayed.weights_hash() == live.weights_hash()


def test_the_running_sum_corrected_and_scaled_is_the_weighted_sum_of_the_rules_coefficients():
    updates = _round(3)
    state = _state("adamw")
    coeffs, _ = published_weights(updates, state.rule)
    # The copy counts once; the flipped one, past the direction test, keeps at most part of its weight (without
    # a data assignment an outlier is bounded, not zeroed: gradwire.aggregation.opposed_factors).
    assert coeffs[4] == 0.0 and coeffs[6] < 0.5 * coeffs[0]
    assert 0.0 < coeffs[5] < coeffs[0]  # the large one clipped
    s, corrections = scale_and_corrections([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0], coeffs)
    assert s == coeffs[0]
    assert [i for i, _ in corrections] == [5, 6]  # only the clipped and the dropped are read again
    rs = RoundSum.of(updates)
    scale, buffers = rs.finish(coeffs, updates)
    for name, buf in buffers.items():
        got = decode_parsed_sum(buf, scale)
        want = sum(c * decode_parsed(parse_record(u.entries()[name])) for c, u in zip(coeffs, updates))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    with pytest.raises(RuntimeError, match="spent"):
        rs.add(updates[0])


def decode_parsed_sum(buf, scale: float) -> torch.Tensor:
    from gradwire.dct.chunks import from_chunks
    from gradwire.dct.transform import idct_chunks

    plan = buf.plan
    return from_chunks(idct_chunks((buf.coeffs * scale).reshape(plan.num_chunks, *plan.chunk_shape)), plan)


@pytest.mark.parametrize("limit", [math.inf, 1.0])
def test_an_update_1e15_times_larger_is_summed_at_its_share_and_cancels_nothing(limit):
    """Added and then corrected, a 1e15 × update would leave float32's rounding of it in the sum: without a
    cap (``inf``: the first rounds) the close sums such a round from zero; with one it is never added."""
    updates = _round(5, big=1e15)
    state = _state("adamw")
    coeffs, _ = published_weights(updates, state.rule)
    rs = RoundSum.of(updates, limit=limit)
    assert rs.base[5] == (1.0 if limit == math.inf else 0.0)
    scale, buffers = rs.finish(coeffs, updates)
    for name, buf in buffers.items():
        want = sum(c * decode_parsed(parse_record(u.entries()[name])).double() for c, u in zip(coeffs, updates))
        torch.testing.assert_close(decode_parsed_sum(buf, scale).double(), want, rtol=1e-4, atol=1e-7)


def test_a_tensor_in_another_chunking_is_left_to_the_close_and_the_bytes_still_match(large):
    updates = _round(1)
    # Node 2 cuts every tensor into 32-element chunks: the running sum refuses those tensors.
    other = read_frame(DCTCodec(chunk_shape=(32,), topk=4).encode_bundle(random_grads(99, 1e-2), round=0, sender=2))
    updates[1] = Update(other, 1.0, update_norm(other.entries), 2)
    rs = RoundSum.of(updates)
    assert "fc1.weight" in rs.refused and "fc1.weight" not in rs.buffers
    live, at_end = _state("adamw"), _state("adamw")
    assert live.close(updates, round_sum=rs) == at_end.close(updates)


def test_scale_and_corrections_reads_only_the_updates_whose_share_changed():
    s, corr = scale_and_corrections([1.0, 1.0, 0.5, 0.0], [0.25, 0.25, 0.125, 0.0])
    assert (s, corr) == (0.25, [])
    s, corr = scale_and_corrections([1.0, 1.0, 1.0], [0.5, 0.0, 0.5])
    assert s == 0.5 and corr == [(1, -1.0)]
    # Nothing keeps a share of its own weight: the sum starts afresh from the coefficients.
    assert scale_and_corrections([1.0, 1.0], [0.0, 0.0]) == (0.0, [])
    assert scale_and_corrections([0.0, 0.0], [0.5, 0.5]) == (0.0, [(0, 0.5), (1, 0.5)])
    with pytest.raises(ValueError, match="2 coefficients for 3 updates"):
        scale_and_corrections([1.0, 1.0, 1.0], [0.5, 0.5])


def _big_round(n: int, flipped: bool) -> list[list]:
    shapes = {"w": (256, 256), "v": (4096,)}
    grads = [random_grads(200 + i, 1e-2, shapes) for i in range(n)]
    common = random_grads(199, 1e-2, shapes)
    grads = [{k: g[k] + common[k] for k in shapes} for g in grads]
    if flipped:
        grads[-1] = {k: -4 * common[k] for k in shapes}
    return [read_frame(dct_frame(g, 0, i + 1, topk=16)).entries for i, g in enumerate(grads)]


def test_the_sketched_cosines_are_the_exact_ones_within_a_hundredth():
    records = _big_round(12, flipped=True)
    coeffs = [1.0 / len(records)] * len(records)
    exact = sender_alignment(records, coeffs)
    key = b"0123456789abcdef"
    sketches = [sketch_update(r, key) for r in records]
    sketched = sketched_alignment(sketches, [update_norm(r) ** 2 for r in records], coeffs)
    assert max(abs(a - b) for a, b in zip(exact, sketched)) < 0.01
    assert sketched[-1] < -0.3 < 0.3 < min(sketched[:-1])
    # The key decides the hash: another key, other sketches, the same cosines within the same margin.
    other = [sketch_update(r, b"fedcba9876543210") for r in records]
    assert not (other[0] == sketches[0]).all()


def test_a_large_round_drops_the_flipped_update_by_its_sketch_as_the_exact_pass_does(monkeypatch):
    records = _big_round(8, flipped=True)
    updates = [Update(type("F", (), {"entries": r})(), 1.0, update_norm(r), i + 1) for i, r in enumerate(records)]
    probe = [1.0 / len(records)] * len(records)
    assert opposed_senders(records, probe) == [False] * 7 + [True]
    monkeypatch.setattr(aggregate, "LARGE_ROUND_BYTES", 0)
    alignment = aggregate.round_alignment(updates, b"k" * 16)
    assert alignment is not None
    assert opposed_senders(records, probe, alignment=alignment) == [False] * 7 + [True]
    monkeypatch.setattr(aggregate, "LARGE_ROUND_BYTES", 1 << 40)
    assert aggregate.round_alignment(updates, b"k" * 16) is None


def test_the_server_sums_each_update_as_it_is_committed_and_its_restart_replays_the_same_version(
    tmp_path, caplog, large
):
    """Through the round engine on a real SQLite store: the open round's running sum holds every
    acknowledged update in commit order; the close publishes from it, and a restart on the same data
    directory replays that version to the same weights hash."""
    config = RunConfig.model_validate({**MODES["demo"], "quorum": 4})
    frames = [dct_frame(random_grads(300 + i, 1e-2), 0, i + 1) for i in range(4)]

    async def first_life():
        from gradwire.state import state_to_bytes

        store = Store(tmp_path)
        settings = ServerSettings(data_dir=tmp_path, checkpoint_every=1000, checkpoint_every_version_below_bytes=0)
        engine = RoundEngine(store, Metrics(lambda: 0.0), settings)
        await engine.start()
        run_id = await engine.create_run(config)
        assert [store.add_node(run_id, f"n{i}", f"token-hash-{i}") for i in range(4)] == [1, 2, 3, 4]
        await engine.set_state(run_id, state_to_bytes(tiny_state()))
        rt = engine.runtime(run_id)
        for node, frame in reversed(list(enumerate(frames, 1))):  # committed in another order than node ids
            await engine.submit(run_id, node, 0, frame)
        async with rt.lock:  # as the round's close takes it: after the last update was added
            assert rt.round_sum is not None and rt.round_sum.matches(list(rt.pending.values()))
            assert [u.node_id for u in rt.round_sum.updates] == [4, 3, 2, 1]
        closed = await engine.close_round(rt)
        await engine.stop()
        store.close()
        return run_id, closed.weights_hash

    run_id, published_hash = asyncio.run(first_life())

    async def second_life():
        store = Store(tmp_path)
        engine = RoundEngine(store, Metrics(lambda: 0.0), ServerSettings(data_dir=tmp_path, checkpoint_every=1000))
        await engine.start()
        rt = engine.runtime(run_id)
        got = (rt.version, rt.weights_hash, rt.state.weights_hash())
        await engine.stop()
        store.close()
        return got

    caplog.set_level("INFO", logger="gradwire_server")
    assert asyncio.run(second_life()) == (1, published_hash, published_hash)
    assert "replayed versions 1..1" in caplog.text
    assert "made frames other than the published ones" not in caplog.text  # the same bytes, not just the weights


def test_a_reencoding_runs_residuals_share_one_buffer_so_its_compression_copies_nothing(large):
    from gradwire.dct.domain import joined

    live, at_end = _state("demo"), _state("demo")
    for rnd in range(3):
        updates = _round(rnd)
        rs = RoundSum.of(updates, live.new_round_sum()._plan_of)
        order = list(rs.buffers)  # the order the compression groups them in
        assert live.close(updates, round_sum=rs) == at_end.close(updates)
        by_chunk: dict[int, list] = {}
        for name in order:
            buf = live.downlink.coefficient_residual(name)
            by_chunk.setdefault(buf.shape[1], []).append(buf)
        assert any(len(group) > 1 for group in by_chunk.values())
        for group in by_chunk.values():
            assert joined(group).data_ptr() == group[0].data_ptr()  # a view of one buffer: no copy


def test_the_running_sum_keeps_the_updates_sketches_in_one_matrix_the_close_reads_in_place():
    key = b"0123456789abcdef"
    updates = _round(2)
    for u in updates:
        u.sketch = (key, sketch_update(u.frame.entries, key))
    rs = RoundSum.of(updates)
    rows = rs.sketches(key)
    assert rows.shape[0] == len(updates)
    assert all((rows[i] == u.sketch[1]).all() for i, u in enumerate(updates))
    assert rs.sketches(b"another key 0123") is None
    # One update without its sketch: the close computes them all (no matrix).
    updates[3].sketch = None
    assert RoundSum.of(updates).sketches(key) is None


@pytest.mark.parametrize("mode", list(MODES))
def test_a_small_rounds_bytes_do_not_depend_on_the_order_its_updates_arrived_in(mode):
    updates = _round(4)
    assert not aggregate.large_round(updates)
    first, second = _state(mode), _state(mode)
    assert first.close(updates) == second.close(list(reversed(updates)))
    assert first.weights_hash() == second.weights_hash()


@pytest.mark.parametrize("mode", ["adamw", "sparseloco"])
def test_a_large_round_sums_in_commit_order_which_its_replay_follows(mode, large):
    updates = _round(6)
    forward, backward = _state(mode), _state(mode)
    published = backward.close(list(reversed(updates)))
    assert forward.close(updates) != published  # another order, other float32 roundings
    replayed = _state(mode)
    assert replayed.replay(lambda: list(reversed(updates)), published) is True


def test_a_large_rounds_updates_let_go_of_their_parses_once_summed_and_the_bytes_stay(large):
    from gradwire_server.prepare import parsed_while

    updates = []
    for u in _round(7):
        (frame, norm), parsed = parsed_while(lambda u=u: (u.frame, u.norm))
        updates.append(Update(frame, 1.0, norm, u.node_id, prepared=parsed))
    assert all(u.prepared is not None for u in updates)
    live, at_end = _state("sparseloco"), _state("sparseloco")
    rs = live.new_round_sum()
    for u in updates:
        rs.add(u)
    assert all(u.prepared is None for u in updates)  # 6–7 × each frame, no longer held
    assert live.close(updates, round_sum=rs) == at_end.close(updates)
