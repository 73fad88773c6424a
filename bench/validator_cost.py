"""What a validator costs (issue 43, docs/SERVER.md "Validators"): its time per candidate update, and the extra
latency it adds to a round, at 8, 64 and 256 nodes, side by side with an unscored round, in one run.

A real server on loopback (``python -m gradwire_server``), a small MLP (32 → 64 → 10, about 2.8 k parameters)
in a demo run publishing its frames. Per node count, two runs alike but for ``validation``: nodes submit
dense frames concurrently (16 client threads); the round's fill is from its first submission to the quorum's
last 202, its latency from that 202 to the published version (a long poll). In the scored run one
:class:`gradwire.client.Validator` (harm-only, its own batch of 256 samples) reads the candidates as they
arrive, measures each at once, and once the round waits for scores measures the last few and posts the scores;
the round closes when it has. The validator's time per candidate is its decode and probes (mostly while the
round fills); "after ready" is from the answer saying the round waits for scores to its scores posted. Each
figure is the median over ``--rounds`` rounds.

This process runs the validator beside the server on the same cores: like the server
(:mod:`gradwire_server.openmp`) it lets OpenMP's idle workers sleep (``OMP_WAIT_POLICY=PASSIVE``; set the
variable to measure another policy). With spinning workers (the default policy) on a shared 2-core machine each
of the probe's tiny torch operations waited for a descheduled worker: 14–21 ms per candidate instead of 0.5.

Then whether harm-only scoring keeps an honest minority (issue 43: "measure that it keeps the minority"): 8
nodes training one MLP (16 → 64 → 4) through an adamw run with gradwire's ``Node``, 6 on one distribution and 2
on inputs from another region of the input space labelled by another rule; the validator holds only the
majority's distribution. Three runs from the same seeds: the plain ``mean``, the default rule, and the default
rule with the validator. Held-out loss on each group's data and on the 75/25 mixture, and the minority's share
of the weights in the scored run (2/8 = 25 % is an equal voice).

Usage: python bench/validator_cost.py [--nodes 8 64 256] [--rounds 5] [--minority-rounds 30] [--no-write]
                                     [--out PATH] [--validator-threads N]
"""

from __future__ import annotations

# As `python -m gradwire_server` runs: OpenMP workers that sleep when idle (gradwire_server.openmp).
from gradwire_server.openmp import prefer_passive_openmp

OMP_POLICY = prefer_passive_openmp()

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


def one_run(srv: LoopbackServer, n: int, rounds: int, scored: bool, threads: int | None = None) -> dict[str, float]:
    """Median seconds of the round's fill and latency and, scored, the validator's per candidate and after the
    round was ready (``threads``: the validator's torch threads, None for torch's)."""
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
    fills, latencies, per_candidate, after_ready, errors = [], [], [], [], []

    def validate() -> None:
        try:
            with GradwireClient(srv.url, vtoken, timeout=120) as gw:
                v = Validator(gw, run_id, model(), loss, batch=batch, threads=threads)
                for rnd in range(rounds):
                    v.score_round(rnd, wait=60)
                    per_candidate.append(v.seconds_per_candidate)
                    after_ready.append(v.seconds_after_ready)
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

            started = time.perf_counter()
            list(pool.map(send, range(n)))
            t0 = time.perf_counter()
            fills.append(t0 - started)
            r = c.get(f"/v1/runs/{run_id}/updates", params={"since": rnd, "wait": 60}, headers=admin)
            assert r.status_code == 200 and int(r.headers["X-Gradwire-Version"]) == rnd + 1, r.text
            latencies.append(time.perf_counter() - t0)
    if thread is not None:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    out = {"fill": statistics.median(fills), "latency": statistics.median(latencies)}
    if per_candidate:
        out |= {"per_candidate": statistics.median(per_candidate), "after_ready": statistics.median(after_ready)}
    return out


