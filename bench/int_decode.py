"""The exact decode's float64 routes against its integer route (int8 digits through one stacked torch._int_mm),
side by side on one device; both give the same bits (checked here too).

    python bench/int_decode.py [--device cpu|cuda] [--reps N]

Prints ms per ``decode_level_chunks`` call of each route and the integer route's ratio to the faster float64
one, and on a GPU the route ``GRADWIRE_EXACT_DECODE=auto`` keeps (gradwire.dct.route_choice). On the CPU
neither runs in training (the Rust folded decode does); the CPU rows say what the integer route costs
where int8 products have no fast kernel.
"""

import argparse

import torch

from gradwire.dct import decode, route_choice


def _time(fn, reps, device):
    fn()
    return min(route_choice.timed(fn, device) for _ in range(reps)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    print(
        f"Exact decode routes on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, best of {args.reps}:\n"
    )
    print("| chunk | chunks | k | sparse ms | rows ms | dense ms | integer ms | integer / best float64 | auto keeps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    cases = [((64,), 4096, 8), ((8, 8), 4096, 8), ((16, 16), 1024, 16), ((64, 64), 256, 32), ((64, 64), 256, 472)]
    for dims, n, k in cases:
        c = 1
        for d in dims:
            c *= d
        idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(n)]).to(device)
        levels = torch.randint(0, 256, (n, k), generator=g).to(device)
        scales = (torch.rand(n, generator=g) * 1e-2).to(device)
        mins = (-torch.rand(n, generator=g)).to(device)
        ms, bits = {}, {}
        for route in ("sparse", "rows", "dense", "integer"):

            def fn(r=route):
                return decode.decode_level_chunks(idx, levels, scales, mins, dims, route=r)

            ms[route] = _time(fn, args.reps, device)
            bits[route] = fn().view(torch.int32).cpu()
        assert all(torch.equal(bits["integer"], b) for b in bits.values()), "routes disagree"
        best = min(ms[r] for r in ("sparse", "rows", "dense"))
        kept = "—"
        if device.type != "cpu":
            decode.decode_level_chunks(idx, levels, scales, mins, dims)
            kept = route_choice.kept_route(device, dims, k) or "?"
        print(
            f"| {'x'.join(map(str, dims))} | {n} | {k} | {ms['sparse']:.1f} | {ms['rows']:.1f} | {ms['dense']:.1f} | "
            f"{ms['integer']:.1f} | {ms['integer'] / best:.2f}x | {kept} |"
        )


if __name__ == "__main__":
    main()
