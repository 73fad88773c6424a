"""A real torchft Lighthouse on loopback and replica groups as processes (bench/replica_group_worker.py), for
bench/elastic.py and the fault-tolerant tests: start, restart, stop at a step, read each group's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("replica_group_worker.py")

#: Short timeouts that keep every ReplicaTimeouts rule on a loaded CPU.
FAST_TIMEOUTS = dict(
    heartbeat_interval=0.1,
    heartbeat_timeout=1.0,
    quorum_tick=0.05,
    join=6.0,
    quorum=30.0,
    connect=10.0,
    process_group=8.0,
    operation=15.0,
    state_download=5.0,
)


class ReplicaGroups:
    """Groups ``g0``.. of one run under a Lighthouse started here; logs and the stop file under ``folder``."""

    def __init__(self, folder: Path, groups: int, worker: Path = WORKER, **common):
        from torchft.coordination import LighthouseServer

        t = FAST_TIMEOUTS
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=round(t["join"] * 1000),
            quorum_tick_ms=round(t["quorum_tick"] * 1000),
            heartbeat_timeout_ms=round(t["heartbeat_timeout"] * 1000),
        )
        self.address = "http://127.0.0.1:" + self.lighthouse.address().rsplit(":", 1)[1]
        self.folder = Path(folder)
        self.groups = groups
        self.worker = Path(worker)  # replica_group_worker.py, or diloco_group_worker.py (torchft's DiLoCo)
        self.common = dict(timeouts=t, groups=groups, **common)
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, list[float]] = {}

    def start(self, name: str, process: str | None = None, **options) -> None:
        """Start group ``name`` as a process (``process``: its key here, default the name; a standby of a group
        that still runs is a second process of the same name)."""
        cfg = dict(
            self.common | {k: v for k, v in options.items() if k in self.common},
            lighthouse=self.address,
            replica_id=name,
            log=str(self.folder / f"{name}.jsonl"),
            stop=str(self.folder / "stop"),
            seed=int(name[1:]),
            **{k: v for k, v in options.items() if k not in self.common},
        )
        err = open(self.folder / f"{name}.err", "a")
        key = process or name
        self.procs[key] = subprocess.Popen([sys.executable, str(self.worker), json.dumps(cfg)], stdout=err, stderr=err)
        self.started.setdefault(key, []).append(time.time())

    def rows(self, name: str) -> list[dict]:
        try:
            lines = (self.folder / f"{name}.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [r for r in map(json.loads, lines) if "hash" in r and "final" not in r]

    def events(self, name: str) -> list[dict]:
        """Every line of ``name``'s log: its commits, and its ``ready``, ``died`` and ``final`` lines."""
        try:
            return [json.loads(line) for line in (self.folder / f"{name}.jsonl").read_text().splitlines()]
        except OSError:
            return []

    def wait_for(self, what, seconds: float, why: str):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out after {seconds} s waiting for {why}; logs: {self.tails()}")

    def exit_code(self, name: str, seconds: float) -> int:
        try:
            return self.procs[name].wait(timeout=seconds)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{name} still runs after {seconds} s; logs: {self.tails()}") from exc

    def stop_at(self, step: int) -> None:
        tmp = self.folder / "stop.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, self.folder / "stop")

    def tails(self) -> str:
        out = []
        for name in sorted({key.split("-")[0] for key in self.procs}):
            err = (self.folder / f"{name}.err").read_text(errors="replace").splitlines()
            lines = [line for line in err if "INFO" not in line][-6:]
            out.append(f"{name}: rows={len(self.rows(name))} err: " + " | ".join(lines))
        return "\n".join(out)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        self.lighthouse.shutdown()
