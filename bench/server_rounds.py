"""Aggregation-server cost per round, and frame submission under concurrent load, measured in one run.

Part 1, in-process (the server's own round logic driven directly with pre-encoded frames; times are
wall clock, CPU is ``time.process_time`` of this process, all threads): N simulated nodes submit one
frame each of a ~10 M-parameter model. Per N it reports

- validate: checking all N frames as the server does on arrival (CRC, structure, shapes, norm);
- aggregate: the mean of the N updates — DCT frames summed in the transform domain (one inverse
  transform per tensor), the same DCT frames decoded per node (DenseAccumulator), and dense fp32
  (identity) frames;
- close round: aggregate + AdamW + downlink DCT encode with error feedback + apply + durable publish
  (four fsynced files and a SQLite commit) — what stands between the quorum and the new version.

Part 2, over HTTP: a real uvicorn on 127.0.0.1 (``python -m gradwire_server``); nodes submit DCT frames
concurrently (a bounded number of requests, a quorum never reached, so every request is a validated,
fsynced, committed submission). Reports requests/s, p50/p99 latency and the server process's CPU.

Part 3, round close against torch.optim.AdamW (issue 10's target: ≤ 10× one AdamW step): for each
parameter count and node count, the server's close path (``RoundEngine.close_and_publish``: aggregate,
AdamW, downlink encode, apply, weights hash, durable publish of the frame) timed part by part, as a ratio
to one ``torch.optim.AdamW(params).step()`` on the same parameters with the same torch threads, measured
in the same run (fastest of --repeat, interleaved), for the adamw, demo and sparseloco modes; beside it the
checkpoint written every ``checkpoint_every`` versions (off the close path). Over HTTP: from the quorum's
last 202 to the published version, against the same AdamW step.

Part 4, submissions against a bare FastAPI app: distinct nodes posting the same DCT frames at concurrency
32 to the server (adamw and demo runs) and to an echo app that only reads the body and answers 202, in
one run: accepted/s as a ratio (target ≥ 0.5×).

Part 3's default grid is bench/close_vs_adamw.py's: round time against parameters (10, 40, 100 M at 4
nodes) and against nodes (4, 16, 64 at 10 M); ``--big`` uses 40 M × 4, 16, 64 and 100 M × 4, 16 (100 M ×
64 nodes is left out: 64 parsed frames of 100 M parameters plus the state outgrow a 24 GiB machine's
comfort and take minutes per repeat). ``--close-grid 10e6:4,16 100e6:4`` sets it explicitly. Parts 3
and 4 also run on their own: ``python bench/close_vs_adamw.py``, ``python bench/submit_vs_echo.py``.

Usage: python bench/server_rounds.py [--params 10000000] [--nodes 4 16 64] [--requests 256] [--big]
       [--skip-in-process] [--skip-http] [--skip-close] [--skip-submit]
"""

from __future__ import annotations

# As `python -m gradwire_server` runs: OpenMP workers that sleep when idle (gradwire_server.openmp).
from gradwire_server.openmp import prefer_passive_openmp

prefer_passive_openmp()

import argparse
import asyncio
import dataclasses
import gc
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

import gradwire
from gradwire.frame import read_frame, write_frame
from gradwire_server.aggregate import Update, aggregate
from gradwire_server.config import RunConfig
from gradwire_server.launcher import LoopbackServer
from gradwire_server.metrics import Metrics
from gradwire_server.rounds import RoundEngine, RunRuntime
from gradwire_server.settings import ServerSettings
from gradwire_server.store import Store
from gradwire_server.transition import RunState
from gradwire_server.validate import validate_update

