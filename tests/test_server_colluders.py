"""Colluders inside the honest spread, through a real server: in a run whose honest nodes are IID (a data
assignment) the default rule's per-node histories (gradwire.sender_history) take their weight away, the plain
mean does not, without an assignment nobody is silenced for deviating, and a restarted server (kill -9) weighs
every later round exactly as an uninterrupted one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from gradwire.published import read_published
from live_server import LiveServer
from server_helpers import dense_frame, published_across_a_crash, random_grads

BENCH = Path(__file__).resolve().parent.parent / "bench" / "attacks.py"


def _bench():
    spec = importlib.util.spec_from_file_location("attacks_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attacks_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("colluders")) as srv:
        yield srv


def _weights_by_sender(admin, run_id: str) -> list[dict[int, float]]:
    return [{f.sender: w for f, w in zip(v.frames, v.weights)} for v in admin.published(run_id, 0).versions]


@pytest.mark.parametrize("rule", ["assigned", "default", "mean"])
def test_alie_colluders_lose_their_weight_only_where_the_run_assigns_its_data(server, rule):
    """2 of 8 nodes send ALIE's mean − std of the honest updates, every round (bench/attacks.py): the
    weights the rule gave them. With a data assignment (honest nodes IID: ``assigned``) the sender
    histories take their weight away, in the adamw mode too; without one (the default) nobody loses
    weight for deviating persistently — an honest minority could not be told from them — and the plain mean
    gives them a full share."""
    from gradwire.client import GradwireClient

    bench = _bench()
    rounds = 16
    got = bench.run_one(server, "demo", "alie", rule, rounds, nodes=8, rogues=2)
    assert got.versions == rounds and not got.refused
    admin = GradwireClient(server.url, server.admin_token, timeout=60)
    try:
        versions = _weights_by_sender(admin, got.run_id)
    finally:
        admin.close()
    rogues, honest = (7, 8), range(1, 7)
    last = versions[-1]
    if rule == "default":
        # Bounded, not silenced: the colluders (counted once: identical updates) keep a share like the others'.
        assert max(last[r] for r in rogues) == pytest.approx(max(last[h] for h in honest), rel=0.05)
        return
    if rule == "mean":
        # Identical colluder updates count once (copies), but that one keeps a full share.
        assert max(last[r] for r in rogues) == pytest.approx(max(last[h] for h in honest))
        return
    assert all(last[r] == 0.0 for r in rogues), last
    assert all(last[h] > 0.0 for h in honest), last
    assert sum(last[h] for h in honest) == pytest.approx(1.0)
    # The first rounds, before any history, weigh every node alike (the colluders' identical updates count
    # once: the one committed first).
    assert sorted(versions[0][r] for r in rogues) == [0.0, pytest.approx(versions[0][1])]


def test_a_restarted_server_trusts_every_node_as_an_uninterrupted_one(tmp_path):
    """Four nodes, one of them adding the same bias to its update every round (a colluder's signature), in
    runs that declare their honest nodes IID (the sender histories on, in every mode). The server is killed
    (-9) after version 7, its last checkpoint at version 4, so the rule's state comes back from the
    checkpoint and from replaying versions 5 to 7 — an adamw run (from its logged updates), a demo run
    publishing frames (from the published weights) and a re-encoded sparseloco run. Every byte published
    after the restart must equal an uninterrupted twin server's, and the biased node must have lost weight
    (else the test proves nothing)."""
    env = {"GRADWIRE_CHECKPOINT_EVERY": "4", "GRADWIRE_CHECKPOINT_EVERY_VERSION_BELOW_BYTES": "0"}
    iid = {"honest_iid": True}
    configs = [
        {"algorithm": "adamw", "quorum": 4, "aggregation": iid},
        {"algorithm": "demo", "quorum": 4, "publish": "frames", "aggregation": iid},
        {"algorithm": "sparseloco", "quorum": 4, "publish": "aggregate", "aggregation": iid},
    ]

    def frame(rnd: int, sender: int) -> bytes:
        grads = random_grads(1000 * rnd + sender)
        if sender == 4:
            grads = {k: v + 1.0 for k, v in grads.items()}
        return dense_frame(grads, rnd, sender)

    uninterrupted, restarted = published_across_a_crash(tmp_path, env, configs, frame, 4, 7, 14)
    assert uninterrupted == restarted
    demo = read_published(restarted[1])
    last = {f.sender: w for f, w in zip(demo[-1].frames, demo[-1].weights)}
    assert last[4] < 0.6 * last[1], last  # uniform weights would be equal
    assert torch.isfinite(torch.tensor(demo[-1].weights)).all()


def test_histories_are_kept_in_every_mode_exactly_where_the_honest_nodes_are_iid():
    # With a data assignment (honest_iid) the default rule keeps sender histories, the adamw mode included;
    # without one it keeps none (an honest minority would lose its weight), nor does the plain mean.
    from gradwire_server.config import RunConfig
    from gradwire_server.transition import RunState

    weights = {"w": torch.zeros(4, 4)}
    iid = {"honest_iid": True}
    for config, kept in (
        ({"algorithm": "adamw"}, False),
        ({"algorithm": "demo"}, False),
        ({"algorithm": "sparseloco"}, False),
        ({"algorithm": "adamw", "aggregation": iid}, True),
        ({"algorithm": "demo", "aggregation": iid}, True),
        ({"algorithm": "sparseloco", "aggregation": iid}, True),
        ({"algorithm": "demo", "aggregation": {"rule": "mean", "honest_iid": True}}, False),
    ):
        state = RunState.load(RunConfig.model_validate(config), 0, weights, None, {}, torch.device("cpu"))
        assert (state.senders is not None) == kept, config
        assert ("senders" in state.checkpoint()[2]) == kept, config
