"""DeMo and SparseLoCo on torch.distributed: the sharded exchange against the all-gather, one run.

With ``exchange="all_gather"`` every rank reads (and decodes) every rank's frame, so a rank's downlink
and decode work grow with the world size. With ``exchange="sharded"`` (the default) each rank owns
pieces of the model: it receives every rank's records of its pieces, averages them, re-encodes the mean,
and the owners' frames are all-gathered: about one frame's worth of records in and out per phase
whatever the world size (docs/DISTRIBUTED.md, "DeMo and SparseLoCo: the sharded exchange").

The model (10.5 M parameters by default): eight 1024×1024 layers with biases and a 2048×1024
unembedding-like output matrix, a small batch per rank, so the step is mostly the optimizer's. All
ranks are local gloo processes on this machine's cores. Per optimizer and exchange: seconds per step
(after warm-up steps, every rank's clock between two barriers, the slowest rank's; the best of
--repeat interleaved rounds), the CPU seconds a rank's process spends per step (its threads, gloo's
included; mean over ranks of each rank's best round: on shared cores the steadier measure), bytes per
rank per step sent and received (the optimizers' frame-byte
counters, mean over ranks, and the most any rank received), and the ratios sharded / all-gather
measured in the same run. SparseLoCo syncs at every step here (``sync_every=1``: its default codec
keeps 16 coefficients per 64×64 chunk), so each step holds one exchange. The table also goes to
bench/out/exchange.md.

Usage:
    python bench/exchange.py                      # 8 ranks, 10.5 M parameters (about 2 min on 2 cores)
    options: --ranks N --width W --layers L --vocab V --batch B --steps N --warmup W --repeat R
             --only demo|sparseloco
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch as gt

OPTIMIZERS = ("demo", "sparseloco")
EXCHANGES = ("sharded", "all_gather")


class Model(nn.Module):
    """``layers`` width×width layers with biases (tanh between), then a vocab×width matrix (no bias)."""

    def __init__(self, width: int, layers: int, vocab: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def _optimizer(which: str, exchange: str, model: nn.Module):
    if which == "demo":
        return gt.DeMo(model.parameters(), lr=1e-3, exchange=exchange)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return gt.SparseLoCo(model.parameters(), inner, sync_every=1, exchange=exchange)


def _run(rank: int, world: int, args: dict) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(args["batch"], args["width"], generator=g)
    y = torch.randint(0, args["vocab"], (args["batch"],), generator=g)
    out: dict[str, dict] = {}
    for _ in range(args["repeat"]):
        for which in args["only"]:
            for exchange in EXCHANGES:
                torch.manual_seed(0)
                model = Model(args["width"], args["layers"], args["vocab"])
                opt = _optimizer(which, exchange, model)
                losses = []

                def step():
                    loss = nn.functional.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())

                for _ in range(args["warmup"]):
                    step()
                sent0, received0 = opt.bytes_sent, opt.bytes_received
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args["steps"]):
                    step()
                cpu = (time.process_time() - c0) / args["steps"]
                dist.barrier()
                seconds = (time.perf_counter() - t0) / args["steps"]
                key = f"{which}/{exchange}"
                best = out.get(key, {}).get("seconds", float("inf"))
                out[key] = dict(
                    seconds=min(best, seconds),
                    cpu=min(out.get(key, {}).get("cpu", float("inf")), cpu),
                    sent=(opt.bytes_sent - sent0) / args["steps"],
                    received=(opt.bytes_received - received0) / args["steps"],
                    loss=losses[-1],
                    params=sum(p.numel() for p in model.parameters()),
                )
                model = opt = None  # frees both before gc.collect(); `step` still closes over the names
                gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps per round")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (best time kept)")
    ap.add_argument("--only", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    a = ap.parse_args()
    args = dict(vars(a))
    started = time.perf_counter()
    results = gt.spawn(_run, a.ranks, (args,), timeout_s=1800)
    wall = time.perf_counter() - started

    def row(which, exchange):
        per_rank = [r[f"{which}/{exchange}"] for r in results]
        return dict(
            seconds=max(p["seconds"] for p in per_rank),
            cpu=sum(p["cpu"] for p in per_rank) / len(per_rank),
            sent=sum(p["sent"] for p in per_rank) / len(per_rank),
            received=sum(p["received"] for p in per_rank) / len(per_rank),
            most=max(p["received"] for p in per_rank),
            loss=sum(p["loss"] for p in per_rank) / len(per_rank),
            params=per_rank[0]["params"],
        )

    head = (
        f"{'optimizer':<11} {'exchange':<11} {'s/step':>7} {'× all-gather':>12} {'CPU s/step':>10} "
        f"{'× all-gather':>12} {'sent/step':>11} "
        f"{'× all-gather':>12} {'received/step':>13} {'× all-gather':>12} {'most received':>13} {'loss':>7}"
    )
    lines = [head]
    for which in a.only:
        base = row(which, "all_gather")
        for exchange in EXCHANGES:
            r = row(which, exchange)
            lines.append(
                f"{which:<11} {exchange:<11} {r['seconds']:>7.2f} {r['seconds'] / base['seconds']:>12.2f} "
                f"{r['cpu']:>10.3f} {r['cpu'] / base['cpu']:>12.2f} "
                f"{r['sent']:>11,.0f} {r['sent'] / base['sent']:>12.2f} {r['received']:>13,.0f} "
                f"{r['received'] / base['received']:>12.2f} {r['most']:>13,.0f} {r['loss']:>7.4f}"
            )
    params = row(a.only[0], "sharded")["params"]
    title = (
        f"{a.ranks} gloo ranks, {params:,} parameters ({a.layers} × {a.width}² + {a.vocab}×{a.width}), "
        f"batch {a.batch}, {a.steps} timed steps after {a.warmup}, best of {a.repeat}; run took {wall:.0f} s"
    )
    text = title + "\n\n```\n" + "\n".join(lines) + "\n```\n"
    print(text)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "exchange.md").write_text(text)


if __name__ == "__main__":
    main()