def group_data(minority: bool, seed: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of one group: the majority's inputs ~ N(0, 1) labelled by rule A, the minority's shifted by 3 in
    every feature and labelled by rule B."""
    g = torch.Generator().manual_seed(seed)
    rule = torch.randn(16, 4, generator=torch.Generator().manual_seed(2 if minority else 1))
    x = torch.randn(n, 16, generator=g) + (3.0 if minority else 0.0)
    return x, (x @ rule).argmax(dim=1)


def minority_run(srv: LoopbackServer, rounds: int, rule: str, validated: bool) -> dict[str, float]:
    """One adamw run of 6 + 2 nodes: held-out loss per group and on the mixture, and (scored) the minority's
    mean share of the weights."""
    from gradwire.client import Node

    admin = GradwireClient(srv.url, srv.admin_token, timeout=120)
    config = {"algorithm": "adamw", "quorum": 8, "aggregation": {"rule": rule}, "optimizer": {"lr": 0.01}}
    if validated:
        config["validation"] = {"score_deadline_s": 60}
    run_id = admin.create_run(config)
    torch.manual_seed(0)
    net = lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))  # noqa: E731
    admin.put_state(run_id, {k: p.detach() for k, p in net().named_parameters()})
    ids = [admin.register_node(run_id) for _ in range(8)]
    vtoken = admin.register_validator(run_id)[1] if validated else None
    minority_ids = {ids[6][0], ids[7][0]}
    errors: list = []

    def train(i: int) -> None:
        try:
            node_id, token = ids[i]
            model = net()
            node = Node(GradwireClient(srv.url, token, timeout=120), run_id, model, gradwire.IdentityCodec(), node_id)
            for step in range(rounds):
                x, y = group_data(node_id in minority_ids, 100 * node_id + step)
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                node.step()
        except BaseException as exc:  # reported below
            errors.append(exc)

    def validate() -> None:
        try:
            with GradwireClient(srv.url, vtoken, timeout=120) as gw:
                v = Validator(gw, run_id, net(), loss, batch=lambda rnd: group_data(False, 50_000 + rnd, 256))
                for rnd in range(rounds):
                    v.score_round(rnd, wait=60)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=validate)] if validated else []
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    if errors:
        raise errors[0]
    state, _, _ = admin.state(run_id)
    model = net()
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(state[k])
        major, minor = group_data(False, 90_000, 2048), group_data(True, 90_001, 2048)
        out = {"majority": float(loss(model, major)), "minority": float(loss(model, minor))}
        out["mixture"] = 0.75 * out["majority"] + 0.25 * out["minority"]
    if validated:
        shares = []
        for entry in admin.scores(run_id):
            w = {int(k): v for k, v in entry["weights"].items()}
            total = sum(w.values())
            if entry["scored"] and total > 0:
                shares.append(sum(w[n] for n in minority_ids) / total)
        out["share"] = statistics.mean(shares) if shares else float("nan")
        out["scored"] = len(shares)
    admin.close()
    return out


def _share(r: dict) -> str:
    return "" if "share" not in r else f"{100 * r['share']:.1f} % ({r['scored']} rounds scored)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--minority-rounds", type=int, default=30)
    ap.add_argument("--no-write", action="store_true", help="write no report (print the tables only)")
    ap.add_argument(
        "--out", type=Path, default=REPORT, help=f"the report to write (default {REPORT.relative_to(ROOT)})"
    )
    ap.add_argument(
        "--validator-threads", type=int, default=None, help="the validator's torch threads (default: torch's)"
    )
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as data_dir, LoopbackServer(data_dir) as srv:
        for n in args.nodes:
            plain = one_run(srv, n, args.rounds, scored=False)
            scored = one_run(srv, n, args.rounds, scored=True, threads=args.validator_threads)
            rows.append((n, plain, scored))
            print(f"{n} nodes done", file=sys.stderr)
        runs = {
            "mean": minority_run(srv, args.minority_rounds, "mean", False),
            "default": minority_run(srv, args.minority_rounds, "bounded_mean", False),
            "default + validator": minority_run(srv, args.minority_rounds, "bounded_mean", True),
        }
    header = (
        "| nodes | unscored round (ms) | scored round (ms) | extra latency (ms) | scored ÷ unscored "
        "| validator per candidate (ms) | validator after ready (ms) | fill unscored / scored (ms) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {n} | {1e3 * p['latency']:.1f} | {1e3 * s['latency']:.1f} | {1e3 * (s['latency'] - p['latency']):.1f} "
        f"| {s['latency'] / p['latency']:.2f}× | {1e3 * s['per_candidate']:.2f} | {1e3 * s['after_ready']:.1f} "
        f"| {1e3 * p['fill']:.0f} / {1e3 * s['fill']:.0f} |"
        for n, p, s in rows
    ]
    table = "\n".join([header, *lines])
    print(table)
    mean = runs["mean"]
    minority_table = "\n".join(
        [
            "| run | mixture | majority's data | minority's data | ÷ mean: mixture | ÷ mean: minority "
            "| minority's weight share |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {name} | {r['mixture']:.4f} | {r['majority']:.4f} | {r['minority']:.4f} "
                f"| {r['mixture'] / mean['mixture']:.3f}× | {r['minority'] / mean['minority']:.3f}× "
                f"| {_share(r)} |"
                for name, r in runs.items()
            ),
        ]
    )
    print()
    print(minority_table)
    if not args.no_write:
        today = datetime.date.today().isoformat()
        cmd = "python bench/validator_cost.py " + " ".join(sys.argv[1:])
        args.out.write_text(
            f"# What a validator costs\n\nWritten by `{cmd.strip()}` on {today}.\n\n"
            "A real server on loopback, a demo run publishing its frames, a small MLP (32 → 64 → 10, about "
            "2.8 k parameters), dense frames from every node (16 client threads); the round's fill is from its "
            "first submission to the quorum's last 202, its latency from that 202 to the published version. One "
            "harm-only validator (a batch of 256 samples) reads the candidates as they arrive and measures each "
            "at once; once the round waits for scores it measures the last few and posts its scores, and the "
            "round closes. Per candidate: the validator's decode and probes (mostly while the round fills); after "
            "ready: from the answer saying the round waits for scores to the scores posted. The validator runs "
            f"beside the server on the same cores (OpenMP policy {OMP_POLICY}, validator torch threads "
            f"{args.validator_threads or 'torch default'}). Medians over {args.rounds} rounds.\n\n"
            f"{table}\n\n"
            "## Does harm-only scoring keep an honest minority?\n\n"
            f"8 nodes, {args.minority_rounds} versions of an adamw run (lr 0.01, dense frames, gradwire's `Node`), "
            "an MLP 16 → 64 → 4: 6 nodes on inputs ~ N(0, 1) labelled by one rule, 2 on inputs shifted by 3 in "
            "every feature labelled by another; the validator holds only the majority's distribution. Held-out "
            "cross-entropy (2,048 samples per group; the mixture weighs them 75/25), one seed.\n\n"
            f"{minority_table}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
