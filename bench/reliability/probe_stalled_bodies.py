"""Stalled uploads (issue 38, item 3): 600 and 1,500 sockets stalled in a request body, with and without a
valid token, against a server at RLIMIT_NOFILE 1024 with its default settings.

Each attacking socket sends a complete header block (``POST /v1/runs``, ``Content-Length: 100000``) and one
byte of body, then nothing, and opens again a second after the server closes it. Without a token the
server answers 401 before the body and closes after its linger; with the admin token the route reads the
body, so these sockets stay until the server makes room for others (``max_connections``: stalled bodies
are closed like sockets stalled in headers; ``max_connections_per_address``: one address cannot take the
whole cap). The attack comes from 8 loopback addresses (127.0.0.2 … 127.0.0.9); the normal clients, from
127.0.0.1, open a new connection for every ``GET /healthz`` and keep one alive for status reads. What must
hold: every normal request answered throughout, p99 ≤ max(1 s, 2 × the p99 without the attack).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

import httpx
from bench.reliability.probe_connections import _limited_python, _percentile
from bench.reliability.row import Row

from gradwire_server.launcher import LoopbackServer

ADMIN = "stalled-admin"
P99_BOUND_S = 1.0
ADDRESSES = [f"127.0.0.{i}" for i in range(2, 10)]
RECONNECT_S = 1.0


async def _stalled(port: int, token: str | None, index: int, stop: asyncio.Event, counts: dict) -> None:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}Content-Length: 100000\r\n\r\n{{"
    ).encode()
    source = ADDRESSES[index % len(ADDRESSES)]
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.5)
            continue
        counts["connects"] += 1
        try:
            writer.write(head)
            while not stop.is_set():
                try:
                    data = await asyncio.wait_for(reader.read(65536), 1.0)
                except asyncio.TimeoutError:
                    continue
                if data == b"":
                    counts["closed"] += 1
                    break
        except (ConnectionError, OSError):
            counts["closed"] += 1
        writer.close()
        await asyncio.sleep(RECONNECT_S)


def _attack_process(port: int, sockets: int, token: str | None, stop, results) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, sockets + 256)), hard))

    async def main() -> dict:
        counts = {"connects": 0, "closed": 0}
        halt = asyncio.Event()
        tasks = [asyncio.create_task(_stalled(port, token, i, halt, counts)) for i in range(sockets)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        halt.set()
        await asyncio.wait(tasks, timeout=5)
        return counts

    results.put(asyncio.run(main()))


def _normal(url: str, seconds: float) -> tuple[list[float], list[str]]:
    latencies: list[float] = []
    failures: list[str] = []
    end = time.monotonic() + seconds
    lock = threading.Lock()

    def timed(fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # every failure is reported, not raised
            with lock:
                failures.append(f"{type(exc).__name__}: {exc}"[:160])
            return
        with lock:
            latencies.append(time.perf_counter() - t0)

    def fresh() -> None:
        while time.monotonic() < end:
            timed(lambda: httpx.get(f"{url}/healthz", timeout=30).raise_for_status())
            time.sleep(0.02)

    def kept() -> None:
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            while time.monotonic() < end:
                timed(lambda: c.get("/readyz").raise_for_status())
                time.sleep(0.02)

    threads = [threading.Thread(target=fresh) for _ in range(2)] + [threading.Thread(target=kept) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 120)
    return latencies, failures


def probes(quick: bool) -> list[Row]:
    seconds = 10.0 if quick else 30.0
    rows: list[Row] = []
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="probe-stalled-") as tmp:
        server = LoopbackServer(
            Path(tmp) / "data", admin_token=ADMIN, python=_limited_python(Path(tmp)), ready_timeout_s=120
        )
        with server:
            pid = server.process.pid
            limit = int(Path(f"/proc/{pid}/limits").read_text().split("Max open files")[1].split()[0])
            base, base_failures = _normal(server.url, seconds / 2)
            b99 = _percentile(base, 0.99)
            bound = max(P99_BOUND_S, 2 * b99)
            for sockets in (600, 1500):
                for token, label in ((None, "no token"), (ADMIN, "a valid (admin) token")):
                    stop, results = ctx.Event(), ctx.Queue()
                    attacker = ctx.Process(target=_attack_process, args=(server.port, sockets, token, stop, results))
                    attacker.start()
                    time.sleep(5.0)  # the process starts and its sockets connect
                    peak = [0]
                    sampling = threading.Event()

                    def sample() -> None:
                        while not sampling.is_set():
                            peak[0] = max(peak[0], len(os.listdir(f"/proc/{pid}/fd")))
                            sampling.wait(0.2)

                    sampler = threading.Thread(target=sample, daemon=True)
                    sampler.start()
                    latencies, failures = _normal(server.url, seconds)
                    sampling.set()
                    sampler.join()
                    stop.set()
                    counts = results.get(timeout=60)
                    attacker.join(timeout=30)
                    p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
                    rows.append(
                        Row(
                            f"{sockets} sockets stalled in a body (POST /v1/runs, Content-Length 100000, "
                            f"1 byte sent; {label}; from {len(ADDRESSES)} loopback addresses, reconnecting "
                            f"{RECONNECT_S:g} s after a close) for {seconds:.0f} s; normal clients: "
                            f"2 new connections per request, 2 kept alive; "
                            f"server at RLIMIT_NOFILE {limit}, default settings",
                            f"every normal request answered; p99 ≤ max({P99_BOUND_S:g} s, 2 × p99 without the attack)",
                            f"without: {len(base)} answered, {len(base_failures)} failed, p99 {b99 * 1000:.0f} ms; "
                            f"with: {len(latencies)} answered, {len(failures)} failed"
                            f"{(' (' + failures[0] + ')') if failures else ''}, p50 {p50 * 1000:.0f} ms, p99 "
                            f"{p99 * 1000:.0f} ms (bound {bound * 1000:.0f} ms); {counts['connects']} attacking "
                            f"connections made, {counts['closed']} closed by the server; peak descriptors {peak[0]}",
                            not failures and not base_failures and bool(latencies) and p99 <= bound and peak[0] < limit,
                        )
                    )
    return rows
