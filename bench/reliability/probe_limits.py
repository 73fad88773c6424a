"""Limits and secrets on a real server: the caps (runs, nodes per run, stored bytes), what runs cost on disk
and get back when deleted, token revocation, tokens at rest (the database grepped for every token), the
admin token out of the process's command line, /metrics without run ids; and a run whose round close
always fails (the issue's ``lr: 1e308``): marked failed, quiet, and still failed after a restart."""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path

import httpx
from bench.reliability.row import Row

from gradwire.state import state_to_bytes
from gradwire_server.launcher import LoopbackServer


def _metric(c: httpx.Client, key: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def _refusal(r: httpx.Response) -> str:
    return f"{r.status_code} {r.json().get('error')}: {r.json().get('detail', '')[:70]}"


def probes(quick: bool) -> list[Row]:
    import torch

    from gradwire import IdentityCodec

    runs_cap = 50 if quick else 300
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="probe-limits-") as tmp:
        token_file = Path(tmp) / "admin.token"
        admin_token = "probe-limits-" + hashlib.sha256(tmp.encode()).hexdigest()[:24]
        token_file.write_text(admin_token + "\n")
        token_file.chmod(0o600)
        server = LoopbackServer(
            Path(tmp) / "data",
            admin_token=admin_token,
            log_path=Path(tmp) / "server.log",
            env={
                "GRADWIRE_ADMIN_TOKEN": "",
                "GRADWIRE_MAX_RUNS": str(runs_cap),
                "GRADWIRE_MAX_NODES_PER_RUN": "16",
                "GRADWIRE_MAX_STORED_BYTES": str(48 << 20),
                "GRADWIRE_CLOSE_RETRY_INITIAL_S": "0.2",
            },
            extra_args=["--admin-token-file", str(token_file)],
        )
        admin = {"Authorization": f"Bearer {admin_token}"}
        with server, httpx.Client(base_url=server.url, timeout=60) as c:
            cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
            rows.append(
                Row(
                    "admin token from --admin-token-file: the server's command line (ps)",
                    "no token in it",
                    "token in cmdline" if admin_token.encode() in cmdline else "not in it",
                    admin_token.encode() not in cmdline,
                )
            )

            base = _metric(c, "gradwire_stored_bytes")
            t0 = time.perf_counter()
            made = []
            tiny = state_to_bytes({"w": torch.zeros(64, 64)})  # each run gets files: a 16 KiB state
            while True:
                r = c.post("/v1/runs", json={}, headers=admin)
                if r.status_code != 201:
                    break
                made.append(r.json()["run_id"])
                c.put(f"/v1/runs/{made[-1]}/state", content=tiny, headers=admin)
            grown = _metric(c, "gradwire_stored_bytes") - base
            runs_dir = Path(tmp) / "data" / "runs"
            rows.append(
                Row(
                    f"create runs until refused (max_runs={runs_cap})",
                    f"{runs_cap} created, then 409 limit_reached naming max_runs",
                    f"{len(made)} created in {time.perf_counter() - t0:.1f} s (+{grown / 1e6:.2f} MB stored), "
                    f"then {_refusal(r)}",
                    len(made) == runs_cap and r.status_code == 409 and "max_runs" in r.json()["detail"],
                )
            )
            t0 = time.perf_counter()
            deleted = sum(c.delete(f"/v1/runs/{run}", headers=admin).status_code == 204 for run in made[1:])
            left = _metric(c, "gradwire_stored_bytes") - base
            dirs = sorted(d.name for d in runs_dir.iterdir())
            rows.append(
                Row(
                    f"delete {len(made) - 1} runs (admin)",
                    "every one 204, their directories gone (the database keeps its freed pages for reuse)",
                    f"{deleted} deleted in "
                    f"{time.perf_counter() - t0:.1f} s, {len(dirs)} run directory left; stored bytes "
                    f"+{left / 1e6:.2f} MB over the start (database and WAL)",
                    deleted == len(made) - 1 and dirs == [made[0]],
                )
            )

            run = made[0]
            tokens = []
            while True:
                r = c.post(f"/v1/runs/{run}/nodes", json={}, headers=admin)
                if r.status_code != 201:
                    break
                tokens.append(r.json()["token"])
            rows.append(
                Row(
                    "register nodes until refused (max_nodes_per_run=16)",
                    "16, then 409 naming max_nodes_per_run",
                    f"{len(tokens)}, then {_refusal(r)}",
                    len(tokens) == 16 and r.status_code == 409 and "max_nodes_per_run" in r.json()["detail"],
                )
            )

            url = f"/v1/runs/{run}"
            before = c.get(url, headers={"Authorization": f"Bearer {tokens[0]}"}).status_code
            revoked = c.delete(f"{url}/nodes/1/token", headers=admin).status_code
            after = c.get(url, headers={"Authorization": f"Bearer {tokens[0]}"})
            deleted_node = c.delete(f"{url}/nodes/2", headers=admin).status_code
            after_delete = c.get(url, headers={"Authorization": f"Bearer {tokens[1]}"}).status_code
            rows.append(
                Row(
                    "revoke node 1's token, delete node 2 (admin)",
                    "200 before; 401 invalid_token at the next request after each",
                    f"before {before}; revoke {revoked}, then {after.status_code} "
                    f"{after.json().get('error')}; delete {deleted_node}, then {after_delete}",
                    before == 200 and revoked == 204 and after.status_code == 401 and after_delete == 401,
                )
            )
            replaced = c.post(f"{url}/nodes/3/token", headers=admin).json()["token"]
            tokens.append(replaced)

            # Stored bytes: a run with a 4 MiB state and updates of 4 MiB until the 48 MiB cap refuses one.
            big = c.post("/v1/runs", json={"quorum": 100}, headers=admin).json()["run_id"]
            shapes = {"w": (1024, 1024)}
            c.put(f"/v1/runs/{big}/state", content=state_to_bytes({"w": torch.zeros(shapes["w"])}), headers=admin)
            accepted, r = 0, None
            for _ in range(20):
                node = c.post(f"/v1/runs/{big}/nodes", json={}, headers=admin)
                if node.status_code != 201:
                    r = node
                    break
                node = node.json()
                frame = IdentityCodec().encode_bundle({"w": torch.ones(shapes["w"])}, round=0, sender=node["node_id"])
                r = c.post(
                    f"/v1/runs/{big}/rounds/0/updates",
                    content=frame,
                    headers={"Authorization": f"Bearer {node['token']}"},
                )
                if r.status_code != 202:
                    break
                accepted += 1
            stored = _metric(c, "gradwire_stored_bytes")
            rows.append(
                Row(
                    "4 MiB updates until refused (max_stored_bytes=48 MiB)",
                    "409 limit_reached naming max_stored_bytes before the cap is passed",
                    f"{accepted} accepted, then "
                    f"{_refusal(r) if r is not None else 'none refused'}; stored {stored / 2**20:.1f} MiB",
                    r is not None
                    and r.status_code == 409
                    and "max_stored_bytes" in r.json()["detail"]
                    and stored <= 48 << 20,
                )
            )

            text = c.get("/metrics").text
            ids = sum(run_id in text for run_id in [run, big])
            rows.append(Row("/metrics (no token) with 2 runs", "no run id", f"{ids} run ids", ids == 0))
            c.delete(f"/v1/runs/{big}", headers=admin)
            rows.append(_always_failing_close(server, c, admin))
        at_rest = b"".join(p.read_bytes() for p in (Path(tmp) / "data").glob("gradwire.sqlite3*"))
        found = sum(t.encode() in at_rest for t in [*tokens, admin_token])
        live = tokens[3:]  # node 1 revoked, node 2 deleted, node 3's first token replaced (the last one)
        hashed = sum(hashlib.sha256(t.encode()).hexdigest().encode() in at_rest for t in live)
        rows.append(
            Row(
                f"grep the database (and its WAL) for {len(tokens) + 1} tokens (nodes' and admin's)",
                "0 found; the live tokens' SHA-256 hashes are there",
                f"{found} found; {hashed} of {len(live)} live tokens' hashes there",
                found == 0 and hashed == len(live),
            )
        )
    return rows


