"""Part 3 of bench/server_rounds.py: closing a round as a ratio to one torch.optim.AdamW step on the same
parameters (same process, same torch threads), part by part, in process and over HTTP.

Standalone: python bench/close_vs_adamw.py [--grid 10e6:4,16,64 40e6:4 100e6:4] [--big] [--repeat 3]
Default grid: round time against parameters (10, 40, 100 M at 4 nodes) and against nodes (4, 16, 64 at 10 M);
--big adds 40 M × 16, 64 and 100 M × 16 (100 M × 64 nodes needs more memory than a 24 GiB machine has).
"""

from __future__ import annotations

# As `python -m gradwire_server` runs: OpenMP workers that sleep when idle (gradwire_server.openmp).
# Set OMP_WAIT_POLICY=ACTIVE (or any policy) in the environment to measure another.
from gradwire_server.openmp import prefer_passive_openmp

OMP_POLICY = prefer_passive_openmp()

import argparse
import gc
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch
from rich.progress import Progress
from rich.table import Table

import gradwire
import server_rounds as sr
from gradwire.frame import read_frame
from gradwire.state import state_to_bytes
from gradwire_server.aggregate import Update
from gradwire_server.config import RunConfig
from gradwire_server.launcher import LoopbackServer
from gradwire_server.metrics import Metrics
from gradwire_server.rounds import RoundEngine, RunRuntime
from gradwire_server.settings import ServerSettings
from gradwire_server.store import Store
from gradwire_server.transition import RunState

#: Round time against parameter count (4 nodes) and against node count (10 M parameters).
DEFAULT_GRID = ["10e6:4,16,64", "40e6:4", "100e6:4"]
BIG_GRID = ["10e6:4,16,64", "40e6:4,16,64", "100e6:4,16"]

MODES = {
    "adamw": {},
    "demo": {"algorithm": "demo"},
    "sparseloco": {"algorithm": "sparseloco", "sparseloco": {"outer_momentum": 0.9, "nesterov": True}},
}


#: ``--node-frames run``: what a node of each mode sends by default (AdamW runs: the server's 64×64 top-32
#: uplink; DeMo and SparseLoCo: their algorithm's 64×64-tile codec, which the downlink re-encodes in the
#: coefficient domain). ``--node-frames flat``: the 64×64 top-32 flat-chunk DCT for every mode (as measured
#: before; the re-encoding then runs in parameter space, its chunks being the downlink's tiles).
FLAT_NODE_CODEC = {"chunk_shape": [64, 64], "topk": 32}


NODE_FRAMES_CAPTION = {
    "run": "each mode's default node codec (adamw: DCT 64×64 top-32; demo, sparseloco: their 64×64-tile DCT, "
    "re-encoded in the coefficient domain)",
    "flat": "DCT 64×64 top-32 flat chunks for every mode",
}


def node_codec(mode: str, node_frames: str) -> gradwire.DCTCodec:
    """The codec the bench's nodes encode with for ``mode`` (``--node-frames``)."""
    if node_frames == "flat" or mode == "adamw":
        return gradwire.DCTCodec(**FLAT_NODE_CODEC)
    from gradwire.algorithms.demo import demo_codec_params
    from gradwire.algorithms.sparseloco import sparseloco_codec_params

    params = (
        demo_codec_params()
        if mode == "demo"
        else sparseloco_codec_params(RunConfig.model_validate(MODES[mode]).sparseloco.sync_every)
    )
    return gradwire.DCTCodec(**params)


def parse_grid(items: list[str]) -> list[tuple[int, list[int]]]:
    out = []
    for item in items:
        params, _, nodes = item.partition(":")
        out.append((int(float(params)), [int(n) for n in nodes.split(",")]))
    return out


