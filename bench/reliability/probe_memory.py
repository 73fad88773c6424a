"""Bounded memory (issue 21, item 4): catch-ups streamed in pages, update bodies refused before they are read.

A real server (``python -m gradwire_server``, default settings) and a SparseLoCo run of a small model
(about 263 k parameters, 4 nodes, ``publish: "frames"``: each version holds the round's four node frames, the
heaviest downlink) published for 300 rounds (100 with ``quick``). Then, sampling the server's RSS every
20 ms:

1. **8 concurrent catch-ups** (``GET …/updates?since=0``, each following the pages to the current version
   and reading every byte): the server's RSS growth over its level before them. Before paging (the issue's
   measurement) 8 catch-ups of 207 MiB took it from 562 to 3,357 MiB.
2. **8 stalled 60 MiB uploads to a closed round**: each announces 60 MiB, sends what the socket takes, and
   stalls. Before the cheap checks ran first, they took the server from 591 to 1,071 MiB.

And that what the catch-ups received is exactly the published bytes: one more catch-up through
``GradwireClient.updates`` (pages joined) compared with the version files on disk.
"""

from __future__ import annotations

from gradwire_server.openmp import prefer_passive_openmp

prefer_passive_openmp()

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from bench.reliability.row import Row

import gradwire
from gradwire.client import GradwireClient
from gradwire.frame import write_frame
from gradwire.protocol import LATEST_VERSION_HEADER, VERSION_HEADER
from gradwire.published import read_published
from gradwire_server.launcher import LoopbackServer

torch.set_num_threads(1)

ADMIN = "memory-admin"
#: About 263 k parameters; each node's frame about 260 KB, so a version of 4 frames about 1 MiB.
SHAPES = {"fc1.weight": (512, 256), "fc1.bias": (512,), "fc2.weight": (256, 512), "fc2.bias": (256,)}
CODEC = {"chunk_shape": (64,), "topk": 32}
NODES = 4
CATCH_UPS = 8
STALLED = 8
STALLED_BYTES = 60 << 20
#: The bounds stated in docs/SERVER.md.
CATCH_UP_GROWTH_MIB = 64
STALLED_GROWTH_MIB = 32


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _PeakRss:
    """The server's RSS sampled every 20 ms on a thread while in the ``with`` block: ``peak``."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mib(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> _PeakRss:
        self.peak = _rss_mib(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _publish(server: LoopbackServer, rounds: int) -> tuple[str, list[str], list[str]]:
    """A SparseLoCo run published for ``rounds`` versions; returns its id, the tokens of the nodes that
    trained it, and those of ``STALLED`` more nodes of the run that never submitted."""
    codec = gradwire.DCTCodec(**CODEC)
    with GradwireClient(server.url, ADMIN, timeout=120) as admin:
        run_id = admin.create_run(
            {
                "algorithm": "sparseloco",
                "publish": "frames",
                "quorum": NODES,
                "sparseloco": {"sync_every": 1, "outer_lr": 0.7, "outer_momentum": 0.9},
                "keep_versions": 1000,
            }
        )
        admin.put_state(run_id, {n: torch.zeros(s) for n, s in SHAPES.items()})
        nodes = [admin.register_node(run_id) for _ in range(NODES)]
        # Nodes that never submit: their uploads to a closed round are late, not conflicting.
        late = [admin.register_node(run_id)[1] for _ in range(STALLED)]
    clients = [GradwireClient(server.url, token, timeout=120) for _, token in nodes]
    try:
        # The same records every round (encoding is not what is measured), in a frame for each round.
        records = [[e for e, _ in codec.compress_bundle(_grads(node_id)).values()] for node_id, _ in nodes]
        with ThreadPoolExecutor(NODES) as pool:
            for rnd in range(rounds):
                frames = [
                    write_frame(r, round=rnd, sender=node_id, bundle=True) for r, (node_id, _) in zip(records, nodes)
                ]
                list(pool.map(lambda cf: cf[0].submit(run_id, rnd, cf[1]), zip(clients, frames)))
                clients[0].published(run_id, rnd, wait=60)
    finally:
        for c in clients:
            c.close()
    return run_id, [token for _, token in nodes], late


def _catch_up(url: str, run_id: str, token: str) -> tuple[int, int, int]:
    """Read every page from version 0 as a node would, keeping nothing; returns (bytes, pages, 429s)."""
    total = pages = busy = 0
    since, latest = 0, None
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {token}"}) as c:
        while latest is None or since < latest:
            with c.stream("GET", f"/v1/runs/{run_id}/updates", params={"since": since}) as r:
                if r.status_code == 429:
                    busy += 1
                    r.read()
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                assert r.status_code == 200, r.read()
                for chunk in r.iter_raw(1 << 20):
                    total += len(chunk)
                since, latest = int(r.headers[VERSION_HEADER]), int(r.headers[LATEST_VERSION_HEADER])
                pages += 1
    return total, pages, busy


def _stalled_upload(port: int, path: str, token: str) -> socket.socket:
    """Announce a 60 MiB body, send what the socket takes without blocking, and stall."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {STALLED_BYTES}\r\n\r\n"
        ).encode()
    )
    s.setblocking(False)
    block = b"\0" * (1 << 20)
    try:
        for _ in range(STALLED_BYTES >> 20):
            s.send(block)
    except (BlockingIOError, BrokenPipeError, ConnectionResetError):
        pass
    return s


