"""Checkpoints every N versions and replay: a server killed with SIGKILL between two checkpoints comes back
with the state of a run that never crashed — the same weights (hash), the same optimizer and downlink state
(the same frames afterwards), the same outer momentum — and only the last checkpoint is on disk."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch

from gradwire.client import split_frames
from gradwire_server.settings import ServerSettings
from live_server import LiveServer
from server_helpers import dct_frame, make_run, random_grads

EVERY = 3
#: Checkpoints every 3 versions and never with each version, whatever the state's size.
REPLAY_ENV = {"GRADWIRE_CHECKPOINT_EVERY": str(EVERY), "GRADWIRE_CHECKPOINT_EVERY_VERSION_BELOW_BYTES": "0"}
ROUNDS, CRASH_ROUND = 7, 5  # the crash comes two versions after checkpoint 3

ADAMW = dict(optimizer={"lr": 0.01}, downlink={"codec": "dct", "params": {"chunk_shape": [64], "topk": 8}})
SPARSELOCO = {
    "algorithm": "sparseloco",
    "sparseloco": {"sync_every": 1, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
    "downlink": {"codec": "dct", "params": {"chunk_shape": [64], "topk": 4, "value_bits": 2}},
}
SPARSELOCO_FRAMES = {**SPARSELOCO, "publish": "frames"}
#: Frames per published version: AdamW's diff; SparseLoCo's header and the server's re-encoded frame; or
#: the header and the two node frames verbatim.
PER_VERSION = {"adamw": 1, "sparseloco": 2, "sparseloco-frames": 3}


def _frame(rnd: int, node_id: int) -> bytes:
    return dct_frame(random_grads(1000 * rnd + node_id, scale=0.1), rnd, node_id)


def _rounds(run, first: int, last: int) -> None:
    run.publish_rounds(_frame, first, last)


def _published(run) -> tuple[list[bytes], str, bytes, bytes]:
    """Every published frame, the weights hash, and GET state / state/algorithm at the current version."""
    r = run.client.get(run.url("/updates"), params={"since": 0}, headers=run.admin)
    assert r.status_code == 200, r.text
    state = run.client.get(run.url("/state"), headers=run.admin)
    algorithm = run.client.get(run.url("/state/algorithm"), headers=run.admin)
    assert state.status_code == algorithm.status_code == 200
    assert state.headers["X-Gradwire-Weights-Hash"] == r.headers["X-Gradwire-Weights-Hash"]
    return split_frames(r.content), r.headers["X-Gradwire-Weights-Hash"], state.content, algorithm.content


def _checkpoints(srv, run) -> set[str]:
    return {p.name for p in (srv.data_dir / "runs" / run.run_id / "weights").iterdir()}


@pytest.mark.parametrize("mode", list(PER_VERSION))
def test_kill_between_checkpoints_replays_to_the_uninterrupted_run(tmp_path, mode):
    config = {"adamw": ADAMW, "sparseloco": SPARSELOCO, "sparseloco-frames": SPARSELOCO_FRAMES}[mode]
    with LiveServer(tmp_path / "data", env=REPLAY_ENV) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            ref = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **config)
            _rounds(ref, 0, ROUNDS)
            want = _published(ref)

            run = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **config)
            _rounds(run, 0, CRASH_ROUND)
            # Versions 4 and 5 exist only as frames (and, for AdamW, the logged submissions).
            assert _checkpoints(srv, run) == {"v000000003.safetensors"}
            first = run.nodes[0]
            assert run.submit(first, CRASH_ROUND, _frame(CRASH_ROUND, first.node_id)).status_code == 202
        srv.kill()
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run.client = c
            st = run.status()
            assert st["version"] == CRASH_ROUND and st["submitted"] == 1
            second = run.nodes[1]
            assert run.submit(second, CRASH_ROUND, _frame(CRASH_ROUND, second.node_id)).status_code == 202
            run.wait_version(CRASH_ROUND + 1)
            _rounds(run, CRASH_ROUND + 1, ROUNDS)
            got = _published(run)
        # Version 6 was a checkpoint: the one state on disk, and no frame before version 1 is lost to it.
        assert _checkpoints(srv, run) == {"v000000006.safetensors"}
    frames, weights_hash, state, algorithm = got
    per_version = PER_VERSION[mode]
    assert len(frames) == len(want[0]) == ROUNDS * per_version
    for i, (a, b) in enumerate(zip(frames, want[0])):
        assert a == b, f"version {1 + i // per_version}: the restarted run published a different frame"
    assert weights_hash == want[1]
    assert state == want[2]
    assert algorithm == want[3]  # SparseLoCo's outer momentum came back from the replay


def test_adamw_replay_needs_the_logged_submissions_and_keeps_only_those(tmp_path):
    with LiveServer(tmp_path / "data", env=REPLAY_ENV) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **ADAMW)
            _rounds(run, 0, 5)
        folder = srv.data_dir / "runs" / run.run_id / "submissions"
        # Rounds 3 and 4 (from checkpoint 3 on) are kept for a replay; rounds 0-2 were deleted at checkpoint 3.
        assert sorted(p.name[:10] for p in folder.iterdir()) == ["r000000003"] * 2 + ["r000000004"] * 2


def test_cuda_device_is_refused_clearly_where_there_is_none(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        ServerSettings(device="cuda")
    with pytest.raises(ValueError, match="cpu or cuda"):
        ServerSettings(device="meta")
    assert ServerSettings(device="cpu").torch_device() == torch.device("cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "gradwire_server", "--device", "cuda", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "CUDA is not available" in proc.stderr + proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_run_on_cuda_publishes_frames_nodes_apply_to_the_servers_hash(tmp_path):
    import gradwire
    from gradwire.state import apply_update, state_hash
    from server_helpers import tiny_state

    with LiveServer(tmp_path / "data", env={**REPLAY_ENV, "GRADWIRE_DEVICE": "cuda"}) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run = make_run(c, srv.admin_token, n_nodes=2, quorum=2, **ADAMW)
            _rounds(run, 0, 4)
            frames, weights_hash, _, _ = _published(run)
    replica = tiny_state()
    for f in frames:
        apply_update(replica, gradwire.decode_bundle(f))
    assert state_hash(replica) == weights_hash