console = Console(width=200)  # wide tables stay readable in a log


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """A transformer-ish set of tensors totalling exactly ``params`` elements: blocks of a 4096×1024
    projection and its biases, then the rest as a 2-D head of 1024 columns and a vector of what is left.

    (The rest used to be one vector: at 10 M parameters 1.6 M elements, in the 64-element chunks a vector
    gets, which a tile-mode codec sends far denser than any weight matrix — no model has such a vector.)"""
    d = 1024
    per_layer = 4 * d * d + 2 * d  # a square projection block and its biases
    layers = max(1, params // per_layer)
    shapes = {}
    for i in range(layers):
        shapes[f"layer{i}.qkvo"] = (4 * d, d)
        shapes[f"layer{i}.bias"] = (2 * d,)
    rest = params - layers * per_layer
    if rest >= d:
        shapes["head"] = (rest // d, d)
    if rest % d:
        shapes["head_bias"] = (rest % d,)
    return shapes


def frames_for(shapes, codec, nodes: int, distinct: int = 4) -> list[bytes]:
    """``nodes`` bundle frames (sender i+1): ``distinct`` real encodings, each sender's records its own
    (:func:`distinct_records`: a copy of another sender's records would count once, and cost nothing)."""
    base = []
    for s in range(distinct):
        g = torch.Generator().manual_seed(s)
        grads = {n: torch.randn(sh, generator=g) * 1e-3 for n, sh in shapes.items()}
        base.append(read_frame(codec.encode_bundle(grads, round=0, sender=1)).entries)
    return [
        write_frame(distinct_records(base[i % distinct], i), round=0, sender=i + 1, bundle=True) for i in range(nodes)
    ]


def distinct_records(entries, i: int):
    """``entries`` with every DCT record's per-chunk scales multiplied by ``1 + i/1024`` (another record of
    the same positions, a slightly larger update): node ``i``'s own records at the cost of no encode."""
    out = []
    for e in entries:
        if "scale" in e.sections and i:
            sections = dict(e.sections)
            sections["scale"] = (sections["scale"] * np.float32(1.0 + i / 1024)).astype(sections["scale"].dtype)
            e = dataclasses.replace(e, sections=sections)
        out.append(e)
    return out


REPEAT = 3


def dense_decode_mean(updates: list[Update], names: list[str]) -> dict[str, torch.Tensor]:
    """The baseline the server's domain sum is compared with: decode every record densely, then average."""
    out = {}
    for name in names:
        total = None
        for u in updates:
            t = gradwire.decode_entry(u.entries()[name]).to(torch.float32) * (1.0 / len(updates))
            total = t if total is None else total.add_(t)
        out[name] = total
    return out


def timed(fn, repeat=None):
    """``(result, wall, cpu)`` of the fastest of ``repeat`` runs (the machine is shared: the minimum is
    the least disturbed measurement)."""
    best = None
    for _ in range(repeat or REPEAT):
        gc.collect()
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if best is None or wall < best[1]:
            best = (out, wall, cpu)
    return best


def in_process(params: int, node_counts: list[int], dense_max_nodes: int) -> None:
    shapes = model_shapes(params)
    total = sum(math.prod(s) for s in shapes.values())
    dct = gradwire.DCTCodec(chunk_shape=(64, 64), topk=32)
    master = {n: torch.randn(s) * 0.02 for n, s in shapes.items()}
    spec = {n: tuple(t.shape) for n, t in master.items()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp)
        engine = RoundEngine(store, Metrics(lambda: 0.0), ServerSettings(data_dir=Path(tmp)))

        def runtime():
            # A fresh run per N: each publishes its own version 1.
            run_id = store.create_run(RunConfig().model_dump(mode="json"))
            return RunRuntime(
                run_id=run_id,
                config=RunConfig(),
                state=RunState.load(
                    RunConfig(), 0, {n: t.clone() for n, t in master.items()}, None, {}, torch.device("cpu")
                ),
            )

        def aggregate_round(rt, ups):
            agg = rt.config.aggregation
            return aggregate(ups, sorted(rt.spec), agg.rule, agg.trim_fraction)

        max_dct = max(node_counts)
        dct_frames = frames_for(shapes, dct, max_dct)
        # Warm-up (DCT bases, allocator) so the first row is not charged for it.
        warm = [Update(fr, 1.0, 1.0, 1) for fr in (read_frame(f) for f in dct_frames[:2])]
        aggregate_round(runtime(), warm)
        del warm
        for n in track(node_counts, description="in-process rounds", console=console):
            frames = dct_frames[:n]
            parsed, t_val, c_val = timed(
                lambda: [
                    validate_update(f, spec, node_id=i + 1, round=0, max_frame_bytes=1 << 31, max_update_norm=None)
                    for i, f in enumerate(frames)
                ]
            )
            ups = [Update(fr, 1.0, norm, i + 1) for i, (fr, norm) in enumerate(parsed)]
            rt = runtime()
            grads, t_dom, c_dom = timed(lambda: aggregate_round(rt, ups))
            _, t_close, c_close = timed(lambda: engine.close_and_publish(runtime(), ups))
            t_pub, c_pub = max(0.0, t_close - t_dom), max(0.0, c_close - c_dom)
            _, t_node, c_node = timed(lambda: dense_decode_mean(ups, sorted(rt.spec)))
            dense = None
            if n <= dense_max_nodes:
                ident = frames_for(shapes, gradwire.IdentityCodec(), n, distinct=1)
                dparsed, _, _ = timed(
                    repeat=1,
                    fn=lambda: [
                        validate_update(f, spec, node_id=i + 1, round=0, max_frame_bytes=1 << 31, max_update_norm=None)
                        for i, f in enumerate(ident)
                    ],
                )
                dups = [Update(fr, 1.0, norm, i + 1) for i, (fr, norm) in enumerate(dparsed)]
                _, t_dense, c_dense = timed(lambda: aggregate_round(rt, dups))
                dense = (t_dense, c_dense, len(ident[0]))
                del ident, dparsed, dups
            rows.append(
                dict(
                    n=n,
                    frame=len(frames[0]),
                    t_val=t_val,
                    c_val=c_val,
                    t_dom=t_dom,
                    c_dom=c_dom,
                    t_node=t_node,
                    c_node=c_node,
                    t_pub=t_pub,
                    c_pub=c_pub,
                    dense=dense,
                )
            )
            ups = parsed = None  # frees both; the lambdas above still close over the names
        store.close()

    table = Table(
        title=f"One round of N nodes, {total / 1e6:.1f} M parameters ({len(shapes)} tensors), "
        f"DCT 64×64 top-32 frames of {rows[0]['frame'] / 1e3:.0f} kB (fp32: {4 * total / 1e6:.0f} MB)",
        caption="in-process: the server's round logic on pre-encoded frames; fastest of --repeat runs; "
        "CPU = process_time (all "
        f"threads, {torch.get_num_threads()} torch threads). close round = aggregate (DCT domain) + "
        "AdamW + downlink encode + apply + hash + fsynced frame and commit. Dense fp32 measured up to "
        f"{dense_max_nodes} nodes (each node's frame is {4 * total / 1e6:.0f} MB).",
    )
    for col in (
        "nodes",
        "validate all (s)",
        "aggregate: DCT domain (s)",
        "aggregate: per-node decode (s)",
        "domain gain",
        "aggregate: fp32 frames (s)",
        "close round (s)",
        "close CPU (s)",
        "vs 4 nodes",
    ):
        table.add_column(col, justify="right")
    base = None
    for r in rows:
        close = r["t_dom"] + r["t_pub"]
        base = base or close
        table.add_row(
            str(r["n"]),
            f"{r['t_val']:.2f}",
            f"{r['t_dom']:.3f}",
            f"{r['t_node']:.3f}",
            f"{r['t_node'] / r['t_dom']:.1f}×",
            "—" if r["dense"] is None else f"{r['dense'][0]:.3f}",
            f"{close:.2f}",
            f"{r['c_dom'] + r['c_pub']:.2f}",
            f"{close / base:.2f}×",
        )
    console.print(table)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _submit_all(url, run_id, nodes, frames, concurrency):
    sem = asyncio.Semaphore(concurrency)
    latencies = []
    statuses = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(node, frame):
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(
                    f"/v1/runs/{run_id}/rounds/0/updates",
                    content=frame,
                    headers={"Authorization": f"Bearer {node['token']}"},
                )
                latencies.append(time.perf_counter() - t0)
                statuses.append(r.status_code)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(n, f) for n, f in zip(nodes, frames)))
        return time.perf_counter() - t0, latencies, statuses