def _always_failing_close(server: LoopbackServer, c: httpx.Client, admin: dict) -> Row:
    import torch

    from gradwire import IdentityCodec

    run = c.post("/v1/runs", json={"optimizer": {"lr": 1e308}}, headers=admin).json()["run_id"]
    c.put(f"/v1/runs/{run}/state", content=state_to_bytes({"w": torch.randn(8, 8)}), headers=admin)
    node = c.post(f"/v1/runs/{run}/nodes", json={}, headers=admin).json()
    before = server.log_path.read_text().count("\n")
    t0 = time.monotonic()
    frame = IdentityCodec().encode_bundle({"w": torch.randn(8, 8)}, round=0, sender=node["node_id"])
    c.post(f"/v1/runs/{run}/rounds/0/updates", content=frame, headers={"Authorization": f"Bearer {node['token']}"})
    while c.get(f"/v1/runs/{run}", headers=admin).json()["status"] != "failed" and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    failed_s = time.monotonic() - t0
    time.sleep(3.0)  # no retry while failed
    status = c.get(f"/v1/runs/{run}", headers=admin).json()
    counted = _metric(c, 'gradwire_runs{status="failed"}')
    server.restart()
    time.sleep(2.0)
    after = c.get(f"/v1/runs/{run}", headers=admin).json()["status"]
    lines = [
        ln
        for ln in server.log_path.read_text().splitlines()[before:]
        if run in ln and ("failed" in ln or "closing" in ln)
    ]
    return Row(
        "a run whose close always fails (optimizer.lr 1e308, 1 node), retries from 0.2 s doubling",
        "failed after 5 attempts with the cause in its status and gradwire_runs; ≤ 3 log lines "
        "(failure, marked failed, status at restart); still failed after a restart, no retry",
        f"failed after {failed_s:.1f} s: {status['status_detail'][:60]}…; gradwire_runs failed {counted:.0f}; "
        f"{len(lines)} log lines; after restart {after}",
        status["status"] == "failed"
        and "5 times" in status["status_detail"]
        and counted >= 1
        and len(lines) <= 3
        and after == "failed",
    )
