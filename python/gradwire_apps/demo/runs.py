"""One distributed run of the demo: a run on the server and one worker process per node.

:func:`run_distributed` creates the run (codecs both ways, AdamW on the server, quorum = every worker),
puts the initial weights, registers the nodes and starts one ``python -m gradwire_apps.demo.worker``
process per node, each on its own shard of the task's data; it follows their JSON-line reports (with a
progress bar) until the run reaches the last version, and returns a :class:`DistributedResult`: loss and
bytes per round, final quality on held-out data, and whether every node's replica hashes to the server's
weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradwire.client import GradwireClient

from ..progress import progress as progress_bar
from .tasks import DigitsTask

__all__ = ["DistributedResult", "codec_spec", "run_distributed"]


def codec_spec(codec: str, **params: Any) -> dict:
    """A codec as the server's RunConfig names it: ``{"codec": name, "params": {...}}``."""
    return {"codec": codec, "params": params}


@dataclass
class DistributedResult:
    """What one distributed run did: per-round loss and bytes, final quality and whether nodes agree."""

    label: str
    run_id: str
    workers: int
    rounds: int  # published versions
    params: int
    losses: list[float] = field(default_factory=list)  # mean training loss over nodes, per (local) step
    up_bytes: list[int] = field(default_factory=list)  # bytes all nodes sent, per step
    down_bytes: list[int] = field(default_factory=list)  # version bytes all nodes received, per step
    test_loss: float = float("nan")
    test_accuracy: float = float("nan")
    server_hash: str = ""
    node_hashes: dict[int, str] = field(default_factory=dict)
    joined: dict[int, int] = field(default_factory=dict)  # node id -> the version it started from
    rounds_missed: int = 0
    state_loads: int = 0
    seconds: float = 0.0  # from the workers' start to the last version: the progress bar's clock
    total_seconds: float = 0.0  # the whole run, worker start-up and the final evaluation included
    title: str = ""  # what was trained

    @property
    def in_sync(self) -> bool:
        """Every node's own replica hashes to the server's weights at the final version."""
        return bool(self.node_hashes) and all(h == self.server_hash for h in self.node_hashes.values())

    @property
    def dense_bytes(self) -> int:
        """What one node's fp32 gradient (or one fp32 update) takes raw."""
        return 4 * self.params

    @property
    def steps(self) -> int:
        """Training steps per node (SparseLoCo: local steps, ``sync_every`` per version)."""
        return len(self.losses)

    def _per_node_step(self, series: Sequence[int]) -> float:
        return sum(series) / max(1, len(series)) / max(1, self.workers)

    @property
    def up_per_node_step(self) -> float:
        return self._per_node_step(self.up_bytes)

    @property
    def down_per_node_step(self) -> float:
        """Bytes of published versions a node received per step (the full-state load at the start, which
        every run makes alike, is not counted)."""
        return self._per_node_step(self.down_bytes)

    #: One version per step for the algorithms that sync every step: the same figures.
    up_per_node_round = up_per_node_step
    down_per_node_round = down_per_node_step

    @property
    def up_ratio(self) -> float:
        """fp32 bytes of the model over the bytes a node sent per step."""
        return self.dense_bytes / max(1.0, self.up_per_node_step)

    @property
    def down_ratio(self) -> float:
        return self.dense_bytes / max(1.0, self.down_per_node_step)

    def final_train_loss(self, last: int = 10) -> float:
        tail = self.losses[-last:]
        return sum(tail) / max(1, len(tail))