def over_http(params: int, requests: int, concurrencies: list[int]) -> None:
    from gradwire.state import state_to_bytes

    shapes = model_shapes(params)
    dct = gradwire.DCTCodec(chunk_shape=(64, 64), topk=32)
    table = Table(
        title=f"Submitting DCT frames over HTTP to uvicorn on 127.0.0.1 ({requests} requests per row, "
        f"{sum(math.prod(s) for s in shapes.values()) / 1e6:.1f} M-parameter model)",
        caption="each request: read body, CRC + structure + shapes + norm check, fsync'd file, SQLite "
        "commit, 202. Client and server share the machine's cores.",
    )
    for col in (
        "concurrency",
        "frame (kB)",
        "requests/s",
        "p50 (ms)",
        "p99 (ms)",
        "server CPU / request (ms)",
        "all 202",
    ):
        table.add_column(col, justify="right")
    state = state_to_bytes({n: torch.zeros(s) for n, s in shapes.items()})
    for conc in concurrencies:
        with tempfile.TemporaryDirectory() as tmp, LoopbackServer(Path(tmp) / "data") as srv:
            admin = srv.admin_headers()
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                run_id = c.post(
                    "/v1/runs",
                    json={"quorum": requests + 1, "round_deadline_s": 3600, "min_updates": requests + 1},
                    headers=admin,
                ).json()["run_id"]
                nodes = [c.post(f"/v1/runs/{run_id}/nodes", json={}, headers=admin).json() for _ in range(requests)]
                assert c.put(f"/v1/runs/{run_id}/state", content=state, headers=admin).status_code == 200
            frames = frames_for(shapes, dct, requests, distinct=2)
            cpu0 = _cpu_seconds(srv.process.pid)
            wall, lat, statuses = asyncio.run(_submit_all(srv.url, run_id, nodes, frames, conc))
            cpu = _cpu_seconds(srv.process.pid) - cpu0
            lat.sort()
            p99 = lat[min(len(lat) - 1, int(math.ceil(0.99 * len(lat))) - 1)]
            table.add_row(
                str(conc),
                f"{len(frames[0]) / 1e3:.0f}",
                f"{len(lat) / wall:.1f}",
                f"{1e3 * statistics.median(lat):.1f}",
                f"{1e3 * p99:.1f}",
                f"{1e3 * cpu / len(lat):.1f}",
                "yes" if all(s == 202 for s in statuses) else f"no: {sorted(set(statuses))}",
            )
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--dense-max-nodes", type=int, default=64, help="largest N for the fp32-frame baseline")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--http-params", type=int, default=10_000_000)
    ap.add_argument("--skip-in-process", action="store_true", help="skip part 1")
    ap.add_argument("--skip-http", action="store_true", help="skip part 2")
    ap.add_argument("--skip-close", action="store_true", help="skip part 3")
    ap.add_argument("--skip-submit", action="store_true", help="skip part 4")
    ap.add_argument("--big", action="store_true", help="part 3 at 40 M × 4, 16, 64 and 100 M × 4, 16 nodes too")
    ap.add_argument(
        "--close-grid", nargs="+", default=None, metavar="PARAMS:N,N", help="part 3's grid, e.g. 10e6:4,16,64 40e6:4"
    )
    ap.add_argument(
        "--modes", nargs="+", default=["adamw", "demo", "sparseloco"], choices=["adamw", "demo", "sparseloco"]
    )
    ap.add_argument(
        "--average-max-params",
        type=float,
        default=10e6,
        help="demo/sparseloco rows only up to this many parameters (their close decodes every node's "
        "frame exactly: slow until gradwire.dct.decode_levels is)",
    )
    ap.add_argument("--average-max-nodes", type=int, default=4, help="demo/sparseloco rows only up to this many nodes")
    ap.add_argument("--http-close-rounds", type=int, default=3)
    ap.add_argument("--submit-requests", type=int, default=192)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is reported")
    args = ap.parse_args()
    global REPEAT
    REPEAT = args.repeat
    if not args.skip_in_process:
        in_process(args.params, sorted(args.nodes), args.dense_max_nodes)
    if not args.skip_http:
        over_http(args.http_params, args.requests, args.concurrency)
    if not args.skip_close:
        from close_vs_adamw import BIG_GRID, DEFAULT_GRID, close_table, http_close_table, parse_grid

        grid = parse_grid(args.close_grid or (BIG_GRID if args.big else DEFAULT_GRID))
        close_table(console, grid, args.modes, args.average_max_params, args.average_max_nodes, REPEAT)
        http_close_table(console, args.http_params, args.http_close_rounds)
    if not args.skip_submit:
        from submit_vs_echo import submit_table

        submit_table(console, args.http_params, args.submit_requests, 32)


if __name__ == "__main__":
    main()
