"""Train a small regression MLP with SparseLoCo (gradwire.torch.SparseLoCo) on a torchrun job.

    torchrun --nproc-per-node 2 examples/sparseloco_torchrun.py
    torchrun --nproc-per-node 2 examples/sparseloco_torchrun.py --sync-every 16 --nesterov

Each rank trains alone with AdamW on its own samples of one teacher network and, every ``--sync-every``
steps, sends its compressed pseudo-gradient (top-k DCT, 2-bit values, with a decaying error buffer);
all ranks average the frames exactly and take the same outer step, so they hold bit-identical weights
after each sync. The script checks that at the end and prints the loss, the bytes this rank sent and
the compression ratio per local step against fp32.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch as gt
from gradwire.algorithms import DEFAULT_SYNC_EVERY


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(512, width), nn.Tanh(), nn.Linear(width, 512))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=128, help="local steps (a multiple of --sync-every)")
    ap.add_argument(
        "--sync-every",
        type=int,
        default=DEFAULT_SYNC_EVERY,
        help=f"local steps per sync (default {DEFAULT_SYNC_EVERY}, the library's)",
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--nesterov", action="store_true", help="DiLoCo's outer Nesterov momentum 0.9, outer lr 0.7")
    ap.add_argument(
        "--model-record", action="store_true", help="send the whole model as one record (docs/FORMAT.md section 9)"
    )
    args = ap.parse_args()
    if args.steps % args.sync_every:
        raise SystemExit("--steps must be a multiple of --sync-every (replicas agree after a sync)")

    try:
        rank, world = gt.init_from_env("gloo")
    except gt.NoLauncherError as exc:  # started without torchrun: a usage error, not a traceback
        print(f"{exc}", file=sys.stderr)
        raise SystemExit(2) from None
    model = make_model(args.width)
    teacher = make_model(64)
    g = torch.Generator().manual_seed(rank + 1)  # each rank its own data
    x = torch.randn(256, 512, generator=g)
    with torch.no_grad():
        y = teacher(x)

    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    outer = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True) if args.nesterov else {}
    opt = gt.SparseLoCo(model.parameters(), inner, sync_every=args.sync_every, model_record=args.model_record, **outer)
    for step in range(args.steps):
        loss = nn.functional.mse_loss(model(x), y)
        if rank == 0 and step == 0:
            print(f"step    0  loss {loss.item():.5f}", flush=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % args.sync_every == 0:
            if opt.syncs == 1:
                print(
                    "loss on rank 0's samples: its own replica just before a sync, then the synced model (the "
                    "replica fits rank 0's samples alone; the synced model averages every rank's, so it fits "
                    "them less closely)",
                    flush=True,
                )
            with torch.no_grad():
                synced = nn.functional.mse_loss(model(x), y).item()
            print(f"step {step + 1:4d} (sync {opt.syncs})  replica {loss.item():.5f}  synced {synced:.5f}", flush=True)

    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y).item()
    dense = 4 * sum(p.numel() for p in model.parameters()) * args.steps
    agree = gt.replicas_agree(model)
    if rank == 0:
        print(f"final loss of the synced model on rank 0's samples: {final:.5f}")
        print(
            f"bytes sent: {opt.bytes_sent} ({opt.bytes_sent / max(1, opt.syncs):.0f} per sync), "
            f"received: {opt.bytes_received}"
        )
        print(f"compression ratio vs fp32 per local step: {dense / opt.bytes_sent:.1f}x")
        print(f"replicas bit-identical: {agree}")
    # Every rank leaves the last collective before any tears gloo down (else one can abort at exit).
    dist.barrier()
    dist.destroy_process_group()
    if not agree:
        raise SystemExit("replicas differ")


if __name__ == "__main__":
    main()
