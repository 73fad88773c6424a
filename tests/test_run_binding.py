"""Frames bound to their run (docs/FORMAT.md section 11): a frame made for one run and round is refused,
verbatim, by every other run and round of a real server; unbound frames keep today's behaviour unless the
run requires a binding; the independent reader computes the same binding from the text alone."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

import gradwire
import reference_reader
from gradwire.binding import RUN_BINDING_PREFIX, binding_entry, run_binding, split_binding, strip_binding
from gradwire.errors import FrameError
from gradwire.frame import Entry, read_frame, write_frame
from live_server import LiveServer
from server_helpers import make_run, random_grads


def _bound(run_id: str, round_: int, sender: int, seed: int = 0, bind_round=None) -> bytes:
    codec = gradwire.DCTCodec(chunk_shape=(64,), topk=8)
    records = [codec.compress(t, n)[0] for n, t in random_grads(seed).items()]
    at = round_ if bind_round is None else bind_round
    return write_frame([*records, binding_entry(run_id, at)], round=round_, sender=sender, bundle=True)


def test_the_binding_is_the_documented_hash_and_readers_agree():
    assert run_binding("run-a", 3) == reference_reader.run_binding("run-a", 3)
    assert len({run_binding("run-a", 3), run_binding("run-b", 3), run_binding("run-a", 4)}) == 3
    frame = _bound("run-a", 3, 1)
    parsed = reference_reader.parse(frame)
    assert reference_reader.frame_binding(parsed) == run_binding("run-a", 3)
    rest, found = split_binding(read_frame(frame).entries)
    assert found == run_binding("run-a", 3) and not any(e.name.startswith(RUN_BINDING_PREFIX) for e in rest)
    assert [e.name for e in strip_binding(read_frame(frame)).entries] == [e.name for e in rest] == list(random_grads(0))
    # Malformed bindings are a typed error, never silently ignored.
    twice = write_frame(
        [
            binding_entry("a", 0),
            Entry(RUN_BINDING_PREFIX + "0" * 32, 0, torch.float32, (0,), b"", {"data": np.zeros(0, np.float32)}),
        ],
        bundle=True,
    )
    short = write_frame(
        [Entry(RUN_BINDING_PREFIX + "abc", 0, torch.float32, (0,), b"", {"data": np.zeros(0, np.float32)})], bundle=True
    )
    valued = write_frame(
        [Entry(RUN_BINDING_PREFIX + "0" * 32, 0, torch.float32, (1,), b"", {"data": np.zeros(1, np.float32)})],
        bundle=True,
    )
    for bad in (twice, short, valued):
        with pytest.raises(FrameError) as info:
            split_binding(read_frame(bad).entries)
        assert info.value.kind == "invalid_run_binding"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("binding")) as srv:
        yield srv


def test_a_frame_is_taken_only_by_its_run_and_round(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        a = make_run(client, server.admin_token, n_nodes=2, quorum=2)
        b = make_run(client, server.admin_token, n_nodes=2, quorum=2)
        node_a, node_b = a.nodes[0], b.nodes[0]
        assert node_a.node_id == node_b.node_id  # the same node id in both runs: only the binding differs
        captured = _bound(a.run_id, 0, node_a.node_id)
        r = b.submit(node_b, 0, captured)
        assert r.status_code == 422 and r.json()["error"] == "run_binding_mismatch", r.text
        assert a.run_id in r.json()["detail"] or b.run_id in r.json()["detail"]
        # Another round of the same run: refused too (its header rewritten to the open round).
        r = a.submit(node_a, 0, _bound(a.run_id, 0, node_a.node_id, bind_round=5))
        assert r.status_code == 422 and r.json()["error"] == "run_binding_mismatch", r.text
        # The frame made for it is taken, and the round closes on the tensor records alone.
        assert a.submit(node_a, 0, captured).status_code == 202
        assert a.submit(a.nodes[1], 0, _bound(a.run_id, 0, a.nodes[1].node_id, seed=1)).status_code == 202
        a.wait_version(1)
        # A malformed binding is a bad frame; an unbound frame is taken (old clients) ...
        r = b.submit(
            node_b,
            0,
            write_frame(
                [*read_frame(captured).entries, binding_entry(b.run_id, 0)], round=0, sender=node_b.node_id, bundle=True
            ),
        )
        assert r.status_code == 400 and r.json()["error"] == "bad_frame", r.text
        unbound = gradwire.DCTCodec(chunk_shape=(64,), topk=8).encode_bundle(
            random_grads(2), round=0, sender=node_b.node_id
        )
        assert b.submit(node_b, 0, unbound).status_code == 202
        # ... unless the run requires bindings.
        strict = make_run(client, server.admin_token, n_nodes=1, require_run_binding=True)
        node = strict.nodes[0]
        unbound = gradwire.DCTCodec(chunk_shape=(64,), topk=8).encode_bundle(
            random_grads(2), round=0, sender=node.node_id
        )
        r = strict.submit(node, 0, unbound)
        assert r.status_code == 422 and r.json()["error"] == "run_binding_missing", r.text
        assert strict.submit(node, 0, _bound(strict.run_id, 0, node.node_id)).status_code == 202
