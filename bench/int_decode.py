"""Float64 ("dense") vs integer (int8 digits through torch._int_mm) exact decode, side by side on this CPU.

    python bench/int_decode.py [--reps N]

Prints ms per decode_level_chunks call for each route and their ratio; both give the same bits.
"""

import argparse
import time

import torch

from gradwire.dct import decode


def _time(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print("| chunk | chunks | k | float64 dense ms | integer ms | integer / float64 |")
    print("|---|---|---|---|---|---|")
    for dims, n, k in [((64,), 4096, 8), ((8, 8), 4096, 8), ((16, 16), 1024, 16), ((64, 64), 64, 32)]:
        c = 1
        for d in dims:
            c *= d
        idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(n)])
        levels = torch.randint(0, 256, (n, k), generator=g)
        scales = torch.rand(n, generator=g) * 1e-2
        mins = -torch.rand(n, generator=g)
        a = _time(lambda: decode.decode_level_chunks(idx, levels, scales, mins, dims, route="dense"), args.reps)
        b = _time(lambda: decode.decode_level_chunks(idx, levels, scales, mins, dims, route="integer"), args.reps)
        print(f"| {'x'.join(map(str, dims))} | {n} | {k} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
