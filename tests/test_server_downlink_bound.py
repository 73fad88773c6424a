"""A downlink never larger than the frames it replaces: for every round the server publishes the smaller of
the re-encoded aggregate and the round's frames verbatim (plus the version header), nodes still hold the
server's weights bit for bit, and a restart replays the choice to the same bytes."""

from __future__ import annotations

import httpx
import pytest
import torch

import gradwire
from gradwire.published import read_published, write_published
from live_server import LiveServer
from server_helpers import make_run, random_grads

#: Small tensors and unusual chunk shapes: 3 senders' frames are smaller than the default downlink.
SMALL = {"w1": (24, 40), "b1": (24,), "w2": (10, 24), "odd": (7, 13)}
#: A downlink budget far above the nodes' (every coefficient at 8 bits): its re-encoding is the larger
#: where the nodes send one coefficient per 64.
GENEROUS_DOWNLINK = {"codec": "dct", "params": {"chunk_shape": [64], "topk": 64, "value_bits": 8}}
REPLAY_ENV = {"GRADWIRE_CHECKPOINT_EVERY": "1000", "GRADWIRE_CHECKPOINT_EVERY_VERSION_BELOW_BYTES": "0"}


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """One server for this module's tests, each on runs of its own (a server's start is most of a small
    test's time; the tests that kill a server start their own)."""
    with LiveServer(tmp_path_factory.mktemp("server-data")) as srv:
        yield srv


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) * 0.1 for n, s in SMALL.items()}


def _frame_maker(chunk_shape, topk):
    codec = gradwire.DCTCodec(chunk_shape=chunk_shape, topk=topk)

    def frame(rnd: int, node_id: int) -> bytes:
        return codec.encode_bundle(random_grads(1000 * rnd + node_id, shapes=SMALL), round=rnd, sender=node_id)

    return frame


def _published(client: httpx.Client, run) -> tuple[bytes, str]:
    r = client.get(run.url("/updates"), params={"since": 0}, headers=run.admin)
    assert r.status_code == 200, r.text
    return r.content, r.headers["X-Gradwire-Weights-Hash"]


@pytest.mark.parametrize("chunk_shape,topk", [((8, 8), 8), ((64,), 1), ((3, 5), 2), ((16,), 1)])
@pytest.mark.parametrize("algorithm", ["sparseloco", "demo"])
@pytest.mark.parametrize("downlink", [None, GENEROUS_DOWNLINK], ids=["default-downlink", "generous-downlink"])
def test_no_version_is_larger_than_the_frames_it_replaces(live_server, algorithm, chunk_shape, topk, downlink):
    rounds, n_nodes = 4, 3
    frame = _frame_maker(chunk_shape, topk)
    extra = {"downlink": downlink} if downlink else {}
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        run = make_run(
            c, live_server.admin_token, n_nodes=n_nodes, quorum=n_nodes, state=_state(), algorithm=algorithm, **extra
        )
        run.publish_rounds(frame, 0, rounds)
        data, _ = _published(c, run)
    versions = read_published(data)
    assert len(versions) == rounds
    for rnd, v in enumerate(versions):
        frames = [frame(rnd, node.node_id) for node in run.nodes]
        bound = len(write_published(rnd, frames, [1.0] * n_nodes))  # the frames plus their header
        assert v.nbytes <= bound, (rnd, v.nbytes, bound, v.reencoded_from)
    if downlink is GENEROUS_DOWNLINK and chunk_shape == (64,):
        assert {v.reencoded_from for v in versions} == {0}  # the frames verbatim: the smaller of the two


def test_the_issue_setup_stays_within_the_uplinks_and_nodes_match_the_server(live_server):
    # sparseloco with the defaults, 3 nodes sending 8×8-chunk DCT frames (k = 8) of a small model: the
    # re-encoded aggregate was 7,810 B against 3,078 B for the three uplinks together.
    from torch import nn

    from gradwire.client import GradwireClient, Node
    from gradwire.state import state_hash

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def loss(m: nn.Module, node: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * node + step)
        x = torch.randn(16, 16, generator=g)
        return ((m(x) - x[:, :4]) ** 2).mean()

    from server_helpers import train_together

    admin = GradwireClient(live_server.url, live_server.admin_token)
    run_id = admin.create_run({"algorithm": "sparseloco", "quorum": 3})
    admin.put_state(run_id, {n: p.detach() for n, p in model().named_parameters()})
    nodes = []
    for _ in range(3):
        node_id, token = admin.register_node(run_id)
        nodes.append(
            Node(
                GradwireClient(live_server.url, token),
                run_id,
                model(),
                gradwire.DCTCodec(chunk_shape=(8, 8), topk=8),
                node_id,
                wait=20,
            )
        )
    train_together(nodes, loss, 4 * admin.status(run_id)["config"]["sparseloco"]["sync_every"])
    status = admin.status(run_id)
    assert status["version"] == 4
    assert {state_hash(n.params) for n in nodes} == {status["weights_hash"]}
    versions = nodes[0].client.published(run_id, 0).versions
    header = len(write_published(0, [b""] * 3, [1.0] * 3))
    uplinks = sum(n.bytes_sent for n in nodes)  # every frame the 3 nodes sent, 4 versions' worth
    assert sum(v.nbytes for v in versions) <= uplinks + 4 * header


def test_kill_9_replays_the_verbatim_choice_to_the_same_bytes(tmp_path):
    rounds, crash_round = 5, 2
    frame = _frame_maker((64,), 1)
    config = {"algorithm": "sparseloco", "downlink": GENEROUS_DOWNLINK}
    with LiveServer(tmp_path / "ref") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        ref = make_run(c, srv.admin_token, n_nodes=3, quorum=3, state=_state(), **config)
        ref.publish_rounds(frame, 0, rounds)
        want, want_hash = _published(c, ref)
    with LiveServer(tmp_path / "data", env=REPLAY_ENV) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run = make_run(c, srv.admin_token, n_nodes=3, quorum=3, state=_state(), **config)
            run.publish_rounds(frame, 0, crash_round)
        srv.kill()  # the restart replays versions 1..2 from checkpoint 0
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run.client = c
            run.publish_rounds(frame, crash_round, rounds)
            got, got_hash = _published(c, run)
            srv.stop()
    assert 0 in [v.reencoded_from for v in read_published(want)]
    assert got == want and got_hash == want_hash
