"""Gradient exchanges on torch.distributed, side by side: DDP's all-reduce, torch's fp16 and PowerSGD
hooks, gradwire's DCT hook (overlapped with backward, and blocking), PowerSGD and 3LC hooks, low-precision
decentralized SGD, and the DeMo and SparseLoCo optimizers (no DDP: their own frame exchange in
``step()``), on local gloo ranks, the same model, data, seed and number of steps for each.

Per configuration: steps per second (after a few warm-up steps, all ranks sharing this machine's
cores; the best of --repeat interleaved runs) and its ratio to plain DDP's and to torch's fp16 hook's
in the same run, the bytes each rank contributes per step (what it puts into the collectives, averaged
over every step, the dense warm-up of the PowerSGDs included; for decentralized SGD its frame, which
each of its two ring peers receives; for DeMo and SparseLoCo their frames plus the length word,
SparseLoCo's spread over the --sync-every local steps between syncs), how much smaller that is than
fp32, and the training loss (mean over ranks of the last 10 steps, or of all timed steps when fewer).
The table goes to bench/out/ddp.md (ddp_small.md with --small), loss curves to bench/out/ddp_loss.png
(ddp_small_loss.png).

The model is an MLP on scikit-learn's 8×8 digits: 64 → --hidden × --layers → 10. The default run is
the issue's comparison at model scale: four 1824-wide hidden layers (10.1 M parameters) on 2 ranks,
8 steps (2 untimed), best of 2 (about 3 min on 2 shared cores): no hook, fp16, torch's PowerSGD,
gradwire's DCT hook, DeMo, SparseLoCo (sync every 3 steps, so the 6 timed steps hold 2 syncs).
``--small`` is the digits MLP with two 512-wide hidden layers (301,066 parameters) on 2 and 4 ranks,
150 steps, every exchange. DDP buckets are --bucket-mb (DDP's default 25 MB) for every hook but torch's
PowerSGD, which gets the whole model in one bucket: it launches its second all-reduce from a future
callback, and on gloo callbacks of two buckets interleave differently on different ranks (mismatched
collectives abort the run). gradwire's DCT hook launches every collective from the hook itself and
overlaps each bucket's exchange and decode with the rest of backward; "blocking" (key dct/blocking) is
the same hook with ``overlap=False``, each bucket finished inside its hook as before the overlap.

Usage:
    python bench/ddp.py                                   # 10.1 M parameters, 2 ranks (~3 min)
    python bench/ddp.py --only none dct dct/blocking      # overlap against blocking, same run
    python bench/ddp.py --small                           # 301 k parameters, 2 and 4 ranks, every exchange
    options: --steps N --warmup W --ranks 2 4 --hidden H --layers L --batch B --repeat R --bucket-mb MB
             --sync-every H --only KEY... (first key: the "× no hook" baseline)
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwire.torch as gt
from gradwire_apps.demo.tasks import digits_mlp, load_digits

# (key, label): the key is a register_hook name (with "/param" for per-parameter records, "/blocking"
# for overlap=False), "decentralized", "demo" or "sparseloco".
CONFIGS = [
    ("none", "DDP, no hook"),
    ("fp16", "fp16 hook (torch)"),
    ("torch-powersgd", "PowerSGD rank 2 (torch)"),
    ("powersgd", "PowerSGD rank 2 (gradwire)"),
    ("dct", "DCT 64×64 top-32 hook"),
    ("dct/blocking", "DCT 64×64 top-32 hook, blocking"),
    ("3lc", "3LC hook"),
    ("3lc/param", "3LC hook, per parameter"),
    ("decentralized", "decentralized, MinMax uint8 ring"),
    ("demo", "DeMo optimizer (no DDP)"),
    ("sparseloco", "SparseLoCo optimizer (no DDP)"),
]
SCALE_KEYS = ["none", "fp16", "torch-powersgd", "dct", "demo", "sparseloco"]
OUT = Path(__file__).resolve().parent / "out"


def make_mlp(hidden: int, layers: int) -> nn.Module:
    """64 → hidden × layers → 10 with ReLUs (two layers: the demo app's digits MLP)."""
    if layers == 2:
        return digits_mlp(hidden)
    mods: list[nn.Module] = [nn.Linear(64, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(hidden, 10))


def run_rank(rank: int, world: int, what: str, steps: int, opts: dict) -> dict:
    warmup = opts["warmup"]
    data = load_digits(0)
    mine = torch.arange(rank, len(data.y_train), world)
    x, y = data.x_train[mine], data.y_train[mine]
    torch.manual_seed(0)
    model = make_mlp(opts["hidden"], opts["layers"])
    lr = opts["lr"]
    name, _, mode = what.partition("/")
    net, algo, traffic = model, None, None
    if what == "decentralized":
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        algo = gt.LowPrecisionDecentralized(model, opt)
    elif what == "demo":
        opt = gt.DeMo(model.parameters(), lr=lr)
    elif what == "sparseloco":
        inner = torch.optim.AdamW(model.parameters(), lr=lr)
        opt = gt.SparseLoCo(model.parameters(), inner, sync_every=opts["sync_every"])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        # torch's powerSGD_hook issues its later all-reduces from future callbacks, which on gloo
        # interleave differently across ranks once there are two buckets (a collective mismatch that
        # aborts): it gets the whole model in one bucket.
        dense_mb = 4 * sum(p.numel() for p in model.parameters()) / 2**20
        cap = dense_mb + 1 if name == "torch-powersgd" else opts["bucket_mb"]
        net = DistributedDataParallel(model, bucket_cap_mb=cap)
        options = dict(per_parameter=True) if mode == "param" else dict(overlap=False) if mode == "blocking" else {}
        traffic = gt.register_hook(net, name, powersgd_rank=2, start_iter=warmup, **options)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(steps):
        if step == warmup:
            dist.barrier()
            start = time.perf_counter()
        idx = torch.randint(0, len(y), (opts["batch"],), generator=g)
        loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        algo.step() if algo is not None else opt.step()
        losses.append(loss.item())
    dist.barrier()
    elapsed = time.perf_counter() - start
    mean_losses = torch.tensor(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    dense = 4 * sum(p.numel() for p in model.parameters())
    if what == "decentralized":
        sent = algo.frame_bytes_per_step() + 8
    elif what == "demo":
        sent = opt.bytes_sent / steps + 8
    elif what == "sparseloco":
        sent = (opt.bytes_sent + 8 * opt.syncs) / steps
    else:
        sent = traffic.bytes_per_step()
    return dict(
        steps_per_s=(steps - warmup) / elapsed,
        bytes_per_step=sent,
        dense_bytes=dense,
        losses=mean_losses.tolist(),
    )


def run_round(rank: int, world: int, keys: list, steps: int, opts: dict, round_label: str) -> list:
    """Every configuration in ``keys``, one after the other, in the same processes and process group.

    One spawn per round instead of one per configuration: forking the ranks and building the group cost
    seconds each, more than the timed steps of a fast exchange at this size.
    """
    out = []
    started = time.perf_counter()
    for key in keys:
        r = run_rank(rank, world, key, steps, opts)
        slowest = torch.tensor([r["steps_per_s"]], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
        if rank == 0:
            # Progress as plain lines, so it shows when the output is a file or a pipe too.
            print(
                f"{round_label} {world} ranks, {dict(CONFIGS)[key]}: {slowest.item():.2f} steps/s"
                f" (round at {time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        out.append(r)
        gc.collect()
    return out


def plot(results: dict, labels: dict, steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({w for _, w in results})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        for (key, w), r in results.items():
            if w == world:
                curve = torch.tensor(r["losses"])
                smooth = torch.nn.functional.avg_pool1d(curve[None, None], 9, 1, 4, count_include_pad=False)[0, 0]
                ax.plot(range(steps), smooth.tolist(), label=labels[key])
        ax.set_title(f"{world} gloo ranks: training loss (mean over ranks, smoothed)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--small",
        action="store_true",
        help="301 k parameters (--hidden 512 --layers 2), 2 and 4 ranks, 150 steps, every exchange",
    )
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 8; 150 with --small)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; 5 with --small)")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (default 2; 2 4 with --small)")
    ap.add_argument(
        "--hidden", type=int, default=None, help="width of the MLP's hidden layers (1824; 512 with --small)"
    )
    ap.add_argument("--layers", type=int, default=None, help="hidden layers (4; 2 with --small)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--repeat", type=int, default=2, help="runs per configuration (best speed kept)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap (torch's PowerSGD: one bucket)")
    ap.add_argument(
        "--sync-every", type=int, default=None, help="SparseLoCo's local steps between syncs (3; 10 with --small)"
    )
    ap.add_argument("--only", nargs="+", default=None, help="configuration keys to run (first one is the baseline)")
    args = ap.parse_args()
    small = args.small
    steps = args.steps or (150 if small else 8)
    warmup = args.warmup if args.warmup is not None else (5 if small else 2)
    ranks = args.ranks or ([2, 4] if small else [2])
    opts = dict(
        hidden=args.hidden or (512 if small else 1824),
        layers=args.layers or (2 if small else 4),
        batch=args.batch,
        lr=args.lr,
        bucket_mb=args.bucket_mb,
        sync_every=args.sync_every or (10 if small else 3),
        warmup=warmup,
    )
    labels = dict(CONFIGS)
    keys = args.only or ([k for k, _ in CONFIGS] if small else SCALE_KEYS)
    unknown = [k for k in keys if k not in labels]
    if unknown:
        ap.error(f"unknown configuration {unknown}; known: {', '.join(labels)}")
    if steps <= warmup or warmup < 2:
        # torch's PowerSGD runs at least 2 dense steps (DDP's bucket rebuild): keep them untimed.
        ap.error(f"need --warmup >= 2 and --steps > --warmup (got {warmup} and {steps})")

    # Every configuration runs --repeat times, the rounds interleaved (each round runs every
    # configuration once, in one spawn of the ranks), and keeps its best speed: other load on a shared
    # machine then hits all configurations alike. Bytes and losses are deterministic.
    results: dict = {}
    console = Console(width=170)
    started = time.perf_counter()
    for i in range(args.repeat):
        for world in ranks:
            label = f"[round {i + 1}/{args.repeat}, started at {time.perf_counter() - started:.0f} s]"
            per_rank = gt.spawn(run_round, world, (keys, steps, opts, label), backend="gloo", timeout_s=600.0)
            for j, key in enumerate(keys):
                r0 = per_rank[0][j]
                r0["steps_per_s"] = min(r[j]["steps_per_s"] for r in per_rank)
                r0["bytes_per_step"] = max(r[j]["bytes_per_step"] for r in per_rank)
                best = results.get((key, world))
                if best is not None:
                    r0["steps_per_s"] = max(r0["steps_per_s"], best["steps_per_s"])
                results[(key, world)] = r0

    params = next(iter(results.values()))["dense_bytes"] // 4
    title = (
        f"MLP 64→{opts['hidden']}×{opts['layers']}→10 ({params:,} parameters), {steps} steps ({warmup} untimed),"
        f" batch {args.batch} per rank, AdamW lr {args.lr} (DeMo: lr {args.lr}; SparseLoCo: AdamW inner,"
        f" sync every {opts['sync_every']}), DDP buckets {args.bucket_mb:g} MB, gloo on one host with"
        f" {os.cpu_count()} cores, best of {args.repeat} interleaved"
    )
    fp16 = "fp16" if "fp16" in keys else None
    columns = ["ranks", "exchange", "steps/s", f"× {labels[keys[0]]}"] + ([f"× {labels[fp16]}"] if fp16 else [])
    columns += ["bytes/step per rank", "× smaller than fp32", "loss"]
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col == "exchange" else "right")
    md = [
        f"# bench/ddp.py{' --small' if small else ''}",
        "",
        title,
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for world in ranks:
        base = results[(keys[0], world)]["steps_per_s"]
        for key in keys:
            r = results[(key, world)]
            last = r["losses"][-min(10, steps - warmup) :]
            row = [str(world), labels[key], f"{r['steps_per_s']:.2f}", f"{r['steps_per_s'] / base:.2f}"]
            if fp16:
                row.append(f"{r['steps_per_s'] / results[(fp16, world)]['steps_per_s']:.2f}")
            row += [
                f"{r['bytes_per_step']:,.0f}",
                f"{r['dense_bytes'] / r['bytes_per_step']:.1f}",
                f"{sum(last) / len(last):.4f}",
            ]
            table.add_row(*row)
            md.append("| " + " | ".join(row) + " |")
        table.add_section()
    console.print(table)
    stem = "ddp_small" if small else "ddp"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{stem}.md").write_text("\n".join(md) + "\n")
    plot(results, labels, steps, OUT / f"{stem}_loss.png")
    console.print(f"wrote {OUT / f'{stem}.md'} and {OUT / f'{stem}_loss.png'} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
