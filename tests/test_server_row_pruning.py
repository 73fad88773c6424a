"""Old rows go: the database keeps the update and version rows of the retained window only, so a long run's
store stops growing (bench/reliability/probe_load measures it over 1,000 rounds)."""

from __future__ import annotations

import sqlite3

import httpx

from gradwire_server.driver import ROW_PRUNE_EVERY
from live_server import LiveServer
from server_helpers import dct_frame, make_run, random_grads

KEEP = 4


def _rows(db, table: str, run_id: str) -> list[int]:
    column = "target_round" if table == "submissions" else "version"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return sorted(r[0] for r in con.execute(f"SELECT {column} FROM {table} WHERE run_id = ?", (run_id,)))


def test_rows_older_than_the_retained_window_are_deleted_and_recent_duplicates_still_answered(tmp_path):
    rounds = ROW_PRUNE_EVERY + KEEP + 2
    with LiveServer(tmp_path / "data") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        run = make_run(
            c,
            srv.admin_token,
            n_nodes=2,
            quorum=2,
            keep_versions=KEEP,
            optimizer={"lr": 0.01},
            downlink={"codec": "dct", "params": {"chunk_shape": [64], "topk": 8}},
        )

        def frame(rnd: int, node_id: int) -> bytes:
            return dct_frame(random_grads(1000 * rnd + node_id, scale=0.1), rnd, node_id)

        run.publish_rounds(frame, 0, rounds)
        db = srv.data_dir / "gradwire.sqlite3"
        submissions, versions = _rows(db, "submissions", run.run_id), _rows(db, "versions", run.run_id)
        # Pruned once, at the round where the window's start had moved ROW_PRUNE_EVERY rounds on.
        assert submissions[0] == versions[0] + 1 == ROW_PRUNE_EVERY
        assert len(submissions) == 2 * (rounds - ROW_PRUNE_EVERY) and versions[-1] == rounds
        # A resubmission inside the window is still recognised as the same update ...
        last = rounds - 1
        again = run.submit(run.nodes[0], last, frame(last, run.nodes[0].node_id))
        assert again.status_code == 202 and again.json()["duplicate"] is True
        # ... and a catch-up from the oldest retained diff still gets its weights hash.
        r = c.get(run.url("/updates"), params={"since": rounds - KEEP}, headers=run.admin)
        assert r.status_code == 200 and r.headers["X-Gradwire-Weights-Hash"] == run.status()["weights_hash"]
