"""Load over time and kill -9 at random moments, in every mode (issue 21, item 8).

Part 1, rounds over time: a real server (``python -m gradwire_server`` on loopback) and one run per mode
(adamw, demo, sparseloco with the re-encoded downlink), 16 nodes submitting DCT frames of an ~82 k-parameter
model concurrently, round after round (1,000 rounds; 150 with ``quick``). Every 10 rounds it samples the
server process's RSS, open descriptors and the data directory's bytes; every request's latency and every
round's close (the quorum's last 202 to the version published, as a long-polling reader sees it) are kept.
What must hold: RSS flat (≤ +10 % from round 100 to the end), descriptors flat, the data directory bounded
once the retained versions (``keep_versions``) are all there, and the p50/p99 of submission and close.

Part 2, kill -9: 8 real :class:`gradwire.client.Node` replicas train a small model per mode while the server
is killed with SIGKILL at random moments (during submissions, closes and long polls alike) and started
again on the same port and data directory. The nodes check the server's weights hash after every version
they apply (the master equals the replay of what was published, or a node raises ``OutOfSyncError``), and
the killed run must end at the same version and weights hash as the same run never killed: an
acknowledged update lost or applied twice would change both.
"""

from __future__ import annotations

# As `python -m gradwire_server` runs, and so the 16 submitting threads don't spin OpenMP pools.
from gradwire_server.openmp import prefer_passive_openmp

prefer_passive_openmp()

import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from bench.reliability.row import Row
from torch import nn

import gradwire
from gradwire.client import GradwireClient, Node
from gradwire.state import state_hash, state_to_bytes
from gradwire_server.launcher import LoopbackServer

torch.set_num_threads(1)