class _WorkerEvents:
    """Reads each worker's JSON lines on a thread into one queue; ``None`` marks a closed stdout."""

    def __init__(self, procs: Mapping[int, subprocess.Popen]):
        self.queue: queue.Queue[tuple[int, dict | None]] = queue.Queue()
        for node_id, proc in procs.items():
            threading.Thread(target=self._pump, args=(node_id, proc), daemon=True).start()

    def _pump(self, node_id: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = line.strip()
            if line.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    self.queue.put((node_id, json.loads(line)))
        self.queue.put((node_id, None))


def run_distributed(
    url: str,
    admin_token: str,
    *,
    label: str,
    uplink: Mapping[str, Any],
    downlink: Mapping[str, Any] | None,
    task=None,
    workers: int = 4,
    rounds: int = 100,
    batch_size: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 1e-2,
    aggregation: str = "bounded_mean",  # gradwire.aggregation.DEFAULT_RULE
    seed: int = 0,
    run_config: Mapping[str, Any] | None = None,
    join_at: Mapping[int, int] | None = None,
    log_dir: os.PathLike | str | None = None,
    progress: bool = True,
    timeout: float = 900.0,
) -> DistributedResult:
    """Train ``task`` (default :class:`DigitsTask`) on a running server with ``workers`` worker processes.

    Creates a run (``uplink``/``downlink`` codecs as ``{"codec", "params"}``, ``downlink`` ``None`` for the
    algorithm's default; AdamW with ``lr``, quorum =
    every worker), puts the initial weights (seeded by ``seed``), registers the nodes and starts one
    ``python -m gradwire_apps.demo.worker`` process per node, each on its own shard, until the run reaches version
    ``rounds``. ``join_at`` maps a worker
    index to the version it waits for before joining (a late joiner); ``run_config`` overrides any
    RunConfig field. Raises if a worker fails or the run takes longer than ``timeout`` seconds.
    """
    from safetensors.torch import save_file

    task = task or DigitsTask()
    config: dict[str, Any] = {
        "uplink": dict(uplink),
        "optimizer": {"lr": lr, "weight_decay": weight_decay},
        "aggregation": {"rule": aggregation},
        "quorum": workers,
        "min_updates": 1,
        # Every round waits for all of the demo's own nodes, whatever the machine's load, so the same seed
        # gives the same table; only runs with planned late joiners close a round without them.
        "round_deadline_s": 30.0 if join_at else 3600.0,
    }
    if downlink is not None:  # else the run's algorithm's default downlink
        config["downlink"] = dict(downlink)
    config.update(run_config or {})
    torch.manual_seed(seed)
    model = task.build()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="gradwire-workers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    with GradwireClient(url, admin_token) as admin:
        run_id = admin.create_run(config)
        admin.put_state(run_id, initial)
        nodes = [admin.register_node(run_id, f"{label}-worker-{i}") for i in range(workers)]
        result = DistributedResult(
            label=label, run_id=run_id, workers=workers, rounds=rounds, params=sum(t.numel() for t in initial.values())
        )
        procs: dict[int, subprocess.Popen] = {}
        logs = []
        try:
            for i, ((node_id, token), shard) in enumerate(zip(nodes, task.shards(workers))):
                log = open(log_dir / f"{run_id}-node{node_id}.log", "wb")
                logs.append(log)
                shard_path = log_dir / f"{run_id}-shard{i}.safetensors"
                save_file(shard, str(shard_path))
                procs[node_id] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "gradwire_apps.demo.worker",
                        *task.worker_args(),
                        "--url",
                        url,
                        "--run-id",
                        run_id,
                        "--node-id",
                        str(node_id),
                        "--data",
                        str(shard_path),
                        "--rounds",
                        str(rounds),
                        "--codec",
                        json.dumps(dict(uplink)),
                        "--batch-size",
                        str(batch_size),
                        "--seed",
                        str(seed),
                        "--join-at",
                        str((join_at or {}).get(i, 0)),
                    ],
                    env={**os.environ, "GRADWIRE_TOKEN": token, "OMP_NUM_THREADS": "1"},
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
            _collect(result, procs, log_dir, progress=progress, timeout=timeout)
        finally:
            for proc in procs.values():
                _terminate(proc)
            for log in logs:
                log.close()
        state, _version, result.server_hash = admin.state(run_id)
    final = task.build()
    final.load_state_dict(state, strict=False)
    result.test_loss, result.test_accuracy = task.evaluate(final)
    result.title = task.title
    result.total_seconds = time.perf_counter() - started
    return result


def _collect(
    result: DistributedResult, procs: Mapping[int, subprocess.Popen], log_dir: Path, *, progress: bool, timeout: float
) -> None:
    """Gather the workers' reports into ``result`` while drawing one progress bar step per round."""
    events = _WorkerEvents(procs)
    losses: dict[int, list[float]] = {}
    up: dict[int, int] = {}
    down: dict[int, int] = {}
    open_streams = set(procs)
    deadline = time.monotonic() + timeout
    # On a terminal a bar, in a log a line per tenth (gradwire_apps.progress). Its loss is the training loss
    # (the nodes' mean at the last step every node reported), labelled so: the table shows held-out loss.
    bar_started = time.perf_counter()
    with progress_bar(total=result.rounds, desc=result.label, unit="version", enabled=progress) as bar:
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{result.label}: run {result.run_id} did not finish within {timeout} s")
            try:
                node_id, event = events.queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if event is None:
                open_streams.discard(node_id)
                proc = procs[node_id]
                code = proc.wait(timeout=30)
                if node_id not in result.node_hashes:
                    tail = (log_dir / f"{result.run_id}-node{node_id}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(
                        f"{result.label}: worker of node {node_id} exited with {code} before finishing:\n{tail}"
                    )
                continue
            if event["event"] == "round":
                if not losses:
                    bar.unpause()  # the time left is measured from the first step on, without the start-up
                s = int(event.get("step", event["round"]))
                losses.setdefault(s, []).append(float(event["loss"]))
                up[s] = up.get(s, 0) + int(event["up"])
                down[s] = down.get(s, 0) + int(event["down"])  # the worker's sync() came before its first step
                if len(losses[s]) == result.workers:
                    bar.set_postfix_str(f"train loss {sum(losses[s]) / len(losses[s]):.4f}")
                if event["version"] > bar.n:
                    bar.update(min(result.rounds, event["version"]) - bar.n)
                    if bar.n >= result.rounds and not result.seconds:
                        # The table's seconds are the bar's elapsed time at its last line: one clock.
                        result.seconds = time.perf_counter() - bar_started
            elif event["event"] == "joined":
                result.joined[int(node_id)] = int(event["version"])
            elif event["event"] == "done":
                result.node_hashes[int(node_id)] = event["weights_hash"]
                result.rounds_missed += int(event["rounds_missed"])
                result.state_loads += int(event["state_loads"])
        if not result.seconds:
            result.seconds = time.perf_counter() - bar_started
    for r in sorted(losses):
        result.losses.append(sum(losses[r]) / len(losses[r]))
        result.up_bytes.append(up[r])
        result.down_bytes.append(down[r])


def _terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
