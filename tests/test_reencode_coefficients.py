"""The re-encoded downlink's error buffer in the DCT coefficient domain (gradwire.reencode): where the nodes'
records share the downlink's chunks and the rule is a weighted mean, the server sums the records'
coefficients and compresses the buffer without decoding a record or transforming forward. It must publish
versions every node applies to the server's weights bit for bit, replay to the same bytes, checkpoint and
restore, follow the parameter-domain feedback it replaces, and leave trimmed means and medians in
parameter space."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire import read_frame
from gradwire.aggregation import exact_mean, exact_trimmed_mean
from gradwire.frame import write_frame
from gradwire.published import apply_mean, read_published
from gradwire.reencode import STATE_FORMAT, ReencodeFeedback
from gradwire.state import pack_state_dict, state_hash, unpack_state_dict
from gradwire_server.aggregate import Update
from gradwire_server.config import RunConfig
from gradwire_server.transition import RunState

#: Shapes that 64-element flat chunks pad (fc1.bias: 32 of 64) and that fill them (fc1.weight).
SHAPES = {"fc1.weight": (48, 64), "fc1.bias": (96,), "head": (7, 64)}
NODE_CODEC = {"chunk_shape": [64], "topk": 8, "index_coding": "rice", "value_bits": 2}
DOWNLINK = {"chunk_shape": [64], "topk": 6, "value_bits": 4}
DEMO = {"algorithm": "demo", "demo": {"lr": 3e-3, "beta": 0.9}, "downlink": {"codec": "dct", "params": DOWNLINK}}
SPARSELOCO = {
    "algorithm": "sparseloco",
    "downlink": {"codec": "dct", "params": DOWNLINK},
    "sparseloco": {"sync_every": 1, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
}


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 1e-2 for n, s in SHAPES.items()}


def _records(rnd: int, nodes: int = 3, codec: dict = NODE_CODEC) -> list[list]:
    enc = gradwire.DCTCodec(**codec)
    return [read_frame(enc.encode_bundle(_grads(100 * rnd + i), round=rnd, sender=i + 1)).entries for i in range(nodes)]


def _updates(rnd: int, nodes: int = 3) -> list[Update]:
    return [
        Update(
            read_frame(gradwire.DCTCodec(**NODE_CODEC).encode_bundle(_grads(100 * rnd + i), round=rnd, sender=i + 1)),
            1.0,
            0.0,
            i + 1,
        )
        for i in range(nodes)
    ]


def _master() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) * 0.1 for n, s in sorted(SHAPES.items())}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "codec", [DOWNLINK, {"chunk_shape": [64, 64], "topk": 40, "mode": "tiles"}], ids=["flat-padded", "tiles"]
)
def test_the_coefficient_residual_follows_the_parameter_domain_feedback_over_rounds(codec):
    # The same error feedback in another orthonormal basis: over several rounds the residuals (and what is
    # published) stay within float32 rounding of the parameter-domain path's. Five nodes keep every
    # coefficient at 8 bits, so no two coefficients of the buffer tie exactly in magnitude. (Coarse node
    # values make exact ties common: the coefficient domain keeps the lowest positions of a tie, the
    # parameter domain whichever its transform's rounding favours; from there that chunk's residuals
    # differ, neither being closer to the aggregate.)
    node = {**codec, "topk": 1 << 16}
    fast, slow = ReencodeFeedback(gradwire.DCTCodec(**codec)), gradwire.ErrorFeedback(gradwire.DCTCodec(**codec))
    weights = [0.3, 0.25, 0.2, 0.15, 0.1]
    for rnd in range(6):
        records = _records(rnd, nodes=5, codec=node)
        got = fast.reencode(records, weights)
        mean = exact_mean(records, weights)
        want = slow.compress_bundle_reconstructed({n: mean[n] for n in sorted(mean)})
        assert list(got) == sorted(SHAPES)
        for name in SHAPES:
            assert fast.coefficient_residual(name) is not None  # the fast path ran
            assert _relative(fast.residual(name), slow.residual(name)) < 1e-4, (rnd, name)
            assert _relative(got[name][1], want[name][1]) < 1e-4, (rnd, name)


def test_trimmed_means_and_medians_stay_in_parameter_space_bit_for_bit():
    downlink = gradwire.DCTCodec(**DOWNLINK)
    fast, slow = ReencodeFeedback(downlink), gradwire.ErrorFeedback(gradwire.DCTCodec(**DOWNLINK))
    for rnd, trim in enumerate([1, 2, 1]):  # trimmed mean of 5, median of 5, trimmed mean of 5
        records = _records(rnd, nodes=5)
        got = fast.reencode(records, [0.2] * 5, trim)
        mean = exact_trimmed_mean(records, trim)
        want = slow.compress_bundle_reconstructed({n: mean[n] for n in sorted(mean)})
        for name in SHAPES:
            assert fast.coefficient_residual(name) is None
            assert write_frame([got[name][0]]) == write_frame([want[name][0]])
            assert torch.equal(got[name][1], want[name][1])
            assert torch.equal(fast.residual(name), slow.residual(name))


def test_a_tensor_switching_domains_keeps_its_residual():
    # A mean round (coefficients), then a median round (parameters), then means again: each switch moves
    # the residual by one float transform, so the parameter-domain path is followed within rounding
    # (tie-free node records, as above).
    node, weights = {**DOWNLINK, "topk": 1 << 16}, [0.3, 0.25, 0.2, 0.15, 0.1]
    fast = ReencodeFeedback(gradwire.DCTCodec(**DOWNLINK))
    slow = gradwire.ErrorFeedback(gradwire.DCTCodec(**DOWNLINK))
    for rnd, trim in enumerate([0, 1, 0, 0]):
        records = _records(rnd, nodes=5, codec=node)
        fast.reencode(records, weights, trim)
        mean = exact_trimmed_mean(records, trim) if trim else exact_mean(records, weights)
        slow.compress_bundle_reconstructed({n: mean[n] for n in sorted(mean)})
        for name in SHAPES:
            assert (fast.coefficient_residual(name) is None) == bool(trim)
            assert _relative(fast.residual(name), slow.residual(name)) < 1e-4, (rnd, name)


def test_records_cut_otherwise_go_through_parameter_space():
    # Tile-mode node records and a flat downlink: other chunks, so the parameter-domain feedback runs.
    fast = ReencodeFeedback(gradwire.DCTCodec(**DOWNLINK))
    records = _records(0, codec={"chunk_shape": [64, 64], "topk": 16, "mode": "tiles"})
    fast.reencode(records)
    assert fast.coefficient_residual("fc1.weight") is None and fast.residual("fc1.weight") is not None


@pytest.mark.parametrize("config", [DEMO, SPARSELOCO], ids=["demo", "sparseloco"])
def test_every_node_applies_the_published_version_to_the_servers_weights_bit_for_bit(config):
    cfg = RunConfig.model_validate(config)
    server = RunState.load(cfg, 0, _master(), None, {}, torch.device("cpu"))
    node_weights, node_state = _master(), {}
    for rnd in range(4):
        published = server.close(_updates(rnd))
        (version,) = read_published(published)
        assert version.reencoded_from == 3
        # What a node runs: the one frame decoded exactly, applied with the algorithm's apply.
        node_state = apply_mean(cfg.algorithm, cfg.algorithm_config(), node_weights, version.mean(), node_state)
        assert state_hash(node_weights) == server.weights_hash(), rnd
    assert all(server.downlink.coefficient_residual(n) is not None for n in SHAPES)


def _roundtrip(state: RunState) -> RunState:
    """``state`` through the store's serialization, loaded afresh (a restart from its checkpoint)."""
    weights, moments, server_state = state.checkpoint()
    server_state = unpack_state_dict(pack_state_dict(server_state))
    return RunState.load(state.config, state.version, weights, moments or None, server_state, torch.device("cpu"))


