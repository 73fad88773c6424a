"""Time to loss over an emulated WAN: dense DDP against gradwire's DeMo and SparseLoCo, side by side.

Every node is its own process in its own network namespace, joined to the others through a router
namespace by veth pairs, every link shaped by ``tc`` (bench/wan_net.py: HTB for the rate, a userspace
delay line for the one-way delay, since this kernel has no ``netem``). Rows, on the same data, the same
initial weights and the same batches per node (bench/wan_node.py):

- ``dense``: ``DistributedDataParallel`` over gloo with AdamW (the baseline);
- ``demo``, ``sparseloco``: ``gradwire.torch.DeMo`` / ``SparseLoCo`` (inner AdamW, ``sync_every`` 16) over gloo;
- ``server-demo``, ``server-sparseloco``: the same algorithms through the aggregation server, which runs
  in a namespace (host) of its own behind its own shaped link; the nodes are ``gradwire.client.Node`` s.

The dense row runs ``--steps`` steps; its held-out loss at the end is the target. Every other row runs
until it reaches that loss (up to ``--max-factor`` × the steps), and the table gives each row's
training wall-clock to the target and the speed-up over dense, all measured in one run. The learning
rate of each family (AdamW for dense and SparseLoCo's inner steps, DeMo's sign step) is the best of a
short sweep (``--sweep-steps``, over ``--lrs``) on the unshaped network (loss per step does not depend
on the link), cached in bench/out/wan.json with every run's curve. The plot (matplotlib) shows held-out
loss against training wall-clock, one panel per model and link.

Needs root (namespaces, tc, TUN): it checks and says so. Two nodes by default, one torch thread each.

    sudo .venv/bin/python bench/wan.py                       # both models, both links (about 45 min here)
    .venv/bin/python bench/wan.py --quick                    # the char transformer, 100 Mbit/s only
    .venv/bin/python bench/wan.py --report-only              # rewrite docs/results/wan.md from the cache
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

# Run as a script (python bench/wan.py): its siblings import from the script's folder.
import wan_curves
import wan_net

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CACHE = ROOT / "bench" / "out" / "wan.json"
DOC = ROOT / "docs" / "results" / "wan.md"
PLOT = ROOT / "docs" / "results" / "wan.png"
NODE = HERE / "wan_node.py"

ROWS = ("dense", "demo", "sparseloco", "server-demo", "server-sparseloco")
#: The learning-rate family a row's lr comes from.
FAMILY = {
    "dense": "adamw",
    "sparseloco": "sparseloco",
    "server-sparseloco": "sparseloco",
    "demo": "demo",
    "server-demo": "demo",
}
#: The sweep's grids per model (AdamW: dense and SparseLoCo's inner AdamW; DeMo's sign step): the small
#: model trains best near 1e-2 (bench/convergence.py's base lr for it), the 10.7 M one lower.
LRS = {
    "chars": {"adamw": (1e-3, 3e-3, 1e-2), "sparseloco": (1e-3, 3e-3, 1e-2), "demo": (1e-3, 3e-3, 1e-2)},
    "chars10m": {"adamw": (3e-4, 1e-3, 3e-3), "sparseloco": (3e-4, 1e-3, 3e-3), "demo": (3e-4, 1e-3, 3e-3)},
}
#: Dense steps per model (the target is dense's held-out loss after them).
STEPS = {"chars": 256, "chars10m": 96}
#: Steps of the lr sweep per model (a multiple of SparseLoCo's sync_every).
SWEEP_STEPS = {"chars": 64, "chars10m": 32}
#: Sequences of 64 characters per node per step (the 10.7 M model's is smaller: 2 shared cores).
BATCH = {"chars": 8, "chars10m": 4}
SERVER_PORT = 8700
SYNC_EVERY = 16


@dataclass
class Settings:
    nodes: int
    batches: dict
    sync_every: int
    max_factor: float
    sweep_steps: dict
    log_dir: Path


#: The node codecs docs/results/wan.md was measured with (the libraries' defaults then): DeMo's top 32 of every
#: 64×64 tile, SparseLoCo's top 64 at 2 bits. The defaults have changed since (DeMo top 22 of a full tile
#: and a smaller chunk's share; SparseLoCo the k of ≈ 330× per local step, 1,266 at sync_every 16), so the
#: bench names its codecs, for its figures to stay reproducible.
WAN_CODECS = {
    "demo": {
        "codec": "dct",
        "params": {"chunk_shape": [64, 64], "topk": 32, "mode": "tiles", "index_coding": "auto", "value_bits": 1},
    },
    "sparseloco": {
        "codec": "dct",
        "params": {"chunk_shape": [64, 64], "topk": 64, "mode": "tiles", "index_coding": "auto", "value_bits": 2},
    },
}


def _codec_json(row: str) -> dict:
    return WAN_CODECS["demo" if row.endswith("demo") else "sparseloco"]


def _run_config(row: str, lr: float, nodes: int) -> dict:
    """The server run of a ``server-*`` row: the algorithm's re-encoded aggregate (the default), the plain
    mean (trusted nodes, as the torch.distributed rows), quorum = every node."""
    algo = row.split("-", 1)[1]
    config = {
        "algorithm": algo,
        "publish": "aggregate",
        "uplink": _codec_json(row),
        "aggregation": {"rule": "mean"},
        "quorum": nodes,
        "min_updates": nodes,
        "round_deadline_s": 600.0,
    }
    if algo == "demo":
        config["demo"] = {"lr": lr, "beta": 0.999}
    else:
        config["sparseloco"] = {"sync_every": SYNC_EVERY, "inner": {"lr": lr}}
    return config


class Server:
    """gradwire_server on the last host of the WAN (its own namespace and shaped link)."""

    def __init__(self, wan: wan_net.Wan, host: int, log_dir: Path):
        self.wan, self.host = wan, host
        self.url = f"http://{wan_net.host_ip(host)}:{SERVER_PORT}"
        self.token = secrets.token_urlsafe(24)
        data = log_dir / "server-data"
        data.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "GRADWIRE_ADMIN_TOKEN": self.token, "OMP_NUM_THREADS": "1"}
        self.log = open(log_dir / "server.log", "ab")
        self.proc = wan.run_in(
            host,
            [
                sys.executable,
                "-m",
                "gradwire_server",
                "--host",
                "0.0.0.0",
                "--port",
                str(SERVER_PORT),
                "--data-dir",
                str(data),
            ],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=str(data),
        )
        poll = (
            "import time,urllib.request as u\n"
            "for _ in range(600):\n"
            "    try:\n"
            f"        u.urlopen('{self.url}/readyz', timeout=2); break\n"
            "    except Exception: time.sleep(0.1)\n"
            "else: raise SystemExit('server not ready')\n"
        )
        if self.wan.run_in(host, [sys.executable, "-c", poll]).wait() != 0:
            raise RuntimeError(f"the server did not start: {(log_dir / 'server.log').read_text()[-2000:]}")

    def create_run(self, model: str, row: str, lr: float, nodes: int) -> dict:
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.wan.ns(self.host),
                sys.executable,
                str(NODE),
                "admin",
                "--url",
                self.url,
                "--model",
                model,
                "--world",
                str(nodes),
                "--config",
                json.dumps(_run_config(row, lr, nodes)),
            ],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_PORT = [29500]


def run_row(
    wan,
    server: Server | None,
    s: Settings,
    *,
    row: str,
    model: str,
    lr: float,
    steps: int,
    target: float,
    tag: str,
    timeout: float = 3600.0,
) -> dict:
    """One row on the WAN: ``s.nodes`` node processes; rank 0's curve, the bytes and the load average."""
    batch = s.batches[model]
    eval_every = s.sync_every
    common = [
        "--model",
        model,
        "--world",
        str(s.nodes),
        "--steps",
        str(steps),
        "--lr",
        repr(lr),
        "--batch",
        str(batch),
        "--sync-every",
        str(s.sync_every),
        "--eval-every",
        str(eval_every),
        f"--target={target!r}",
    ]
    if row in ("demo", "sparseloco"):  # the torch.distributed rows name their codec too (WAN_CODECS)
        common += ["--codec", json.dumps(_codec_json(row))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    procs, logs = [], []
    extra: list[list[str]] = [[] for _ in range(s.nodes)]
    if row.startswith("server-"):
        created = server.create_run(model, row, lr, s.nodes)
        for r, (node_id, _token) in enumerate(created["nodes"]):
            extra[r] = [
                "--url",
                server.url,
                "--run-id",
                created["run_id"],
                "--node-id",
                str(node_id),
                "--codec",
                json.dumps(_codec_json(row)),
            ]
        tokens = [t for _, t in created["nodes"]]
    else:
        _PORT[0] += 1
        master = f"{wan_net.host_ip(0)}:{_PORT[0]}"
        extra = [["--master", master] for _ in range(s.nodes)]
        tokens = [None] * s.nodes
    load0 = os.getloadavg()
    started = time.monotonic()
    for r in range(s.nodes):
        log = s.log_dir / f"{tag}-rank{r}.jsonl"
        logs.append(log)
        err = open(s.log_dir / f"{tag}-rank{r}.err", "wb")
        e = dict(env, GRADWIRE_TOKEN=tokens[r]) if tokens[r] else env
        procs.append(
            wan.run_in(
                r,
                [
                    sys.executable,
                    str(NODE),
                    "train",
                    "--mode",
                    row,
                    "--rank",
                    str(r),
                    *common,
                    "--log",
                    str(log),
                    *extra[r],
                ],
                env=e,
                stderr=err,
                stdout=err,
            )
        )
        err.close()
    try:
        for r, p in enumerate(procs):
            left = max(1.0, timeout - (time.monotonic() - started))
            if p.wait(timeout=left) != 0:
                tail = (s.log_dir / f"{tag}-rank{r}.err").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{tag}: rank {r} exited with {p.returncode}:\n{tail}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    curve, done = wan_curves.read_curve(logs[0])
    return {
        "row": row,
        "model": model,
        "lr": lr,
        "steps_cap": steps,
        "target": target,
        "curve": [[p.step, p.seconds, p.loss] for p in curve],
        "done": done,
        "load": [round(x, 2) for x in load0] + [round(x, 2) for x in os.getloadavg()],
        "wall": time.monotonic() - started,
    }


def _points(result: dict) -> list:
    return [wan_curves.Point(int(a), float(b), float(c)) for a, b, c in result["curve"]]


# ---------------------------------------------------------------------------------------------
# The cache: every run's result by its settings


def load_cache() -> dict:
    return json.loads(CACHE.read_text()) if CACHE.exists() else {}


def save_cache(cache: dict) -> None:
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = CACHE.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    tmp.replace(CACHE)


def sweep(cache: dict, s: Settings, model: str, families: set) -> dict:
    """The best lr per family on the unshaped network (lowest held-out loss after the sweep steps)."""
    best = {}
    steps = s.sweep_steps[model]
    todo = [
        (f, lr)
        for f in sorted(families)
        for lr in LRS[model][f]
        if f"sweep|{model}|{f}|{lr}|{steps}|{s.nodes}|{s.batches[model]}" not in cache
    ]
    if todo:
        with wan_net.Wan(s.nodes, wan_net.LINKS["none"], s.log_dir) as wan:
            for f, lr in todo:
                row = {"adamw": "dense", "sparseloco": "sparseloco", "demo": "demo"}[f]
                print(f"sweep {model} {f} lr {lr:g} ({steps} steps)", flush=True)
                res = run_row(
                    wan,
                    None,
                    s,
                    row=row,
                    model=model,
                    lr=lr,
                    steps=steps,
                    target=float("-inf"),
                    tag=f"sweep-{model}-{f}-{lr:g}",
                )
                cache[f"sweep|{model}|{f}|{lr}|{steps}|{s.nodes}|{s.batches[model]}"] = res
                save_cache(cache)
    for f in families:
        results = {lr: cache[f"sweep|{model}|{f}|{lr}|{steps}|{s.nodes}|{s.batches[model]}"] for lr in LRS[model][f]}
        best[f] = min(results, key=lambda lr: wan_curves.final_loss(_points(results[lr])))
        print(
            f"  {model} {f}: "
            + ", ".join(f"lr {lr:g} → {wan_curves.final_loss(_points(r)):.4f}" for lr, r in results.items())
            + f"  (best {best[f]:g})",
            flush=True,
        )
    return best


def measure(cache: dict, s: Settings, model: str, link_key: str, rows: list[str], lrs: dict, steps: int) -> None:
    """Every row on one link: dense first (its final loss is the target), then the others."""
    link = wan_net.LINKS[link_key]

    def key(row):
        return f"wan|{model}|{link_key}|{row}|{lrs[FAMILY[row]]}|{steps}|{s.nodes}|{s.batches[model]}"

    if all(key(r) in cache for r in rows):
        return
    with_server = any(r.startswith("server-") for r in rows)
    with wan_net.Wan(s.nodes + with_server, link, s.log_dir) as wan:
        server = Server(wan, s.nodes, s.log_dir) if with_server else None
        try:
            if key("dense") not in cache:
                print(f"{model} over {link.name}: dense, {steps} steps", flush=True)
                cache[key("dense")] = run_row(
                    wan,
                    server,
                    s,
                    row="dense",
                    model=model,
                    lr=lrs["adamw"],
                    steps=steps,
                    target=float("-inf"),
                    tag=f"{model}-{link_key}-dense",
                )
                save_cache(cache)
            target = wan_curves.final_loss(_points(cache[key("dense")]))
            for row in rows:
                if row == "dense" or key(row) in cache:
                    continue
                print(f"{model} over {link.name}: {row} to {target:.4f}", flush=True)
                res = run_row(
                    wan,
                    server,
                    s,
                    row=row,
                    model=model,
                    lr=lrs[FAMILY[row]],
                    steps=int(steps * s.max_factor),
                    target=target,
                    tag=f"{model}-{link_key}-{row}",
                )
                res["delay_line"] = None
                cache[key(row)] = res
                save_cache(cache)
        finally:
            if server is not None:
                server.close()
    report = wan.delay_report()
    for row in rows:
        cache[key(row)].setdefault("delay_line", report)
        if cache[key(row)].get("delay_line") is None:
            cache[key(row)]["delay_line"] = report
    save_cache(cache)


# ---------------------------------------------------------------------------------------------
# Report


TITLES = {
    "chars": "char transformer (0.43 M parameters, d 128, 2 layers)",
    "chars10m": "char transformer, 10.7 M parameters (d 384, 6 layers)",
}
LABELS = {
    "dense": "dense DDP (AdamW, gloo)",
    "demo": "DeMo (gradwire.torch)",
    "sparseloco": "SparseLoCo (gradwire.torch)",
    "server-demo": "DeMo via server",
    "server-sparseloco": "SparseLoCo via server",
}


def table(cache: dict, s: Settings, model: str, link_key: str, rows: list[str], lrs: dict, steps: int) -> list[str]:
    def key(row):
        return f"wan|{model}|{link_key}|{row}|{lrs[FAMILY[row]]}|{steps}|{s.nodes}|{s.batches[model]}"

    dense = cache[key("dense")]
    target = wan_curves.final_loss(_points(dense))
    t_dense = wan_curves.time_to_loss(_points(dense), target)
    lines = [
        f"**{TITLES[model]} over {wan_net.LINKS[link_key].name}**, {s.nodes} nodes × {s.batches[model]} "
        f"sequences of 64 characters per step; target = dense's held-out loss after {steps} steps: "
        f"**{target:.4f}**",
        "",
        "| row | lr | steps to target | training s to target | s/step | speed-up vs dense | bytes sent/node/step "
        "| load avg (1 min, start→end) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if key(row) not in cache:
            continue
        r = cache[key(row)]
        pts = _points(r)
        hit = wan_curves.time_to_loss(pts, target)
        done = r["done"]
        per_step = done["t"] / max(1, done["steps"])
        sent = done.get("bytes_sent")
        if row == "dense":
            sent = 4 * done["params"]  # DDP's all-reduce: about one fp32 gradient out per step (ring, 2 ranks)
        up = f"{sent / max(1, done['steps']):,.0f}" if row != "dense" else f"≈ {sent:,.0f} (fp32)"
        sp = wan_curves.speedup(t_dense, hit)
        reached = str(hit.step) if hit else f"not in {done['steps']}"
        lines.append(
            f"| {LABELS[row]} | {r['lr']:g} | {reached} | "
            f"{f'{hit.seconds:.1f}' if hit else '—'} | {per_step:.2f} | "
            f"{f'**{sp:.2f}×**' if sp else '—'} | {up} | {r['load'][0]:.1f} → {r['load'][3]:.1f} |"
        )
    d = dense.get("delay_line")
    if d:
        lines += [
            "",
            f"Delay line: {d['packets']:,} packets held {d['delay_ms']:.0f} ms, "
            f"{d['mean_late_ms']:.2f} ms late on average (max {d['max_late_ms']:.1f} ms).",
        ]
    return lines


def plot(cache: dict, s: Settings, panels: list, rows: list[str], lrs_by_model: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (model, link_key, steps) in zip(axes[0], panels):
        lrs = lrs_by_model[model]
        target = None
        for row in rows:
            k = f"wan|{model}|{link_key}|{row}|{lrs[FAMILY[row]]}|{steps}|{s.nodes}|{s.batches[model]}"
            if k not in cache:
                continue
            pts = _points(cache[k])
            if row == "dense":
                target = wan_curves.final_loss(pts)
            ax.plot(
                [p.seconds for p in pts],
                [p.loss for p in pts],
                marker=".",
                label=LABELS[row],
                linestyle="--" if row.startswith("server-") else "-",
            )
        if target is not None:
            ax.axhline(target, color="grey", linewidth=0.8, linestyle=":", label="target (dense final)")
        ax.set_title(f"{model}, {wan_net.LINKS[link_key].name}", fontsize=9)
        ax.set_xlabel("training wall-clock (s)")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(
    cache: dict,
    s: Settings,
    models: list[str],
    links: list[str],
    rows: list[str],
    lrs_by_model: dict,
    steps: dict,
    out: Path,
    plot_path: Path,
) -> str:
    panels = [
        (m, link, steps[m])
        for m in models
        for link in links
        if f"wan|{m}|{link}|dense|{lrs_by_model[m]['adamw']}|{steps[m]}|{s.nodes}|{s.batches[m]}" in cache
    ]
    lines = [
        "# Time to loss over an emulated WAN",
        "",
        f"Written by `bench/wan.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"({platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, torch threads 1 per node).",
        "",
    ]
    for m, link, st in panels:
        lines += table(cache, s, m, link, rows, lrs_by_model[m], st) + [""]
    lines += [f"![held-out loss against training wall-clock]({plot_path.name})", ""]
    for m in models:
        grid = "; ".join(f"{f} {', '.join(f'{x:g}' for x in LRS[m][f])}" for f in LRS[m])
        lines += [
            f"Learning rates ({m}): the best of {grid} after {s.sweep_steps[m]} steps on the unshaped "
            f"network: " + ", ".join(f"{f} {lr:g}" for f, lr in sorted(lrs_by_model[m].items())) + ".",
            "",
        ]
    text = "\n".join(lines) + "\n"
    plot(cache, s, panels, rows, lrs_by_model, plot_path)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--models", nargs="+", default=["chars10m", "chars"], choices=sorted(STEPS))
    ap.add_argument(
        "--links", nargs="+", default=["100mbit", "1gbit"], choices=[k for k in wan_net.LINKS if k != "none"]
    )
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument(
        "--batch", type=int, nargs="+", help="sequences per node per step, per model (default: chars 8, chars10m 4)"
    )
    ap.add_argument("--steps", type=int, nargs="+", help="dense steps per model (default: chars 256, chars10m 96)")
    ap.add_argument("--sweep-steps", type=int, nargs="+", help="sweep steps per model (default: chars 64, chars10m 32)")
    ap.add_argument("--max-factor", type=float, default=2.0, help="a compressed row stops at this × the dense steps")
    ap.add_argument("--quick", action="store_true", help="the char transformer over 100 Mbit/s only")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--plot", type=Path, default=PLOT)
    ap.add_argument("--log-dir", type=Path, default=ROOT / "bench" / "out" / "wan-logs")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.links = ["chars"], ["100mbit"]
    if "dense" not in args.rows:
        args.rows = ["dense", *args.rows]
    steps = dict(STEPS)
    if args.steps:
        if len(args.steps) != len(args.models):
            ap.error("--steps takes one count per model")
        steps.update(zip(args.models, args.steps))
    sweep_steps = dict(SWEEP_STEPS)
    if args.sweep_steps:
        if len(args.sweep_steps) != len(args.models):
            ap.error("--sweep-steps takes one count per model")
        sweep_steps.update(zip(args.models, args.sweep_steps))
    batches = dict(BATCH)
    if args.batch:
        if len(args.batch) != len(args.models):
            ap.error("--batch takes one count per model")
        batches.update(zip(args.models, args.batch))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    s = Settings(args.nodes, batches, SYNC_EVERY, args.max_factor, sweep_steps, args.log_dir)
    cache = load_cache()
    if not args.report_only:
        try:
            wan_net.check_root()
        except wan_net.NeedsRoot as e:
            print(f"bench/wan.py: {e}", file=sys.stderr)
            return 2
    lrs_by_model = {}
    for m in args.models:
        families = {FAMILY[r] for r in args.rows}
        lrs_by_model[m] = sweep(cache, s, m, families) if not args.report_only else _best_cached(cache, s, m, families)
        if not args.report_only:
            for link in args.links:
                measure(cache, s, m, link, args.rows, lrs_by_model[m], steps[m])
    text = report(cache, s, args.models, args.links, args.rows, lrs_by_model, steps, args.out, args.plot)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists() and "<!-- measured above -->" in args.out.read_text():
        # Keep the hand-written discussion below the marker; replace the measured part above it.
        tail = args.out.read_text().split("<!-- measured above -->", 1)[1]
        text = text + "\n<!-- measured above -->" + tail
    args.out.write_text(text)
    return 0


def _best_cached(cache: dict, s: Settings, model: str, families: set) -> dict:
    steps = s.sweep_steps[model]
    best = {}
    for f in families:
        results = {lr: cache[f"sweep|{model}|{f}|{lr}|{steps}|{s.nodes}|{s.batches[model]}"] for lr in LRS[model][f]}
        best[f] = min(results, key=lambda lr: wan_curves.final_loss(_points(results[lr])))
    return best


if __name__ == "__main__":
    sys.exit(main())
