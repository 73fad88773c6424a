"""DeMo's bytes on transformers' GPT-2 (6.8 M parameters, random weights): where the ratio goes, per tensor.

DeMo's default codec keeps 32 DCT coefficients per chunk at 1 bit each; a full 64×64 tile then costs
about 1/300 of its fp32 bytes. A model's ratio is lower where its chunks are smaller or its tensors 1-D:
the tile side is the largest divisor of a dimension up to 64, and GPT-2's 50,257-row embedding (tied to
the head, 94 % of this model) gets 29-row tiles (50,257 = 29 × 1,733) — 1,856 elements, still 32
coefficients each; every bias and LayerNorm vector pays a record's header for 128 elements. A whole-model
record (``model_record=True``) cuts the flattened model into flat 64×64 chunks instead.

Prints, for one process (a group of one, so the ratio is the uplink's), the bytes each tensor's record
takes with the default codec on a real momentum after a few steps (grouped: the embedding, the 2-D
weights, the 1-D vectors), and DeMo's measured ratio against fp32 over the same steps with
``model_record`` off and on, side by side. Needs ``transformers`` (``pip install transformers``: in no extra, for its
weight).

Usage:
    python bench/gpt2_bytes.py            # about a minute on 2 idle cores
    options: --steps N --embd D --layers L --vocab V
"""

from __future__ import annotations

import argparse

import torch

import gradwire.torch as gt
from gradwire.algorithms import default_demo_codec
from gradwire.frame import write_frame


def gpt2(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=args.embd, n_layer=args.layers, n_head=2, n_positions=128, vocab_size=args.vocab)
    return GPT2LMHeadModel(cfg)


def train(model, opt, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, model.config.vocab_size, (8, 64), generator=g)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50257)
    args = ap.parse_args()

    model = gpt2(args)
    numel = sum(p.numel() for p in model.parameters())
    print(f"GPT-2: {numel / 1e6:.2f} M parameters, {args.steps} DeMo steps (lr 1e-3), one process\n")

    # Per tensor: the record of each momentum after the steps, alone in a frame, with the default codec.
    opt = gt.DeMo(model.named_parameters(), lr=1e-3, exchange="all_gather")
    train(model, opt, args.steps)
    codec = default_demo_codec()
    groups: dict[str, list[int]] = {}
    names = dict(zip((f"g0.p{i}" for i in range(10**6)), (n for n, _ in model.named_parameters())))
    for pos, m in opt.node.momenta.items():
        name = names[pos]
        plan = codec.plan(tuple(m.shape))
        nbytes = len(write_frame([codec.compress(m, pos)[0]], round=0, sender=0, bundle=True))
        kind = (
            "embedding (tied head)" if name.endswith("wte.weight") else "2-D weights" if m.ndim == 2 else "1-D vectors"
        )
        g = groups.setdefault(kind, [0, 0, 0, ""])
        g[0] += m.numel()
        g[1] += nbytes
        g[2] += 1
        g[3] = g[3] or f"{plan.chunk_shape} ({'tiles' if plan.mode == 1 else 'flat'})"
    total_elems = sum(g[0] for g in groups.values())
    total_bytes = sum(g[1] for g in groups.values())
    print("| tensors | count | share of parameters | chunk | bytes per step | ratio vs fp32 |")
    print("|---|---:|---:|---|---:|---:|")
    for kind, (elems, nbytes, count, chunk) in groups.items():
        print(
            f"| {kind} | {count} | {100 * elems / total_elems:.1f} % | {chunk} | {nbytes:,} "
            f"| {4 * elems / nbytes:.0f}× |"
        )
    print(
        f"| all | {sum(g[2] for g in groups.values())} | 100 % | | {total_bytes:,} "
        f"| {4 * total_elems / total_bytes:.0f}× |\n"
    )

    # The optimizer's own counters, per tensor against one model record, same steps and data.
    print("| DeMo | bytes per step | ratio vs fp32 |")
    print("|---|---:|---:|")
    ratios = {}
    for label, kw in (("per tensor (default)", {}), ("model_record=True", {"model_record": True})):
        model = gpt2(args)
        opt = gt.DeMo(model.parameters(), lr=1e-3, **kw)
        train(model, opt, args.steps)
        ratios[label] = 4 * numel * args.steps / opt.bytes_sent
        print(f"| {label} | {opt.bytes_sent / args.steps:,.0f} | {ratios[label]:.0f}× |")
    a, b = ratios.values()
    print(f"\nmodel_record=True / per tensor: {b / a:.2f}× the ratio")


if __name__ == "__main__":
    main()
