"""A full disk, for real: a server whose data directory is a small tmpfs that is filled to the last block.

Measured: what every write answers (a JSON 507, never a plain-text 500), /readyz while full, the log lines a
round close that keeps failing writes per minute, and the recovery when space returns (readiness, the
round published, the weights hash of the served state and of a restart). Mounting needs root: without it
the area reports one row saying so.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from bench.reliability.row import Row

from gradwire.state import state_from_bytes, state_hash, state_to_bytes
from gradwire_server.launcher import LoopbackServer

ADMIN = "probe-disk-admin"


def _fill(path: Path) -> None:
    block = bytes(1 << 20)
    with open(path, "wb", buffering=0) as f:
        for size in (len(block), 4096):
            with contextlib.suppress(OSError):
                while True:
                    f.write(block[:size])


def _wait(condition, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if condition():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _json_507(r: httpx.Response) -> bool:
    return (
        r.status_code == 507
        and r.headers.get("content-type", "").startswith("application/json")
        and r.json().get("error") == "insufficient_storage"
    )


def _metric(c: httpx.Client, key: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def _describe(r: httpx.Response) -> str:
    kind = "JSON" if r.headers.get("content-type", "").startswith("application/json") else "plain"
    return f"{r.status_code} {kind} {r.json().get('error', '') if kind == 'JSON' else ''}".strip()


def probes(quick: bool) -> list[Row]:
    if os.geteuid() != 0:
        return [
            Row(
                "full tmpfs data directory",
                "507 JSON, readiness 503, recovery",
                "not measured: needs root to mount a tmpfs (run make reliability as root)",
                False,
            )
        ]
    with tempfile.TemporaryDirectory(prefix="probe-disk-") as tmp:
        mnt = Path(tmp) / "fs"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
        try:
            return _probe(mnt, Path(tmp) / "server.log", failing_s=10.0 if quick else 60.0)
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def _probe(mnt: Path, log_path: Path, failing_s: float) -> list[Row]:
    import torch

    from gradwire import IdentityCodec

    rows: list[Row] = []
    server = LoopbackServer(
        mnt / "data",
        admin_token=ADMIN,
        log_path=log_path,
        env={"GRADWIRE_CLOSE_RETRY_INITIAL_S": "1", "GRADWIRE_CLOSE_RETRY_MAX_S": "30"},
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    shapes = {"w": (256, 256), "b": (256,)}
    state = {n: torch.randn(s) for n, s in shapes.items()}
    with server, httpx.Client(base_url=server.url, timeout=60) as c:
        run = c.post("/v1/runs", json={"quorum": 3, "min_updates": 2, "round_deadline_s": 2.0}, headers=admin).json()[
            "run_id"
        ]
        assert c.put(f"/v1/runs/{run}/state", content=state_to_bytes(state), headers=admin).status_code == 200
        nodes = [c.post(f"/v1/runs/{run}/nodes", json={}, headers=admin).json() for _ in range(2)]

        def submit(i: int) -> httpx.Response:
            node = nodes[i]
            frame = IdentityCodec().encode_bundle(
                {n: torch.randn(s) * 1e-3 for n, s in shapes.items()}, round=0, sender=node["node_id"]
            )
            return c.post(
                f"/v1/runs/{run}/rounds/0/updates", content=frame, headers={"Authorization": f"Bearer {node['token']}"}
            )

        assert submit(0).status_code == 202
        filler = mnt / "filler"
        _fill(filler)
        answers = {"update": submit(1)}
        answers["run creation"] = created = c.post("/v1/runs", json={}, headers=admin)
        answers["node registration"] = c.post(f"/v1/runs/{run}/nodes", json={}, headers=admin)
        if created.status_code == 201:
            answers["initial state"] = c.put(
                f"/v1/runs/{created.json()['run_id']}/state", content=state_to_bytes(state), headers=admin
            )
        rows.append(
            Row(
                "16 MiB tmpfs filled: an update (64 KiB frame)",
                "507 JSON insufficient_storage",
                _describe(answers["update"]),
                _json_507(answers["update"]),
            )
        )
        others = {k: r for k, r in answers.items() if k != "update"}
        rows.append(
            Row(
                "full tmpfs: " + ", ".join(others),
                "each 2xx (it fit) or 507 JSON; no 5xx plain text",
                "; ".join(f"{k} {_describe(r)}" for k, r in others.items()),
                all(r.status_code < 300 or _json_507(r) for r in others.values()),
            )
        )
        ready = c.get("/readyz")
        rows.append(
            Row(
                "full tmpfs: /readyz",
                "503 storage_failing",
                _describe(ready) + f" {ready.json().get('status')}",
                ready.status_code == 503 and ready.json().get("status") == "storage_failing",
            )
        )
        # Space for the update, not for the close: the round closes at its deadline onto a full disk.
        os.unlink(filler)
        _wait(lambda: c.get("/readyz").status_code == 200, 10)
        assert submit(1).status_code == 202
        _fill(filler)
        log_before = log_path.read_text().count("\n")
        time.sleep(failing_s)
        lines = log_path.read_text().splitlines()[log_before:]
        attempts = _metric(c, 'gradwire_round_close_failures_total{cause="storage"}')
        failures = [ln for ln in lines if "closing round" in ln]
        rows.append(
            Row(
                f"round close failing on a full disk for {failing_s:.0f} s (retries 1 s doubling to 30 s)",
                "one log line per change (≤ 2: the store's cause, the close's), no traceback",
                f"{attempts:.0f} failed closes, {len(lines)} log lines ({len(failures)} about the close, "
                f"{len(lines) * 60.0 / failing_s:.0f}/min), tracebacks {sum('Traceback' in ln for ln in lines)}",
                len(lines) <= 2 and len(failures) <= 1 and not any("Traceback" in ln for ln in lines),
            )
        )
        t_free = time.monotonic()
        os.unlink(filler)
        ready_s = _wait(lambda: c.get("/readyz").status_code == 200, 30)
        published = c.get(f"/v1/runs/{run}/updates", params={"since": 0, "wait": 40}, headers=admin)
        close_s = time.monotonic() - t_free
        r = c.get(f"/v1/runs/{run}/state", headers=admin)
        served = r.headers.get("X-Gradwire-Weights-Hash")
        intact = state_hash(state_from_bytes(r.content)) == served
        server.restart()
        after = c.get(f"/v1/runs/{run}", headers=admin).json()
        rows.append(
            Row(
                "space returns",
                "ready within 2 s, the round published within 35 s (the backoff cap), "
                "weights hash of the served state and after a restart intact",
                f"ready after {ready_s if ready_s is None else round(ready_s, 2)} s, version "
                f"{published.headers.get('X-Gradwire-Version')} after {close_s:.1f} s, hash "
                f"{'intact' if intact else 'WRONG'}, after restart version {after['version']} "
                f"{'same hash' if after['weights_hash'] == served else 'OTHER HASH'}",
                ready_s is not None
                and ready_s <= 2
                and published.headers.get("X-Gradwire-Version") == "1"
                and close_s <= 35
                and intact
                and after["weights_hash"] == served
                and after["version"] == 1,
            )
        )
    log = log_path.read_text()
    rows.append(
        Row(
            "server log over the whole probe",
            "no 'cannot rollback', no traceback",
            f"{log.count('cannot rollback')} 'cannot rollback', {log.count('Traceback')} tracebacks, "
            f"'storage cannot write' {log.count('storage cannot write')}x",
            "cannot rollback" not in log and "Traceback" not in log,
        )
    )
    return rows
