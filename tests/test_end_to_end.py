"""End to end: the real server (uvicorn on loopback, via ``live_server``) and real worker processes.

Covers the client side of issue 4: a compressed run that trains with every node bit-identical to the
server, a late joiner starting from the full state, a node too far behind recovering through the state,
a gradient whose round closed going back into the residual (the ``gradwire`` command: test_cli.py).
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

import gradwire
from gradwire.client import GradwireClient, Node
from gradwire.state import apply_update, state_hash
from gradwire_apps.demo.runs import codec_spec, run_distributed
from gradwire_apps.demo.tasks import DigitsTask, digits_mlp, evaluate, load_digits

DCT = codec_spec("dct", chunk_shape=[32, 32], topk=32)


def _initial_state(hidden: int = 128, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in digits_mlp(hidden).named_parameters()}


def test_compressed_run_trains_and_every_node_ends_bit_identical(live_server, tmp_path):
    data = load_digits(0)
    initial = _initial_state()
    before = digits_mlp()
    before.load_state_dict(initial)
    initial_loss, _ = evaluate(before, data)

    result = run_distributed(
        live_server.url,
        live_server.admin_token,
        label="dct",
        uplink=DCT,
        downlink=DCT,
        task=DigitsTask(data=data),
        workers=3,
        rounds=15,
        lr=1e-2,
        batch_size=64,
        log_dir=tmp_path,
        progress=False,
        timeout=240,
    )

    assert sorted(result.node_hashes) == [1, 2, 3]
    assert result.in_sync, (result.node_hashes, result.server_hash)
    assert len(result.losses) == 15
    assert result.test_loss < 0.8 * initial_loss, (initial_loss, result.test_loss)
    # Compressed both ways: each node sent and received far less than fp32 would have taken.
    assert result.up_per_node_round < result.dense_bytes / 10
    assert 0 < result.down_per_node_round < result.dense_bytes / 10

    # The server's weights are exactly the initial state plus every published frame, applied in order.
    with GradwireClient(live_server.url, live_server.admin_token) as admin:
        status = admin.status(result.run_id)
        batch = admin.updates(result.run_id, since=0)
    assert status["version"] == batch.version == 15
    replica = {n: t.clone() for n, t in initial.items()}
    for frame in batch.frames:
        apply_update(replica, gradwire.decode_bundle(frame))
    assert state_hash(replica) == batch.weights_hash == status["weights_hash"] == result.server_hash


def test_late_joiner_catches_up_from_the_full_state(live_server, tmp_path):
    # Quorum 2 of 3: the two early nodes carry the run until the third joins at version 5; after that
    # some submissions lose the race for their round and go back into the residual.
    result = run_distributed(
        live_server.url,
        live_server.admin_token,
        label="late",
        uplink=DCT,
        downlink=DCT,
        workers=3,
        rounds=12,
        lr=1e-2,
        run_config={"quorum": 2},
        join_at={2: 5},
        log_dir=tmp_path,
        progress=False,
        timeout=240,
    )
    assert result.joined[1] == 0 and result.joined[2] == 0
    assert result.joined[3] >= 5
    assert result.state_loads == 3  # each node loaded the state once, when it joined
    assert result.in_sync and sorted(result.node_hashes) == [1, 2, 3]


def _node_pair(url, admin_token, *, keep_versions=1000, device="cpu"):
    """A quorum-1 run with two in-process nodes on it."""
    admin = GradwireClient(url, admin_token)
    run_id = admin.create_run(
        {"uplink": DCT, "downlink": DCT, "quorum": 1, "keep_versions": keep_versions, "optimizer": {"lr": 1e-2}}
    )
    admin.put_state(run_id, _initial_state(hidden=16))
    nodes = []
    for _ in range(2):
        node_id, token = admin.register_node(run_id)
        model = digits_mlp(16).to(device)
        nodes.append(
            Node(
                GradwireClient(url, token), run_id, model, gradwire.make_codec("dct", **DCT["params"]), node_id, wait=10
            )
        )
    return admin, run_id, nodes


@functools.lru_cache(maxsize=1)
def _digits():
    return load_digits(0)


def _grads(model, seed):
    data = _digits()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(data.y_train), (32,), generator=g)
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=False)
    logits = model(data.x_train[idx].to(device))
    torch.nn.functional.cross_entropy(logits, data.y_train[idx].to(device)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_node_too_far_behind_recovers_through_the_state(live_server):
    admin, run_id, (leader, laggard) = _node_pair(live_server.url, live_server.admin_token, keep_versions=2)
    laggard.sync()
    assert laggard.version == 0
    for step in range(5):
        assert leader.step(_grads(leader.module, step)) == step + 1
    assert laggard.catch_up() == 5  # diffs since version 0 are gone: the state is loaded instead
    assert laggard.state_loads == 2
    assert state_hash(laggard.params) == state_hash(leader.params) == admin.status(run_id)["weights_hash"]
    # Back in step: the next round's diff is applied on both, still bit-identical.
    assert laggard.step(_grads(laggard.module, 99)) == 6
    assert leader.catch_up() == 6
    assert state_hash(laggard.params) == state_hash(leader.params) == admin.state(run_id)[2]


def test_gradient_of_a_closed_round_goes_back_into_the_residual(live_server):
    admin, run_id, (fast, slow) = _node_pair(live_server.url, live_server.admin_token)
    fast.sync(), slow.sync()
    grads = _grads(slow.module, 7)
    assert fast.step(_grads(fast.module, 1)) == 1  # quorum 1: round 0 is published without slow
    assert slow.step(grads) == 1  # its submission to round 0 is refused (410) and it catches up
    assert slow.rounds_missed == 1
    for name, g in grads.items():
        # Nothing of this gradient was applied, so all of it waits in the residual for the next step.
        torch.testing.assert_close(slow.side.feedback.residual(name), g, rtol=0, atol=1e-6)
    assert state_hash(slow.params) == state_hash(fast.params) == admin.status(run_id)["weights_hash"]


def test_restarted_node_with_a_different_frame_waits_for_the_round(live_server):
    admin = GradwireClient(live_server.url, live_server.admin_token)
    run_id = admin.create_run({"uplink": DCT, "downlink": DCT, "quorum": 2})
    admin.put_state(run_id, _initial_state(hidden=16))
    (id1, token1), (id2, token2) = admin.register_node(run_id), admin.register_node(run_id)
    codec = gradwire.make_codec("dct", **DCT["params"])
    before = Node(GradwireClient(live_server.url, token1), run_id, digits_mlp(16), codec, id1)
    before.sync()
    before.client.submit(run_id, 0, before.side.feedback.encode_bundle(_grads(before.module, 1), round=0, sender=id1))

    # The same node after a restart: fresh residuals, so a different frame for round 0 (409).
    restarted = Node(GradwireClient(live_server.url, token1), run_id, digits_mlp(16), codec, id1, wait=10)
    restarted.sync()
    grads = _grads(restarted.module, 2)
    versions = []
    stepping = threading.Thread(target=lambda: versions.append(restarted.step(grads)), daemon=True)
    stepping.start()
    deadline = time.monotonic() + 30
    while restarted.rounds_missed == 0:  # refused, and now long-polling for round 0 to publish
        assert stepping.is_alive() and time.monotonic() < deadline
        stepping.join(timeout=0.05)
    other = Node(GradwireClient(live_server.url, token2), run_id, digits_mlp(16), codec, id2)
    other.sync()
    assert other.step(_grads(other.module, 3)) == 1  # the second distinct node completes the quorum
    stepping.join(timeout=30)
    assert versions == [1]
    assert admin.status(run_id)["version"] == 1
    assert state_hash(restarted.params) == state_hash(other.params) == admin.status(run_id)["weights_hash"]
    for name, g in grads.items():
        torch.testing.assert_close(restarted.side.feedback.residual(name), g, rtol=0, atol=1e-6)


def test_node_rides_out_a_server_crash_without_losing_its_acknowledged_update(live_server):
    admin = GradwireClient(live_server.url, live_server.admin_token)
    run_id = admin.create_run({"uplink": DCT, "downlink": DCT, "quorum": 2})
    admin.put_state(run_id, _initial_state(hidden=16))
    (id1, token1), (id2, token2) = admin.register_node(run_id), admin.register_node(run_id)
    codec = gradwire.make_codec("dct", **DCT["params"])
    # Patient clients: retry connection errors for a while (at least ~30 s of back-off in all).
    patient = dict(retries=60, backoff=0.05, max_backoff=1.0)
    first = Node(GradwireClient(live_server.url, token1, **patient), run_id, digits_mlp(16), codec, id1, wait=5)
    first.sync()
    versions, errors = [], []

    def step_first():
        try:
            versions.append(first.step(_grads(first.module, 1)))
        except Exception as exc:  # surfaced by the assertions below
            errors.append(exc)

    stepping = threading.Thread(target=step_first, daemon=True)
    stepping.start()
    deadline = time.monotonic() + 30
    while admin.status(run_id)["submitted"] < 1:  # acknowledged (202): durably recorded
        assert stepping.is_alive() and time.monotonic() < deadline, errors
        stepping.join(timeout=0.05)

    live_server.kill()  # SIGKILL while the first node long-polls for the round
    live_server.start()
    second = Node(GradwireClient(live_server.url, token2, **patient), run_id, digits_mlp(16), codec, id2)
    second.sync()
    assert second.step(_grads(second.module, 2)) == 1  # completes the quorum: the first update still counts
    stepping.join(timeout=60)
    assert not errors and versions == [1]
    status = GradwireClient(live_server.url, live_server.admin_token).status(run_id)
    assert status["version"] == 1
    assert state_hash(first.params) == state_hash(second.params) == status["weights_hash"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nodes_on_cuda_stay_bit_identical_to_the_server(live_server):
    admin, run_id, (a, b) = _node_pair(live_server.url, live_server.admin_token, device="cuda")
    a.sync(), b.sync()
    for step in range(3):
        a.step(_grads(a.module, step))  # compresses on the GPU; diffs decoded on the CPU, added on the GPU
        b.catch_up()
        assert next(a.module.parameters()).is_cuda
        assert state_hash(a.params) == state_hash(b.params) == admin.status(run_id)["weights_hash"]