def adamw_step_seconds(master: dict[str, torch.Tensor], repeat: int) -> float:
    """The fastest of ``repeat`` ``torch.optim.AdamW(params).step()`` (torch's default for the device)."""
    params = [torch.nn.Parameter(t.clone()) for t in master.values()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # the moments exist from here on, as in a running job
    best = math.inf
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    del opt, params
    return best


def close_table(
    console, grid, modes, average_max_params: float, average_max_nodes: int, repeat: int, node_frames: str = "run"
) -> None:
    table = Table(
        title="Closing a round, as a multiple of one torch.optim.AdamW step on the same parameters "
        f"(same process, {torch.get_num_threads()} torch threads, OpenMP wait policy {OMP_POLICY}; "
        "target ≤ 10×)",
        caption=f"node frames: {NODE_FRAMES_CAPTION[node_frames]}. parts: aggregate (adamw: transform-domain sum; demo/"
        "sparseloco: the nodes' coefficients summed into the downlink's coefficient-domain buffer "
        "where their chunks are the downlink's, else the exact mean, one exact decode per node), "
        "AdamW (fused, in place), downlink encode (error feedback, a forward DCT where the buffer is "
        "in parameter space, top-k, quantization; the reconstruction is gradwire.dct.decode_levels), "
        "apply, weights hash (BLAKE3), publish (frame fsync + SQLite commit). checkpoint: the "
        "full state, written every checkpoint_every versions after the version is published. "
        "Fastest of the repeats by total.",
    )
    for col in (
        "mode",
        "params",
        "nodes",
        "AdamW step (s)",
        "close (s)",
        "close / AdamW",
        "aggregate",
        "AdamW",
        "encode",
        "(of it decode_levels)",
        "apply",
        "hash",
        "publish",
        "checkpoint / AdamW",
    ):
        table.add_column(col, justify="right")
    jobs = [
        (p, n, m)
        for p, ns in grid
        for n in ns
        for m in modes
        if m == "adamw" or (p <= average_max_params and n <= average_max_nodes)
    ]
    with Progress(console=console, transient=True) as progress, tempfile.TemporaryDirectory() as tmp:
        task = progress.add_task("round close vs AdamW", total=len(jobs))
        store = Store(tmp)
        engine = RoundEngine(
            store, Metrics(lambda: 0.0), ServerSettings(data_dir=Path(tmp), checkpoint_every_version_below_bytes=0)
        )
        frames_cache: dict[tuple[int, int], list[Update]] = {}
        for params, nodes, mode in jobs:
            shapes = sr.model_shapes(params)
            gen = torch.Generator().manual_seed(0)
            master = {n: torch.randn(s, generator=gen) * 0.02 for n, s in sorted(shapes.items())}
            codec = node_codec(mode, node_frames)
            key = (params, nodes, repr(codec))
            if key not in frames_cache:
                frames_cache.clear()
                gc.collect()
                raws = sr.frames_for(shapes, codec, nodes)
                frames_cache[key] = [Update(read_frame(f), 1.0, 1.0, i + 1, f) for i, f in enumerate(raws)]
            updates = frames_cache[key]
            cfg = RunConfig.model_validate(MODES[mode])
            run_id = store.create_run(cfg.model_dump(mode="json"))
            rt = RunRuntime(
                run_id=run_id, config=cfg, state=RunState.load(cfg, 0, master, None, {}, torch.device("cpu"))
            )
            best, adamw = None, math.inf
            for _ in range(repeat):  # interleaved: AdamW steps (fastest of 5), then a close, each repeat
                adamw = min(adamw, adamw_step_seconds(master, 5))
                gc.collect()
                t0 = time.perf_counter()
                closed = engine.close_and_publish(rt, updates)
                total = time.perf_counter() - t0
                rt.version = closed.version
                if best is None or total < best[0]:
                    best = (total, closed)
            t0 = time.perf_counter()
            store.write_checkpoint(run_id, rt.version, *rt.state.checkpoint())
            ckpt = time.perf_counter() - t0
            decode = _decode_levels_share(rt.state, master) if mode == "adamw" else None
            total, closed = best
            t = closed.timings
            r = lambda x: f"{x / adamw:.2f}×"  # noqa: E731
            table.add_row(
                mode,
                f"{params / 1e6:.0f} M",
                str(nodes),
                f"{adamw:.3f}",
                f"{total:.2f}",
                f"[bold]{total / adamw:.1f}×[/bold]",
                r(t.aggregate),
                r(t.adamw),
                r(t.encode),
                "—" if decode is None else r(decode),
                r(t.apply),
                r(t.hash),
                r(closed.publish_s),
                r(ckpt),
            )
            del rt, master
            gc.collect()
            progress.advance(task)
        store.close()
    console.print(table)


def _decode_levels_share(state: RunState, master) -> float:
    """Seconds of the exact decode inside one downlink encode: the same encode with its reconstruction
    step timed on its own (gradwire.dct.decode_levels, wrapped for the measurement).

    The DCT codec's modules call ``decode_levels`` as each imported it (``gradwire.dct.codec`` for a
    bundle's records, ``gradwire.dct.parse`` for a record's own ``decode``), so the wrapper replaces the
    name in both (setting it on the package ``gradwire.dct`` reaches no submodule) and puts the originals
    back afterwards."""
    from gradwire.dct import codec, parse

    spent = [0.0]
    calls = [0]
    real = codec.decode_levels

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = real(*a, **k)
        spent[0] += time.perf_counter() - t0
        calls[0] += 1
        return out

    diff = {n: torch.randn_like(t) * 1e-4 for n, t in master.items()}
    codec.decode_levels = parse.decode_levels = timed
    try:
        feedback = gradwire.ErrorFeedback(RunConfig().downlink.build())
        feedback.compress_bundle_reconstructed(diff)
    finally:
        codec.decode_levels = parse.decode_levels = real
    if not calls[0]:
        # Zero seconds because the wrapper was never called would be a wrong number, not a fast decode.
        raise RuntimeError(
            "the downlink encode never called the wrapped gradwire.dct.decode_levels: "
            "the wrapper is not where the codec looks decode_levels up"
        )
    return spent[0]


#: The close's parts as the server's /metrics sums them (gradwire_close_part_seconds), in the table's order.
CLOSE_PARTS = ("aggregate", "adamw", "encode", "apply", "hash", "publish")


def server_close_sums(client: httpx.Client) -> dict[str, float]:
    """The server's running sums of seconds: ``"close"`` (gradwire_publish_seconds, the driver's whole
    close) and each of :data:`CLOSE_PARTS`."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {part: 0.0 for part in ("close", *CLOSE_PARTS)}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "gradwire_publish_seconds_sum":
                sums["close"] = sample.value
            elif sample.name == "gradwire_close_part_seconds_sum" and sample.labels.get("part") in sums:
                sums[sample.labels["part"]] = sample.value
    return sums


def http_close_table(
    console, params: int, rounds: int, modes: Sequence[str] = ("adamw",), node_frames: str = "run"
) -> None:
    """From the quorum's last 202 to the published version over HTTP, against one AdamW step here, for each
    mode (demo and sparseloco with their default publication, the re-encoded aggregate)."""
    shapes = sr.model_shapes(params)
    nodes_n = 4
    gen = torch.Generator().manual_seed(0)
    master = {n: torch.randn(s, generator=gen) * 0.02 for n, s in sorted(shapes.items())}
    table = Table(
        title=f"Over HTTP: quorum's last 202 → published version, {params / 1e6:.0f} M parameters, "
        f"{nodes_n} nodes (uvicorn on 127.0.0.1)",
        caption=f"node frames: {NODE_FRAMES_CAPTION[node_frames]}. each round: 3 nodes submit, then the 4th; "
        "timed from its 202 to the long-poll answering "
        "with the new version; the AdamW step measured in this process, same torch threads. "
        "server close: the driver's close as the server's /metrics sums it (its largest parts "
        "beside it); HTTP & wake-up: the rest (the 202's return, the driver waking, the "
        "long poll answering).",
    )
    for col in (
        "mode",
        "round",
        "quorum → published (s)",
        "server close (s)",
        "largest parts (s)",
        "HTTP & wake-up (s)",
        "AdamW step (s)",
        "ratio",
    ):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp, LoopbackServer(Path(tmp) / "data") as srv:
        admin = srv.admin_headers()
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            for mode in modes:
                dct = node_codec(mode, node_frames)
                run_id = c.post("/v1/runs", json={**MODES[mode], "quorum": nodes_n}, headers=admin).json()["run_id"]
                nodes = [c.post(f"/v1/runs/{run_id}/nodes", json={}, headers=admin).json() for _ in range(nodes_n)]
                assert (
                    c.put(f"/v1/runs/{run_id}/state", content=state_to_bytes(master), headers=admin).status_code == 200
                )
                for rnd in range(rounds):
                    frames = [
                        dct.encode_bundle(
                            {n: torch.randn(s) * 1e-3 for n, s in shapes.items()}, round=rnd, sender=node["node_id"]
                        )
                        for node in nodes
                    ]
                    for node, frame in list(zip(nodes, frames))[:-1]:
                        r = c.post(
                            f"/v1/runs/{run_id}/rounds/{rnd}/updates",
                            content=frame,
                            headers={"Authorization": f"Bearer {node['token']}"},
                        )
                        assert r.status_code == 202, r.text
                    adamw = adamw_step_seconds(master, 3)
                    before = server_close_sums(c)
                    r = c.post(
                        f"/v1/runs/{run_id}/rounds/{rnd}/updates",
                        content=frames[-1],
                        headers={"Authorization": f"Bearer {nodes[-1]['token']}"},
                    )
                    t0 = time.perf_counter()
                    assert r.status_code == 202, r.text
                    while True:
                        u = c.get(f"/v1/runs/{run_id}/updates", params={"since": rnd, "wait": 60}, headers=admin)
                        if int(u.headers["X-Gradwire-Version"]) > rnd:
                            break
                    took = time.perf_counter() - t0
                    after = server_close_sums(c)
                    spent = {part: after[part] - before[part] for part in after}
                    largest = sorted(CLOSE_PARTS, key=lambda part: -spent[part])[:3]
                    table.add_row(
                        mode,
                        str(rnd),
                        f"{took:.3f}",
                        f"{spent['close']:.3f}",
                        ", ".join(f"{part} {spent[part]:.3f}" for part in largest),
                        f"{took - spent['close']:.3f}",
                        f"{adamw:.3f}",
                        f"[bold]{took / adamw:.1f}×[/bold]",
                    )
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", nargs="+", default=None, metavar="PARAMS:N,N", help=f"default {' '.join(DEFAULT_GRID)}")
    ap.add_argument("--big", action="store_true", help=f"the grid {' '.join(BIG_GRID)}")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--average-max-params", type=float, default=10e6)
    ap.add_argument("--average-max-nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved AdamW step / close pairs; the fastest is kept")
    ap.add_argument("--http-params", type=int, default=10_000_000)
    ap.add_argument("--http-close-rounds", type=int, default=3)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument(
        "--node-frames",
        choices=list(NODE_FRAMES_CAPTION),
        default="run",
        help="run: each mode's default node codec (demo/sparseloco: their 64×64-tile DCT); "
        "flat: the 64×64 top-32 flat DCT for every mode",
    )
    args = ap.parse_args()
    grid = parse_grid(args.grid or (BIG_GRID if args.big else DEFAULT_GRID))
    close_table(
        sr.console, grid, args.modes, args.average_max_params, args.average_max_nodes, args.repeat, args.node_frames
    )
    if not args.skip_http:
        http_close_table(sr.console, args.http_params, args.http_close_rounds, args.modes, args.node_frames)


if __name__ == "__main__":
    main()
