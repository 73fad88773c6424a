"""DCT positions: bits per index of Rice-coded gaps against the information floor, and the speed of the
index stream beside memcpy, measured in one run.

Table 1, for 64×64 chunks (C = 4096) and k/C from 1/1024 to 1/16: bits per position of
``DCTCodec(index_coding="rice")`` (the whole ``idx`` section, per-tensor parameter included) on
(a) Gaussian noise, whose top-k positions are uniform k-subsets — the case the floor describes — and
(b) real gradients of the character-level transformer (``gradwire_apps.gradients``), whose top-k positions
crowd the low frequencies; beside the floor ``log2(C choose k) / k``, fixed packing (12 bits) and
DeMo's int64 (64 bits).

Table 2: the index stream of 64 MiB of uint32 positions (sets of k of 4096) encoded and decoded by the
Rust kernels through ``gradwire.wire``, in bytes of positions per second, beside a numpy copy of the same
64 MiB (memcpy) and fixed 12-bit packing, best of ``--repeat`` runs. The issue's target is ≥ 0.25×
memcpy. (``cargo bench -p gradwire-core --bench entropy`` measures the kernels without Python.)

Usage: python bench/dct_indices.py [--mib 64] [--repeat 5] [--skip-real]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from gradwire import DCTCodec, wire
from gradwire.dct import unpack_params
from gradwire_apps.progress import progress as progress_bar
from timing import best

C = 4096
RATIOS = (1024, 512, 256, 128, 64, 32, 16)


def floor_bits_per_index(c: int, k: int) -> float:
    return (math.lgamma(c + 1) - math.lgamma(k + 1) - math.lgamma(c - k + 1)) / math.log(2) / k


def rice_bits_per_index(x: torch.Tensor, k: int) -> tuple[float, int]:
    entry, _ = DCTCodec(chunk_shape=(64, 64), topk=k, index_coding="rice").compress(x)
    n = DCTCodec(chunk_shape=(64, 64)).plan(x.shape).num_chunks
    return entry.sections["idx"].nbytes * 8 / (n * k), unpack_params(entry.params)["index_bits"]


def real_gradient(progress: bool) -> torch.Tensor:
    """The char transformer's gradients of a few steps, flattened into one tensor of whole chunks."""
    from gradwire_apps.gradients import collect_gradients

    steps = collect_gradients("char_transformer", steps=8, record_every=4, progress=progress)
    flat = torch.cat([g.reshape(-1) for snap in steps for g in snap.values()])
    return flat[: flat.numel() // C * C].reshape(-1, 64)


def index_sets(n_bytes: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted k-subsets of C filling ``n_bytes`` of uint32: sorted draws from ``[0, C − k]`` plus
    ``0, 1, …, k − 1`` (strictly ascending by construction; near-uniform, which is all a speed test needs)."""
    sets = n_bytes // 4 // k
    draws = np.sort(rng.integers(0, C - k + 1, size=(sets, k), dtype=np.uint32), axis=1)
    return (draws + np.arange(k, dtype=np.uint32)).reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-real", action="store_true", help="leave out the real-gradient column")
    args = ap.parse_args()
    console = Console(width=160)
    rng = np.random.default_rng(0)

    real = None if args.skip_real else real_gradient(progress=True)
    t = Table(title=f"DCT positions: bits per index, 64×64 chunks (C = {C})")
    for col in (
        "k/C",
        "k",
        "floor log2(C choose k)/k",
        "Rice, uniform",
        "Rice / floor",
        "Rice param",
        "Rice, real grads",
        "real / floor",
        "fixed",
        "DeMo int64",
    ):
        t.add_column(col, justify="right")
    for ratio in progress_bar(RATIOS, desc="bits per index", leave=False):
        k = C // ratio
        chunks = max(64, 32768 // k)
        noise = torch.randn((chunks * 64, 64), generator=torch.Generator().manual_seed(ratio))
        floor = floor_bits_per_index(C, k)
        uni, param = rice_bits_per_index(noise, k)
        row = [f"1/{ratio}", str(k), f"{floor:.2f}", f"{uni:.2f}", f"{uni / floor:.3f}", str(param)]
        if real is not None:
            rb, _ = rice_bits_per_index(real, k)
            row += [f"{rb:.2f}", f"{rb / floor:.3f}"]
        else:
            row += ["—", "—"]
        row += ["12", "64"]
        t.add_row(*row)
    console.print(t)

    n_bytes = args.mib << 20
    src = np.ones(n_bytes, np.uint8)
    dst = np.empty_like(src)
    t_copy = best(lambda: np.copyto(dst, src), args.repeat)
    t2 = Table(
        title=f"Index stream of {args.mib} MiB of uint32 positions (sets of k of {C}), bytes of positions per second"
    )
    for col in ("kernel", "k", "GB/s", "× memcpy", "stream bytes / index"):
        t2.add_column(col, justify="right")
    t2.add_row("memcpy (numpy copyto)", "—", f"{n_bytes / t_copy / 1e9:.2f}", "1.00", "—")
    for k in progress_bar((4, 32, 256), desc="index stream speed", leave=False):
        idx = index_sets(n_bytes, k, rng)
        nbytes = idx.nbytes
        param, _ = wire.rice_param(idx, C, set_len=k)
        enc = wire.rice_encode(idx, C, param, set_len=k)
        out = np.empty_like(idx)
        assert np.array_equal(wire.rice_decode(enc, idx.size, C, param, set_len=k, out=out), idx)
        packed = wire.pack_bits(idx, 12)
        out12 = np.empty_like(idx)
        rows = [
            ("Rice encode", lambda: wire.rice_encode(idx, C, param, set_len=k), len(enc)),
            ("Rice decode", lambda: wire.rice_decode(enc, idx.size, C, param, set_len=k, out=out), len(enc)),
            ("fixed 12-bit pack", lambda: wire.pack_bits(idx, 12), len(packed)),
            ("fixed 12-bit unpack", lambda: wire.unpack_bits_exact(packed, 12, idx.size, out=out12), len(packed)),
        ]
        for label, fn, stream in rows:
            sec = best(fn, args.repeat)
            t2.add_row(
                label,
                str(k),
                f"{nbytes / sec / 1e9:.2f}",
                f"{t_copy / sec * nbytes / n_bytes:.2f}",
                f"{stream / idx.size:.3f}",
            )
    console.print(t2)


if __name__ == "__main__":
    main()
