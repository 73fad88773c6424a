"""The server's downlink codec lives as long as its run: its state is carried from round to round,
persisted with every version, and restored after a crash.

PowerSGD warm-starts each step from the previous step's factors, so a downlink that restarted from a
fresh codec every round (or after a restart) would publish different frames than one long-lived codec.
"""

from __future__ import annotations

import httpx
import torch

import gradwire
from gradwire import read_frame
from gradwire.client import split_frames
from gradwire.frame import SERVER_SENDER
from gradwire.state import apply_update, state_hash
from gradwire_server.aggregate import Update
from gradwire_server.config import RunConfig
from gradwire_server.metrics import Metrics
from gradwire_server.optim import AdamWState, adamw_step
from gradwire_server.rounds import RoundEngine, RunRuntime
from gradwire_server.settings import ServerSettings
from gradwire_server.store import Store
from gradwire_server.transition import RunState
from live_server import LiveServer
from server_helpers import dct_frame, dense_frame, make_run, random_grads, tiny_state

POWERSGD_DOWNLINK = dict(optimizer={"lr": 0.01}, downlink={"codec": "powersgd", "params": {"rank": 1}})


def test_published_frames_equal_one_long_lived_downlink_codec(tmp_path):
    cfg = RunConfig.model_validate(POWERSGD_DOWNLINK)
    store = Store(tmp_path)
    try:
        engine = RoundEngine(store, Metrics(live_nodes=lambda: 0.0), ServerSettings(data_dir=tmp_path))
        run_id = store.create_run(cfg.model_dump(mode="json"))
        master = tiny_state()
        store.set_initial_state(run_id, master, state_hash(master))
        rt = RunRuntime(run_id=run_id, config=cfg, state=RunState.load(cfg, 0, master, None, {}, torch.device("cpu")))

        # The reference: the same AdamW steps, one ErrorFeedback(PowerSGD) kept for the whole run.
        ref_feedback = gradwire.ErrorFeedback(gradwire.PowerSGD(rank=1))
        ref_master = {n: t.clone() for n, t in master.items()}
        ref_moments = AdamWState.zeros_like(master)
        for version in range(1, 6):
            grads = random_grads(version)
            # One node's uncompressed frame: the round's aggregate is exactly ``grads``.
            update = Update(read_frame(dense_frame(grads, version - 1, 1)), 1.0, 0.0, 1)
            pub = engine.close_and_publish(rt, [update])
            rt.version = pub.version

            targets, ref_moments = adamw_step(cfg.optimizer, ref_master, grads, ref_moments)
            diff = {n: targets[n] - ref_master[n] for n in sorted(ref_master)}
            frame = ref_feedback.encode_bundle(diff, round=version, sender=SERVER_SENDER)
            apply_update(ref_master, gradwire.decode_bundle(frame))
            assert pub.frame == frame, f"version {version}: the server's downlink frame differs"
            assert pub.weights_hash == state_hash(ref_master)

        # What was persisted with the last version is that codec's state, warm-start factors included.
        kept = store.load_server_state(run_id, 5)["downlink"]
        assert kept["codec"], "PowerSGD's warm-start state was not persisted"
        fresh = gradwire.ErrorFeedback(gradwire.PowerSGD(rank=1))
        fresh.load_state_dict(kept)
        diff = {n: t * 0.5 for n, t in random_grads(99).items()}
        assert fresh.encode_bundle(diff, round=6) == ref_feedback.encode_bundle(diff, round=6)
    finally:
        store.close()


def _frame(rnd: int, node_id: int) -> bytes:
    return dct_frame(random_grads(1000 * rnd + node_id), rnd, node_id)


def _all_published(client: httpx.Client, run) -> tuple[list[bytes], str]:
    r = client.get(run.url("/updates"), params={"since": 0}, headers=run.admin)
    assert r.status_code == 200, r.text
    return split_frames(r.content), r.headers["X-Gradwire-Weights-Hash"]


def test_powersgd_downlink_killed_mid_run_publishes_the_frames_of_an_uninterrupted_run(tmp_path):
    rounds, crash_round = 5, 2
    with LiveServer(tmp_path / "data") as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            ref = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **POWERSGD_DOWNLINK)
            ref.publish_rounds(_frame, 0, rounds)
            ref_frames, ref_hash = _all_published(c, ref)

            run = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **POWERSGD_DOWNLINK)
            run.publish_rounds(_frame, 0, crash_round)
            # Mid-round: one node's update is acknowledged, then the server dies without a word.
            first = run.nodes[0]
            assert run.submit(first, crash_round, _frame(crash_round, first.node_id)).status_code == 202
        srv.kill()
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run.client = c
            second = run.nodes[1]
            assert run.submit(second, crash_round, _frame(crash_round, second.node_id)).status_code == 202
            run.wait_version(crash_round + 1)
            run.publish_rounds(_frame, crash_round + 1, rounds)
            frames, weights_hash = _all_published(c, run)

    store = Store(tmp_path / "data")
    try:
        kept = store.load_server_state(run.run_id, rounds)["downlink"]
    finally:
        store.close()
    assert kept["codec"], "the downlink's PowerSGD state is not persisted"
    assert len(frames) == len(ref_frames) == rounds
    for version, (got, want) in enumerate(zip(frames, ref_frames), start=1):
        assert got == want, f"version {version}: the restarted run published a different frame"
    assert weights_hash == ref_hash
