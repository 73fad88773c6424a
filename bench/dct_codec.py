"""The DCT codec beside DeMo's reference implementation, on the same tensor and threads, in one run.

The issue's case: a 4096×4096 fp32 tensor in 64×64 tiles, top-k per tile for k from 1 to 512 of 4096.

- **gradwire**: ``DCTCodec(mode="tiles", index_coding="rice")``. *encode* is ``codec.encode``: transform,
  top-k, quantization, Rice-coded positions, the CRC-checked frame, and the exact reconstruction that
  error feedback subtracts (what every receiver decodes, bit for bit). *decode* is ``gradwire.decode``
  of the frame: parse, check, Rice decode, the exact decode (docs/FORMAT.md §5.2).
- **DeMo**: bloc97/DeMo ``demo.py``'s ``TransformDCT`` and ``CompressDCT`` rewritten op for op in
  ``bench/demo_reference.py`` (einops' rearranges as reshapes and permutes): int64 indices, fp32 values, no framing.
  *encode* is what its ``step()`` does to send a tensor: ``encode`` (einsum DCT), ``compress`` (top-k of ``|x|``,
  gather) and the transmit estimate it subtracts from the momentum, ``decode(decompress(...))``;
  *decode* is what it does with a received payload: ``decompress`` (``scatter_reduce_`` mean) and
  ``decode`` (einsum inverse DCT). Both sides therefore do one forward and two inverse transforms.

Each (k, method) is timed ``--repeat`` times, interleaved with the other method so both see the same
machine load; the fastest run counts (wall clock, torch's default threads unless ``--threads``). The ratio
column is gradwire's encode + decode over DeMo's; the target is ≤ 1.0× at every k. Bytes are what
would cross the wire (DeMo: int64 + fp32 tensors; gradwire: the whole frame). Runs on the CPU and, where
torch sees a CUDA GPU, on it too.

``--routes`` adds a table per device: the exact decode (``gradwire.dct.decode_levels``) of the same
record by each of its routes ("sparse", "rows", "dense" in float64, "integer" in int64: the same bits, other
times) at every k, and
the route the decoder picks, so the choice can be made by measurement on each kind of device.

Usage: python bench/dct_codec.py [--side 4096] [--topk 1 8 32 128 512] [--repeat 5] [--threads N] [--devices cpu cuda]
           [--routes]
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import gradwire
from demo_reference import CodecReference


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(fn, device: torch.device) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def bench_k(x: torch.Tensor, k: int, repeat: int) -> dict:
    device = x.device
    codec = gradwire.DCTCodec(chunk_shape=(64, 64), topk=k, mode="tiles", index_coding="rice")
    demo = CodecReference(tuple(x.shape), 64, device)
    best = {"gw_enc": float("inf"), "gw_dec": float("inf"), "demo_enc": float("inf"), "demo_dec": float("inf")}
    for _ in range(repeat):  # interleaved: both methods see the same load
        t, frame = run_once(lambda: codec.encode(x), device)
        best["gw_enc"] = min(best["gw_enc"], t)
        t, y = run_once(lambda: gradwire.decode(frame, device=device), device)
        best["gw_dec"] = min(best["gw_dec"], t)
        t, (payload, _) = run_once(lambda: demo.send(x, k), device)
        best["demo_enc"] = min(best["demo_enc"], t)
        t, y_demo = run_once(lambda: demo.receive(payload), device)
        best["demo_dec"] = min(best["demo_dec"], t)
    norm = x.norm().item()
    best["gw_bytes"] = len(frame)
    best["demo_bytes"] = payload[0].numel() * payload[0].element_size() + payload[1].numel() * payload[1].element_size()
    best["gw_err"] = (y - x).norm().item() / norm
    best["demo_err"] = (y_demo - x).norm().item() / norm
    return best


def route_times(x: torch.Tensor, k: int, repeat: int) -> dict:
    """Seconds of the exact decode of ``x``'s record at ``k`` by each route (best of ``repeat``), the bits
    checked equal across routes, and the route the decoder chooses."""
    from gradwire.dct import decode as dd
    from gradwire.dct import parse_record

    device = x.device
    entry, _ = gradwire.DCTCodec(chunk_shape=(64, 64), topk=k, mode="tiles").compress(x)
    p = parse_record(entry, device)
    out, first = {}, None
    for route in ROUTES:
        best = float("inf")
        for _ in range(repeat):
            t, y = run_once(lambda: dd.decode_levels(p.idx, p.levels, p.scales, p.mins, p.plan, route=route), device)
            best = min(best, t)
        if first is None:
            first = y
        elif not torch.equal(first, y):
            raise AssertionError(f"route {route} decoded other bits at k = {k}")
        out[route] = best
    out["chosen"] = dd._choose_route(k, p.plan.chunk_shape, device)
    if device.type != "cpu":  # a device measures both kinds of route once per shape and k bucket: what it kept
        from gradwire.dct import route_choice

        dd.decode_levels(p.idx, p.levels, p.scales, p.mins, p.plan)
        out["chosen"] = route_choice.kept_route(device, p.plan.chunk_shape, k) or out["chosen"]
    return out


#: The exact decode's routes: float64 ("sparse", "rows", "dense") and int64 through int8 digits ("integer").
ROUTES = ("sparse", "rows", "dense", "integer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=4096, help="the tensor is side × side fp32")
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--devices",
        nargs="+",
        choices=["cpu", "cuda"],
        default=None,
        help="where to run (default: the CPU, and a CUDA GPU where torch sees one)",
    )
    ap.add_argument("--routes", action="store_true", help="also time the exact decode's routes per k")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    default = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    devices = [torch.device(d) for d in (args.devices or default)]
    console = Console(width=170)
    for device in devices:
        x = torch.randn(args.side, args.side, generator=torch.Generator().manual_seed(0)).to(device)
        table = Table(
            title=f"DCT codec vs DeMo's reference: {args.side}×{args.side} fp32 on {device.type}, 64×64 tiles, "
            f"{torch.get_num_threads()} threads, best of {args.repeat} interleaved (seconds)"
        )
        for col in (
            "k of 4096",
            "gradwire enc",
            "dec",
            "enc+dec",
            "DeMo enc",
            "dec",
            "enc+dec",
            "× DeMo time",
            "gradwire bytes",
            "DeMo bytes",
            "× DeMo bytes",
            "rel. error gw / DeMo",
        ):
            table.add_column(col, justify="right")
        for k in args.topk:
            console.print(f"[dim]{device.type}: k = {k} …[/dim]")
            r = bench_k(x, k, args.repeat)
            gw, dm = r["gw_enc"] + r["gw_dec"], r["demo_enc"] + r["demo_dec"]
            table.add_row(
                str(k),
                f"{r['gw_enc']:.3f}",
                f"{r['gw_dec']:.3f}",
                f"{gw:.3f}",
                f"{r['demo_enc']:.3f}",
                f"{r['demo_dec']:.3f}",
                f"{dm:.3f}",
                f"{gw / dm:.2f}",
                f"{r['gw_bytes']:,}",
                f"{r['demo_bytes']:,}",
                f"{r['gw_bytes'] / r['demo_bytes']:.2f}",
                f"{r['gw_err']:.3f} / {r['demo_err']:.3f}",
            )
        console.print(table)
        if args.routes:
            routes = Table(
                title=f"Exact decode by route, {args.side}×{args.side} on {device.type} (seconds, best of "
                f"{args.repeat}; the same bits by every route)"
            )
            for col in ("k of 4096", *ROUTES, "fastest", "chosen"):
                routes.add_column(col, justify="right")
            for k in args.topk:
                r = route_times(x, k, args.repeat)
                fastest = min(ROUTES, key=r.get)
                routes.add_row(str(k), *(f"{r[n]:.4f}" for n in ROUTES), fastest, r["chosen"])
            console.print(routes)


if __name__ == "__main__":
    main()
