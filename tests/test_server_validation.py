"""Hostile and mistaken requests: each is a 4xx with a JSON reason, counted, and the server keeps serving."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import torch

import gradwire
from live_server import LiveServer
from server_helpers import SHAPES, bearer, dct_frame, dense_frame, make_run, metric, random_grads

MAX_FRAME = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("validation")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def run(server, client):
    # quorum 2 keeps round 0 open while the hostile frames arrive; max_update_norm for the norm check.
    return make_run(client, server.admin_token, n_nodes=2, quorum=2, max_frame_bytes=MAX_FRAME, max_update_norm=1000.0)


@pytest.fixture(scope="module")
def other_run(server, client):
    return make_run(client, server.admin_token, n_nodes=1)


def _rejected(client, reason):
    return metric(client, "gradwire_updates_rejected_total", f'reason="{reason}"')


def _expect(client, response, status, reason):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == reason and isinstance(body["detail"], str) and body["detail"]
    assert client.get("/healthz").json() == {"status": "ok"}


def _post(run, round, body, headers):
    return run.client.post(run.url(f"/rounds/{round}/updates"), content=body, headers=headers)


def good(node_id=1, round=0, seed=0):
    return dct_frame(random_grads(seed), round, node_id)


# -- auth ---------------------------------------------------------------------------------------


def test_missing_token(client, run):
    before = _rejected(client, "missing_token")
    _expect(client, _post(run, 0, good(), {}), 401, "missing_token")
    _expect(client, _post(run, 0, good(), {"Authorization": "Basic abc"}), 401, "missing_token")
    assert _rejected(client, "missing_token") == before + 2


def test_wrong_token(client, run):
    _expect(client, _post(run, 0, good(), bearer("not-a-token")), 401, "invalid_token")
    _expect(client, client.get(run.url(), headers=bearer("nope")), 401, "invalid_token")


def test_another_runs_node_token(client, run, other_run):
    foreign = other_run.nodes[0]
    _expect(client, _post(run, 0, good(foreign.node_id), foreign.headers), 403, "forbidden")
    _expect(client, client.get(run.url("/state"), headers=foreign.headers), 403, "forbidden")
    _expect(client, client.get(run.url(), headers=foreign.headers), 403, "forbidden")


def test_admin_token_on_the_node_route_and_node_token_on_admin_routes(client, run, server):
    _expect(client, _post(run, 0, good(), server.admin_headers()), 403, "forbidden")
    node = run.nodes[0]
    _expect(client, client.post("/v1/runs", json={}, headers=node.headers), 403, "forbidden")
    _expect(client, client.post(run.url("/nodes"), json={}, headers=node.headers), 403, "forbidden")
    _expect(client, client.put(run.url("/state"), content=b"x", headers=node.headers), 403, "forbidden")


def test_unknown_run(client, run):
    _expect(
        client,
        client.post("/v1/runs/doesnotexist/rounds/0/updates", content=good(), headers=run.nodes[0].headers),
        404,
        "unknown_run",
    )


def test_sender_must_be_the_tokens_node(client, run):
    _expect(client, _post(run, 0, good(node_id=2), run.nodes[0].headers), 422, "sender_mismatch")


# -- bytes --------------------------------------------------------------------------------------


def test_malformed_bytes(client, run):
    node = run.nodes[0]
    before = _rejected(client, "bad_frame")
    for body in (b"", b"hello", b"GWIR" + b"\x00" * 60, bytes(range(256))):
        _expect(client, _post(run, 0, body, node.headers), 400, "bad_frame")
    assert _rejected(client, "bad_frame") == before + 4


def test_truncated_and_bit_flipped_frames(client, run):
    node = run.nodes[0]
    frame = good()
    _expect(client, _post(run, 0, frame[: len(frame) // 2], node.headers), 400, "bad_frame")
    _expect(client, _post(run, 0, frame[:-1], node.headers), 400, "bad_frame")
    flipped = bytearray(frame)
    flipped[len(frame) // 2] ^= 0x10
    r = _post(run, 0, bytes(flipped), node.headers)
    _expect(client, r, 400, "bad_frame")
    assert "checksum" in r.json()["detail"]


def test_oversized_by_content_length_and_by_stream(client, run):
    node = run.nodes[0]
    _expect(client, _post(run, 0, b"\x00" * (MAX_FRAME + 1), node.headers), 413, "frame_too_large")

    def chunks():  # no Content-Length: the server counts while reading
        for _ in range(MAX_FRAME // 4096 + 2):
            yield b"\x00" * 4096

    r = run.client.post(run.url("/rounds/0/updates"), content=chunks(), headers=node.headers)
    _expect(client, r, 413, "frame_too_large")


def test_tensor_frame_instead_of_bundle(client, run):
    frame = gradwire.DCTCodec(chunk_shape=(64,), topk=4).encode(torch.randn(10), name="fc2.bias", round=0, sender=1)
    _expect(client, _post(run, 0, frame, run.nodes[0].headers), 422, "not_a_bundle")


def test_wrong_shape_missing_and_extra_tensors(client, run):
    node = run.nodes[0]
    grads = random_grads(1)
    wrong = dict(grads, **{"fc1.weight": torch.randn(64, 32)})
    r = _post(run, 0, dct_frame(wrong, 0, 1), node.headers)
    _expect(client, r, 422, "tensor_mismatch")
    assert "fc1.weight" in r.json()["detail"]
    missing = {k: v for k, v in grads.items() if k != "fc2.bias"}
    _expect(client, _post(run, 0, dct_frame(missing, 0, 1), node.headers), 422, "tensor_mismatch")
    extra = dict(grads, extra=torch.randn(3))
    # one record more than the model has: refused by the frame limits or by the name check
    r = _post(run, 0, dct_frame(extra, 0, 1), node.headers)
    assert r.status_code in (400, 422) and r.json()["error"] in ("bad_frame", "tensor_mismatch")


def test_wrong_round(client, run):
    node = run.nodes[0]
    _expect(client, _post(run, 0, good(round=5), node.headers), 422, "round_mismatch")
    _expect(client, _post(run, 5, good(round=5), node.headers), 409, "round_not_open")


def test_nan_and_inf_values(client, run):
    node = run.nodes[0]
    for bad in (float("nan"), float("inf"), float("-inf")):
        grads = random_grads(2)
        grads["fc1.weight"][3, 4] = bad
        r = _post(run, 0, dense_frame(grads, 0, 1), node.headers)
        _expect(client, r, 422, "non_finite")
        assert "fc1.weight" in r.json()["detail"]


def test_nan_scale_in_a_dct_record(client, run):
    entries = []
    codec = gradwire.DCTCodec(chunk_shape=(64,), topk=4)
    for name, t in random_grads(3).items():
        e, _ = codec.compress(t, name)
        if name == "fc1.bias":
            scale = e.sections["scale"].copy()
            scale[0] = np.nan
            e = dataclasses.replace(e, sections=dict(e.sections, scale=scale))
        entries.append(e)
    frame = gradwire.write_frame(entries, round=0, sender=1, bundle=True)
    r = _post(run, 0, frame, run.nodes[0].headers)
    _expect(client, r, 400, "bad_frame")
    assert "scale" in r.json()["detail"]


def test_unknown_codec_id(client, run):
    entries = [gradwire.Entry(n, 42, torch.float32, s, b"", {"data": np.zeros(1, np.uint8)}) for n, s in SHAPES.items()]
    r = _post(run, 0, gradwire.write_frame(entries, round=0, sender=1, bundle=True), run.nodes[0].headers)
    _expect(client, r, 400, "bad_frame")
    assert "unknown codec" in r.json()["detail"]


def test_norm_ceiling(client, run):
    r = _post(run, 0, dense_frame(random_grads(4, scale=1e3), 0, 1), run.nodes[0].headers)
    _expect(client, r, 422, "norm_too_large")


def test_nothing_rejected_touched_the_round(client, run):
    """After every hostile request above, round 0 counts only the two good updates that follow."""
    assert run.status()["submitted"] == 0
    r = _post(run, 0, good(1, 0, seed=11), run.nodes[0].headers)
    assert r.status_code == 202 and r.json()["submitted"] == 1
    r = _post(run, 0, good(2, 0, seed=12), run.nodes[1].headers)
    assert r.status_code == 202
    run.wait_version(1)
    assert client.get("/readyz").status_code == 200
    text = client.get("/metrics").text
    for reason in (
        "missing_token",
        "invalid_token",
        "forbidden",
        "bad_frame",
        "frame_too_large",
        "not_a_bundle",
        "tensor_mismatch",
        "round_mismatch",
        "round_not_open",
        "non_finite",
        "norm_too_large",
        "sender_mismatch",
        "unknown_run",
    ):
        assert f'gradwire_updates_rejected_total{{reason="{reason}"}}' in text, reason