ADMIN = "load-admin"
SHAPES = {"fc1.weight": (256, 256), "fc1.bias": (256,), "fc2.weight": (64, 256), "fc2.bias": (64,)}
DOWNLINK = {"codec": "dct", "params": {"chunk_shape": [64], "topk": 8}}
MODES = {
    "adamw": {"optimizer": {"lr": 0.01}, "downlink": DOWNLINK},
    "demo": {"algorithm": "demo", "demo": {"lr": 3e-3, "beta": 0.9}},
    "sparseloco": {
        "algorithm": "sparseloco",
        "sparseloco": {"sync_every": 1, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
    },
}
NODE_CODEC = {"chunk_shape": [64], "topk": 8, "index_coding": "rice", "value_bits": 2}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _process_sample(pid: int, data_dir: Path) -> tuple[float, int, int]:
    """(RSS in MiB, open descriptors, bytes of the store under the data directory) of the server process."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    # server.log is the launcher's capture of the server's output, which an operator's log rotation bounds.
    disk = sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file() and p.name != "server.log")
    return rss_kib / 1024, fds, disk


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# -- part 1: rounds over time ------------------------------------------------------------------------


def rounds_over_time(mode: str, rounds: int, nodes: int, keep_versions: int) -> dict:
    """Run ``rounds`` rounds of ``nodes`` concurrent submitters; the samples and latencies."""
    codec = gradwire.DCTCodec(chunk_shape=(64,), topk=8)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) * 0.1 for n, s in SHAPES.items()}
    # A pool of gradients, so the submitting threads spend their time on HTTP, not on torch.randn.
    pool = [{n: torch.randn(s, generator=g) * 0.01 for n, s in SHAPES.items()} for _ in range(32)]
    with (
        tempfile.TemporaryDirectory(prefix="gradwire-load-") as tmp,
        LoopbackServer(Path(tmp) / "data", admin_token=ADMIN, ready_timeout_s=120) as srv,
    ):
        admin = _bearer(ADMIN)
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post("/v1/runs", json={**MODES[mode], "quorum": nodes, "keep_versions": keep_versions}, headers=admin)
            r.raise_for_status()
            run_id = r.json()["run_id"]
            tokens = []
            for i in range(nodes):
                r = c.post(f"/v1/runs/{run_id}/nodes", json={"name": f"load-{i}"}, headers=admin)
                r.raise_for_status()
                tokens.append((r.json()["node_id"], r.json()["token"]))
            c.put(f"/v1/runs/{run_id}/state", content=state_to_bytes(state), headers=admin).raise_for_status()
        clients = [httpx.Client(base_url=srv.url, timeout=120, headers=_bearer(tok)) for _, tok in tokens]
        reader = httpx.Client(base_url=srv.url, timeout=120, headers=admin)
        submit_s: list[float] = []
        close_s: list[float] = []
        samples: dict[int, tuple[float, int, int]] = {}
        lock = threading.Lock()

        def submit(i: int, rnd: int) -> float:
            node_id = tokens[i][0]
            frame = codec.encode_bundle(pool[(rnd * nodes + i) % len(pool)], round=rnd, sender=node_id)
            t0 = time.perf_counter()
            response = clients[i].post(f"/v1/runs/{run_id}/rounds/{rnd}/updates", content=frame)
            elapsed = time.perf_counter() - t0
            if response.status_code != 202:
                raise RuntimeError(f"{mode} round {rnd} node {node_id}: {response.status_code} {response.text}")
            with lock:
                submit_s.append(elapsed)
            return time.perf_counter()

        t_start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=nodes) as workers:
            for rnd in range(rounds):
                last_ack = max(workers.map(lambda i: submit(i, rnd), range(nodes)))
                while True:
                    r = reader.get(f"/v1/runs/{run_id}", headers=admin)
                    r.raise_for_status()
                    if r.json()["version"] >= rnd + 1:
                        break
                    r = reader.get(f"/v1/runs/{run_id}/updates", params={"since": rnd, "wait": 30})
                    if r.status_code == 200 and int(r.headers["X-Gradwire-Version"]) >= rnd + 1:
                        break
                close_s.append(time.perf_counter() - last_ack)
                if (rnd + 1) % 10 == 0:
                    samples[rnd + 1] = _process_sample(srv.process.pid, srv.data_dir)
                if (rnd + 1) % 100 == 0:
                    print(
                        f"      {mode}: round {rnd + 1}/{rounds}, RSS {samples[rnd + 1][0]:.0f} MiB, "
                        f"{time.perf_counter() - t_start:.0f} s",
                        flush=True,
                    )
        for client in clients + [reader]:
            client.close()
    return {"submit_s": submit_s, "close_s": close_s, "samples": samples, "seconds": time.perf_counter() - t_start}


def rounds_rows(mode: str, result: dict, rounds: int, nodes: int, keep_versions: int) -> list[Row]:
    samples = result["samples"]
    first = 100 if rounds >= 200 else 50
    rss0, fds0, _ = samples[first]
    rss1, fds1, disk1 = samples[rounds]
    # The data directory once every retained version is there (and one checkpoint interval later).
    steady = min(rounds, max(first, keep_versions + 20) // 10 * 10 + 10)
    disk0 = samples[steady][2]
    growth = rss1 / rss0 - 1
    sub, close = result["submit_s"], result["close_s"]
    what = f"{mode}: {rounds} rounds × {nodes} nodes"
    return [
        Row(
            f"{what}, server RSS round {first} → {rounds}",
            "≤ +10 %",
            f"{rss0:.0f} → {rss1:.0f} MiB ({growth:+.1%})",
            growth <= 0.10,
        ),
        Row(
            f"{what}, open descriptors round {first} → {rounds}",
            "no growth (± 4)",
            f"{fds0} → {fds1}",
            fds1 <= fds0 + 4,
        ),
        Row(
            f"{what}, the store (database, WAL, run files) round {steady} → {rounds} (keep_versions {keep_versions})",
            "≤ +10 %",
            f"{disk0 / 2**20:.1f} → {disk1 / 2**20:.1f} MiB ({disk1 / disk0 - 1:+.1%})",
            disk1 <= 1.10 * disk0,
        ),
        Row(
            f"{what}, submission latency p50 / p99 ({len(sub)} requests, 16 at once)",
            "p99 ≤ 1 s",
            f"{1e3 * statistics.median(sub):.1f} / {1e3 * _percentile(sub, 0.99):.1f} ms",
            _percentile(sub, 0.99) <= 1.0,
        ),
        Row(
            f"{what}, round close p50 / p99 (quorum's last 202 → version seen)",
            "p99 ≤ 1 s",
            f"{1e3 * statistics.median(close):.1f} / {1e3 * _percentile(close, 0.99):.1f} ms",
            _percentile(close, 0.99) <= 1.0,
        ),
    ]


# -- part 2: kill -9 at random moments ----------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _loss(model: nn.Module, node: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * node + step)
    x = torch.randn(32, 16, generator=g)
    return ((model(x) - (x[:, :4] * 0.5 - x[:, 4:8])) ** 2).mean()


def _train_run(url: str, config: dict, nodes: int, steps: int):
    """Start ``nodes`` replicas training ``steps`` steps on threads: (run id, nodes, threads, errors)."""
    admin = GradwireClient(url, ADMIN, retries=30, max_backoff=1.0)
    run_id = admin.create_run({**config, "quorum": nodes})
    admin.put_state(run_id, {n: p.detach() for n, p in _model().named_parameters()})
    replicas = []
    for _ in range(nodes):
        node_id, token = admin.register_node(run_id)
        client = GradwireClient(url, token, retries=30, max_backoff=1.0)
        replicas.append(Node(client, run_id, _model(), gradwire.DCTCodec(**NODE_CODEC), node_id, wait=5))
    errors: list[BaseException] = []

    def train(node: Node) -> None:
        try:
            for step in range(steps):
                node.module.zero_grad()
                _loss(node.module, node.node_id, step).backward()
                node.step()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(n,)) for n in replicas]
    for t in threads:
        t.start()
    return run_id, replicas, threads, errors


def kill_at_random(mode: str, nodes: int, steps: int, kills: int, seed: int) -> list[Row]:
    config = (
        MODES[mode]
        if mode != "sparseloco"
        else {**MODES[mode], "sparseloco": {**MODES[mode]["sparseloco"], "sync_every": 2, "inner": {"lr": 1e-2}}}
    )
    rng = random.Random(seed)
    with (
        tempfile.TemporaryDirectory(prefix="gradwire-kill-") as tmp,
        LoopbackServer(Path(tmp) / "data", admin_token=ADMIN, ready_timeout_s=120) as srv,
    ):
        # The run never killed, for the version and weights hash the killed one must end at.
        ref_id, _, threads, errors = _train_run(srv.url, config, nodes, steps)
        for t in threads:
            t.join(timeout=600)
        if errors:
            raise errors[0]
        admin = GradwireClient(srv.url, ADMIN, retries=30, max_backoff=1.0)
        want = admin.status(ref_id)

        run_id, replicas, threads, errors = _train_run(srv.url, config, nodes, steps)
        done, t0 = 0, time.perf_counter()
        while done < kills and any(t.is_alive() for t in threads):
            time.sleep(rng.uniform(0.1, 1.0))
            if not any(t.is_alive() for t in threads):
                break
            srv.kill()
            srv.start()
            done += 1
        for t in threads:
            t.join(timeout=600)
        got = admin.status(run_id)
        hashes = {state_hash(n.params) for n in replicas}
    what = f"{mode}: {nodes} nodes × {steps} steps, SIGKILL at random moments"
    rows = [
        Row(
            f"{what}: kills while training, then every node finished",
            f"{kills} kills, no error",
            f"{done} kills, " + ("no error" if not errors else f"{type(errors[0]).__name__}: {errors[0]}"),
            done == kills and not errors,
        )
    ]
    rows.append(
        Row(
            f"{what}: version and weights hash vs the run never killed",
            "the same (no acknowledged update lost or applied twice)",
            f"version {got['version']} vs {want['version']}, hash "
            f"{'equal' if got['weights_hash'] == want['weights_hash'] else 'DIFFERENT'}",
            got["version"] == want["version"] and got["weights_hash"] == want["weights_hash"],
        )
    )
    rows.append(
        Row(
            f"{what}: every node's replica (checked against the server after each version)",
            "the server's weights, bit for bit",
            f"{len(hashes)} distinct hash(es), "
            f"{'= server' if hashes == {got['weights_hash']} else '≠ server'}; {time.perf_counter() - t0:.0f} s",
            hashes == {got["weights_hash"]},
        )
    )
    return rows


def probes(quick: bool) -> list[Row]:
    rounds, nodes, keep = (150, 16, 50) if quick else (1000, 16, 200)
    kills, steps = (3, 60) if quick else (10, 200)
    rows: list[Row] = []
    for mode in MODES:
        print(f"    {mode}: {rounds} rounds × {nodes} nodes ...", flush=True)
        result = rounds_over_time(mode, rounds, nodes, keep)
        rows += rounds_rows(mode, result, rounds, nodes, keep)
    for i, mode in enumerate(MODES):
        print(f"    {mode}: kill -9 × {kills} ...", flush=True)
        rows += kill_at_random(mode, nodes=8, steps=steps, kills=kills, seed=i)
    return rows
