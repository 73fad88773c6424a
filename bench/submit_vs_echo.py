"""Part 4 of bench/server_rounds.py: accepted submissions per second against a bare FastAPI app answering
the same bodies, measured side by side in one run.

Standalone: python bench/submit_vs_echo.py [--requests 192] [--concurrency 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.table import Table

import gradwire
import server_rounds as sr
from gradwire.state import state_to_bytes
from gradwire_server.launcher import LoopbackServer, free_port

ECHO_APP = """
import uvicorn
from fastapi import FastAPI, Request
app = FastAPI()

@app.post("/v1/runs/{run_id}/rounds/{round}/updates", status_code=202)
async def submit(run_id: str, round: int, request: Request):
    body = await request.body()
    return {"round": round, "node_id": 0, "duplicate": False, "submitted": len(body)}

@app.get("/readyz")
async def ready():
    return {"ready": True}

uvicorn.run(app, host="127.0.0.1", port=%d, log_level="warning", access_log=False)
"""


def _echo(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", ECHO_APP % port])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the echo app did not start")


def _rate(url, run_id, nodes, frames, concurrency) -> tuple[float, bool]:
    wall, lat, statuses = asyncio.run(sr._submit_all(url, run_id, nodes, frames, concurrency))
    return len(lat) / wall, all(s == 202 for s in statuses)


def submit_table(console, params: int, requests: int, concurrency: int, repeat: int = 2) -> None:
    shapes = sr.model_shapes(params)
    dct = gradwire.DCTCodec(chunk_shape=(64, 64), topk=32)
    frames = sr.frames_for(shapes, dct, requests, distinct=2)
    state = state_to_bytes({n: torch.zeros(s) for n, s in shapes.items()})
    table = Table(
        title=f"Submissions: {requests} distinct nodes, {len(frames[0]) / 1e3:.0f} kB DCT frames, "
        f"concurrency {concurrency}, against a bare FastAPI echo app (target ≥ 0.5×)",
        caption="the server validates, fsyncs the frame and commits its row before each 202; the echo app "
        "reads the body and answers 202. Best of the repeats, server and echo interleaved.",
    )
    for col in ("mode", "server accepted/s", "echo answered/s", "ratio", "all 202"):
        table.add_column(col, justify="right")
    port = free_port()
    echo = _echo(port)
    try:
        fake = [{"node_id": i + 1, "token": "x"} for i in range(requests)]
        for mode in ("adamw", "demo"):
            best_srv, best_echo, ok = 0.0, 0.0, True
            for _ in range(repeat):
                with tempfile.TemporaryDirectory() as tmp, LoopbackServer(Path(tmp) / "data") as srv:
                    admin = srv.admin_headers()
                    with httpx.Client(base_url=srv.url, timeout=120) as c:
                        config = {"quorum": requests + 1, "min_updates": requests + 1, "round_deadline_s": 3600}
                        if mode != "adamw":
                            config["algorithm"] = mode
                        run_id = c.post("/v1/runs", json=config, headers=admin).json()["run_id"]
                        nodes = [
                            c.post(f"/v1/runs/{run_id}/nodes", json={}, headers=admin).json() for _ in range(requests)
                        ]
                        assert c.put(f"/v1/runs/{run_id}/state", content=state, headers=admin).status_code == 200
                    # Each node's frame names it as the sender.
                    mine = sr.frames_for(shapes, dct, requests, distinct=2)
                    rate, all_ok = _rate(srv.url, run_id, nodes, mine, concurrency)
                    best_srv, ok = max(best_srv, rate), ok and all_ok
                rate, _ = _rate(f"http://127.0.0.1:{port}", "echo", fake, frames, concurrency)
                best_echo = max(best_echo, rate)
            table.add_row(
                mode,
                f"{best_srv:.1f}",
                f"{best_echo:.1f}",
                f"[bold]{best_srv / best_echo:.2f}×[/bold]",
                "yes" if ok else "no",
            )
    finally:
        echo.kill()
        echo.wait()
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=10_000_000, help="model size the frames are encoded from")
    ap.add_argument("--requests", type=int, default=192, help="distinct nodes, one submission each")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="server and echo interleaved; the best of each is kept")
    args = ap.parse_args()
    submit_table(sr.console, args.params, args.requests, args.concurrency, args.repeat)


if __name__ == "__main__":
    main()