def probes(quick: bool) -> list[Row]:
    rounds = 100 if quick else 300
    rows: list[Row] = []
    with LoopbackServer(admin_token=ADMIN, ready_timeout_s=120) as server:
        pid = server.process.pid
        t0 = time.perf_counter()
        run_id, tokens, late = _publish(server, rounds)
        publish_s = time.perf_counter() - t0
        diffs = server.data_dir / "runs" / run_id / "diffs"
        files = sorted(diffs.glob("v*.gwf"))
        published = sum(f.stat().st_size for f in files)

        # 1. Eight concurrent catch-ups.
        time.sleep(1.0)
        before = _rss_mib(pid)
        with _PeakRss(pid) as rss, ThreadPoolExecutor(CATCH_UPS) as pool:
            t1 = time.perf_counter()
            results = list(pool.map(lambda i: _catch_up(server.url, run_id, tokens[i % NODES]), range(CATCH_UPS)))
            catch_up_s = time.perf_counter() - t1
        growth = rss.peak - before
        complete = all(n == published for n, _, _ in results)
        rows.append(
            Row(
                f"{CATCH_UPS} concurrent catch-ups (since=0) of a {rounds}-version SparseLoCo run, 263 k parameters, "
                f"{NODES} nodes, publish frames ({published / 2**20:.0f} MiB each)",
                f"server RSS growth ≤ {CATCH_UP_GROWTH_MIB} MiB, every byte delivered "
                "(before: +2,795 MiB for 8 × 207 MiB)",
                f"+{growth:.0f} MiB ({before:.0f} → {rss.peak:.0f} MiB); {sum(p for _, p, _ in results)} pages, "
                f"{sum(b for _, _, b in results)} answered 429 busy and retried; {catch_up_s:.1f} s; "
                f"complete: {'yes' if complete else 'NO'}",
                growth <= CATCH_UP_GROWTH_MIB and complete,
            )
        )

        # The client joins the pages into exactly the published bytes.
        with GradwireClient(server.url, tokens[0], timeout=120) as client:
            batch = client.published(run_id, 0)
        joined = read_published(b"".join(f.read_bytes() for f in files))
        same = (
            batch.nbytes == published
            and len(batch.versions) == rounds
            and all(
                a.version == b.version and a.weights == b.weights and a.nbytes == b.nbytes
                for a, b in zip(batch.versions, joined)
            )
        )
        rows.append(
            Row(
                "GradwireClient.published(since=0) of the same run: pages fetched and joined",
                "every version, the bytes of the version files",
                f"{batch.nbytes / 2**20:.0f} MiB, {len(batch.versions)} versions, "
                f"{'the same' if same else 'DIFFERENT'}",
                same,
            )
        )

        # 2. Eight stalled 60 MiB uploads to a closed round.
        time.sleep(1.0)
        before = _rss_mib(pid)
        path = f"/v1/runs/{run_id}/rounds/0/updates"
        with _PeakRss(pid) as rss:
            socks = [_stalled_upload(server.port, path, late[i]) for i in range(STALLED)]
            time.sleep(3.0)
            answered = 0
            for s in socks:
                s.setblocking(True)
                s.settimeout(5)
                try:
                    answered += s.recv(200).startswith(b"HTTP/1.1 410")
                except OSError:
                    pass
                s.close()
        growth = rss.peak - before
        rows.append(
            Row(
                f"{STALLED} stalled uploads announcing 60 MiB to a closed round",
                f"410 before the body, server RSS growth ≤ {STALLED_GROWTH_MIB} MiB (before: +480 MiB)",
                f"{answered}/{STALLED} answered 410 round_closed; "
                f"+{growth:.0f} MiB ({before:.0f} → {rss.peak:.0f} MiB)",
                answered == STALLED and growth <= STALLED_GROWTH_MIB,
            )
        )
        print(f"    (publishing {rounds} rounds took {publish_s:.0f} s)", flush=True)
    return rows