@pytest.mark.parametrize("config", [DEMO, SPARSELOCO], ids=["demo", "sparseloco"])
def test_a_restart_replays_and_continues_with_the_bytes_of_an_uninterrupted_run(config):
    cfg = RunConfig.model_validate(config)
    rounds, checkpoint_at = 6, 2
    ref = RunState.load(cfg, 0, _master(), None, {}, torch.device("cpu"))
    want, restored = [], None
    for rnd in range(rounds):
        want.append(ref.close(_updates(rnd)))
        if ref.version == checkpoint_at:
            restored = _roundtrip(ref)
    assert restored is not None
    assert restored.downlink.state_dict()["format"] == STATE_FORMAT
    # Replay of the logged rounds after the checkpoint (kill -9), then new rounds, as the server does.
    for rnd in range(checkpoint_at, 4):
        assert restored.replay(lambda r=rnd: _updates(r), want[rnd]) is True
    for rnd in range(4, rounds):
        assert restored.close(_updates(rnd)) == want[rnd]
    assert restored.weights_hash() == ref.weights_hash()
    for name in SHAPES:
        assert torch.equal(restored.downlink.coefficient_residual(name), ref.downlink.coefficient_residual(name))


def test_an_older_parameter_domain_checkpoint_loads_and_continues():
    # What servers checkpointed before the coefficient domain: an ErrorFeedback state. It loads as
    # parameter-domain residuals; the next mean round moves them into the coefficient domain and goes on
    # as the parameter-domain feedback would (tie-free node records, as above).
    node, weights = {**DOWNLINK, "topk": 1 << 16}, [0.3, 0.25, 0.2, 0.15, 0.1]
    old = gradwire.ErrorFeedback(gradwire.DCTCodec(**DOWNLINK))
    mean = exact_mean(_records(0, nodes=5, codec=node), weights)
    old.compress_bundle_reconstructed({n: mean[n] for n in sorted(mean)})
    checkpointed = unpack_state_dict(pack_state_dict({"downlink": old.state_dict()}))

    cfg = RunConfig.model_validate(DEMO)
    server = RunState.load(cfg, 1, _master(), None, checkpointed, torch.device("cpu"))
    for name in SHAPES:
        assert torch.equal(server.downlink.residual(name), old.residual(name))
    server.close(_updates(1))
    assert all(server.downlink.coefficient_residual(n) is not None for n in SHAPES)

    fast = ReencodeFeedback(gradwire.DCTCodec(**DOWNLINK))
    fast.load_state_dict(checkpointed["downlink"])
    records = _records(1, nodes=5, codec=node)
    fast.reencode(records, weights)
    mean = exact_mean(records, weights)
    old.compress_bundle_reconstructed({n: mean[n] for n in sorted(mean)})
    for name in SHAPES:
        assert fast.coefficient_residual(name) is not None
        assert _relative(fast.residual(name), old.residual(name)) < 1e-4, name


