"""The DCT codec on a large tensor, beside the same work done the DeMo way, measured in one run.

gradwire: 64×64 chunks, top-k per chunk, int8 values, 12-bit packed indices, per-chunk scale and min,
in a CRC-checked frame; encode includes the reconstruction error feedback needs. The DeMo way: the same
transform and top-k, indices as int64 and values in the input dtype, no framing. Both decode by scatter
and inverse transform. Runs on the CPU and, where torch sees a CUDA GPU, on the GPU.

Usage: python bench/dct_codec.py [--numel 100000000] [--topk 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import gradwire
from gradwire.dct import decode_chunks, encode_chunks, plan_flat


def timed(fn, device: torch.device, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def demo_way(x: torch.Tensor, k: int, chunk=(64, 64)):
    """DeMo's payload: per-chunk top-k indices as int64 and values in x's dtype (unquantized)."""
    plan = plan_flat(x.shape, chunk)
    coeffs = encode_chunks(x, plan)
    vals, idx = torch.topk(coeffs.abs(), k, dim=1, sorted=False)
    vals = torch.gather(coeffs, 1, idx)
    payload = (idx.cpu(), vals.cpu())  # what would cross to the host and onto the wire
    return plan, payload


def demo_way_decode(plan, payload, device):
    idx, vals = payload
    return decode_chunks(idx.to(device), vals.to(device), plan)


def bench_device(device: torch.device, numel: int, k: int, repeat: int) -> list[tuple]:
    side = int(numel**0.5)
    shape = (side, numel // side)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    norm = x.norm().item()
    rows = []

    codec = gradwire.DCTCodec(chunk_shape=(64, 64), topk=k)
    t_enc, frame = timed(lambda: codec.encode(x), device, repeat)
    t_dec, y = timed(lambda: gradwire.decode(frame, device=device), device, repeat)
    err = (y - x).norm().item() / norm
    rows.append(("gradwire DCT (int8, 12-bit idx, frame)", t_enc, t_dec, len(frame), err))

    t_enc2, (plan, payload) = timed(lambda: demo_way(x, k), device, repeat)
    nbytes = sum(t.numel() * t.element_size() for t in payload)
    t_dec2, y2 = timed(lambda: demo_way_decode(plan, payload, device), device, repeat)
    err2 = (y2 - x).norm().item() / norm
    rows.append(("DeMo way (int64 idx, fp32 values)", t_enc2, t_dec2, nbytes, err2))
    rows.append(("dense fp32", 0.0, 0.0, x.numel() * 4, 0.0))
    return [(device.type, shape) + r for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    table = Table(title=f"DCT codec: {args.numel / 1e6:.0f} M fp32 elements, 64×64 chunks, k = {args.topk} (best of {args.repeat})")
    for col in ("device", "shape", "method", "encode s", "decode s", "bytes", "× smaller than fp32", "rel. error"):
        table.add_column(col, justify="right")
    for dev in devices:
        rows = bench_device(dev, args.numel, args.topk, args.repeat)
        dense = rows[-1][5]
        for d, shape, name, te, td, nb, err in rows:
            table.add_row(d, "×".join(map(str, shape)), name, f"{te:.2f}" if te else "–", f"{td:.2f}" if td else "–",
                          f"{nb:,}", f"{dense / nb:.1f}", f"{err:.3f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
