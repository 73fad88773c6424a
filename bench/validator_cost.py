"""What a validator costs (issue 43, docs/SERVER.md "Validators"): its time per candidate update, and the extra
latency it adds to a round, at 8, 64 and 256 nodes, side by side with an unscored round, in one run.

A real server on loopback (``python -m gradwire_server``), a small MLP (32 → 64 → 10, about 2.8 k parameters)
in a demo run publishing its frames. Per node count, two runs alike but for ``validation``: nodes submit
dense frames concurrently (16 client threads); the round's latency is from the quorum's last 202 to the
published version (a long poll). In the scored run one :class:`gradwire.client.Validator` (harm-only, its own
batch of 256 samples) reads the candidates, scores each and posts the scores; the round closes when it has.
Each figure is the median over ``--rounds`` rounds.

Usage: python bench/validator_cost.py [--nodes 8 64 256] [--rounds 5] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

import gradwire
from gradwire.client import GradwireClient, Validator
from gradwire.state import state_to_bytes
from gradwire_server.launcher import LoopbackServer

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "docs" / "results" / "validators.md"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def batch(_round: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g)


def loss(m: torch.nn.Module, b) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])


def frames(names_shapes: dict, n: int, rnd: int) -> list[bytes]:
    codec = gradwire.IdentityCodec()
    out = []
    for node in range(1, n + 1):
        g = torch.Generator().manual_seed(1000 * rnd + node)
        grads = {k: torch.randn(s, generator=g) * 0.01 for k, s in names_shapes.items()}
        out.append(codec.encode_bundle(grads, round=rnd, sender=node))
    return out


def one_run(srv: LoopbackServer, n: int, rounds: int, scored: bool) -> tuple[float, float | None]:
    """Median round latency (s) and, scored, the validator's median seconds per candidate."""
    admin = {"Authorization": f"Bearer {srv.admin_token}"}
    m = model()
    state = {k: p.detach().clone() for k, p in m.named_parameters()}
    shapes = {k: tuple(t.shape) for k, t in state.items()}
    config = {"algorithm": "demo", "publish": "frames", "quorum": n, "round_deadline_s": 600}
    if scored:
        config["validation"] = {"score_deadline_s": 60}
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        run_id = c.post("/v1/runs", json=config, headers=admin).json()["run_id"]
        tokens = [c.post(f"/v1/runs/{run_id}/nodes", json={}, headers=admin).json()["token"] for _ in range(n)]
        c.put(f"/v1/runs/{run_id}/state", content=state_to_bytes(state), headers=admin).raise_for_status()
        vtoken = c.post(f"/v1/runs/{run_id}/validators", json={}, headers=admin).json()["token"] if scored else None
    latencies, per_candidate, errors = [], [], []

    def validate() -> None:
        try:
            with GradwireClient(srv.url, vtoken, timeout=120) as gw:
                v = Validator(gw, run_id, model(), loss, batch=batch)
                for rnd in range(rounds):
                    v.score_round(rnd, wait=60)
                    per_candidate.append(v.seconds_per_candidate)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    thread = threading.Thread(target=validate) if scored else None
    if thread is not None:
        thread.start()
    with (
        ThreadPoolExecutor(16) as pool,
        httpx.Client(base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=32)) as c,
    ):
        for rnd in range(rounds):
            body = frames(shapes, n, rnd)

            def send(i: int, rnd=rnd, body=body) -> None:
                r = c.post(
                    f"/v1/runs/{run_id}/rounds/{rnd}/updates",
                    content=body[i],
                    headers={"Authorization": f"Bearer {tokens[i]}", "Content-Type": "application/octet-stream"},
                )
                assert r.status_code == 202, r.text

            list(pool.map(send, range(n)))
            t0 = time.perf_counter()
            r = c.get(f"/v1/runs/{run_id}/updates", params={"since": rnd, "wait": 60}, headers=admin)
            assert r.status_code == 200 and int(r.headers["X-Gradwire-Version"]) == rnd + 1, r.text
            latencies.append(time.perf_counter() - t0)
    if thread is not None:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return statistics.median(latencies), statistics.median(per_candidate) if per_candidate else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help=f"do not rewrite {REPORT.relative_to(ROOT)}")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as data_dir, LoopbackServer(data_dir) as srv:
        for n in args.nodes:
            plain, _ = one_run(srv, n, args.rounds, scored=False)
            scored, per = one_run(srv, n, args.rounds, scored=True)
            rows.append((n, plain, scored, per))
            print(f"{n} nodes done", file=sys.stderr)
    header = (
        "| nodes | unscored round (ms) | scored round (ms) | extra latency (ms) | scored ÷ unscored "
        "| validator per candidate (ms) |\n|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {n} | {1e3 * p:.1f} | {1e3 * s:.1f} | {1e3 * (s - p):.1f} | {s / p:.2f}× | {1e3 * c:.2f} |"
        for n, p, s, c in rows
    ]
    table = "\n".join([header, *lines])
    print(table)
    if not args.no_write:
        today = datetime.date.today().isoformat()
        cmd = "python bench/validator_cost.py " + " ".join(sys.argv[1:])
        REPORT.write_text(
            f"# What a validator costs\n\nWritten by `{cmd.strip()}` on {today}.\n\n"
            "A real server on loopback, a demo run publishing its frames, a small MLP (32 → 64 → 10, about "
            "2.8 k parameters), dense frames from every node; the round's latency is from the quorum's last 202 "
            "to the published version; one harm-only validator (a batch of 256 samples) scores every candidate "
            f"and posts its scores before the scored round closes. Medians over {args.rounds} rounds.\n\n"
            f"{table}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