def test_a_state_of_another_format_is_refused_clearly():
    fast = ReencodeFeedback(gradwire.DCTCodec(**DOWNLINK))
    fast.reencode(_records(0))
    state = fast.state_dict()
    with pytest.raises(ValueError, match="format 'gradwire.reencode/9'"):
        ReencodeFeedback(gradwire.DCTCodec(**DOWNLINK)).load_state_dict({**state, "format": "gradwire.reencode/9"})
    # A parameter-domain ErrorFeedback (what an older server builds) refuses coefficient residuals.
    with pytest.raises(ValueError, match="unexpected keys"):
        gradwire.ErrorFeedback(gradwire.DCTCodec(**DOWNLINK)).load_state_dict(state)
    # Coefficients cut for another chunking than the codec's are refused, not misread.
    with pytest.raises(ValueError, match="coefficients, but the codec cuts"):
        ReencodeFeedback(gradwire.DCTCodec(chunk_shape=[32], topk=4)).load_state_dict(state)


def test_taking_back_a_sent_update_grows_the_coefficient_residual_by_it():
    # A replay whose bytes differ from the published ones hands the difference back (RunState.replay_reencoded).
    fast = ReencodeFeedback(gradwire.DCTCodec(**DOWNLINK))
    fast.reencode(_records(0))
    before = {n: fast.residual(n) for n in SHAPES}
    sent = _grads(99)
    fast.take_back(sent)
    for name in SHAPES:
        assert fast.coefficient_residual(name) is not None
        torch.testing.assert_close(fast.residual(name), before[name] + sent[name], rtol=0, atol=1e-6)
