"""Train a small regression MLP with DeMo (gradwire.torch.DeMo) on every rank of a torchrun job.

    torchrun --nproc-per-node 2 examples/demo_torchrun.py
    torchrun --nproc-per-node 2 examples/demo_torchrun.py --steps 200 --lr 3e-3

Each rank fits its own samples of one teacher network. DeMo sends the DCT top-k of each rank's momentum
(1-bit values, Rice-coded positions), averages all ranks' frames exactly and takes a sign step, so the
ranks hold bit-identical weights after every step; the script checks that at the end and prints the
loss, the bytes this rank sent and the compression ratio against fp32 gradients.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch as gt


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(512, width), nn.Tanh(), nn.Linear(width, 512))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument(
        "--model-record", action="store_true", help="send the whole model as one record (docs/FORMAT.md section 9)"
    )
    args = ap.parse_args()

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

    opt = gt.DeMo(model.parameters(), lr=args.lr, beta=0.999, model_record=args.model_record)
    for step in range(args.steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)

    dense = 4 * sum(p.numel() for p in model.parameters()) * args.steps
    agree = gt.replicas_agree(model)
    if rank == 0:
        print(
            f"bytes sent: {opt.bytes_sent} ({opt.bytes_sent / args.steps:.0f} per step), received: {opt.bytes_received}"
        )
        print(f"compression ratio vs fp32: {dense / opt.bytes_sent:.1f}x")
        print(f"replicas bit-identical: {agree}")
    # Every rank leaves the last collective before any tears gloo down (else one can abort at exit).
    dist.barrier()
    dist.destroy_process_group()
    if not agree:
        raise SystemExit("replicas differ")


if __name__ == "__main__":
    main()
