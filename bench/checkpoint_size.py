"""What a DeMo or SparseLoCo checkpoint weighs next to the model, part by part (one process, fp32 or bf16).

SparseLoCo's ``state_dict()`` holds, besides counters: the inner optimizer's state (AdamW: two moments in
the parameters' dtype), the anchor (the weights at the last sync, float32: the outer step is applied to
it exactly), the error buffers (float32), the outer momentum (float32, with ``outer_momentum > 0``) and,
sharded, the owner's error feedback (float32, this rank's pieces: about 1/world of the model). Each is
a model's worth, so with fp32 weights the checkpoint is about 4× the model (5× with outer momentum),
and with bf16 weights about 7× (AdamW's moments in bf16, the rest in float32). DeMo keeps one float32
momentum per parameter (1× an fp32 model).

Prints the model's bytes and each optimizer's checkpoint bytes (torch.save), per part, side by side,
on the GPT-style test model widened to about 1 M parameters, after a few steps (every buffer exists).

Usage:
    python bench/checkpoint_size.py       # a few seconds
    options: --dtype float32|bfloat16 --width W
"""

from __future__ import annotations

import argparse
import io

import torch
from torch import nn

import gradwire.torch as gt


def nbytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return len(buf.getvalue())


def model(width: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Embedding(512, width)] + [nn.Linear(width, width) for _ in range(4)] + [nn.LayerNorm(width)]
    return nn.Sequential(*layers).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--width", type=int, default=448)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    rows = []
    base = None
    for label, build in (
        ("DeMo", lambda m: gt.DeMo(m.parameters(), lr=1e-3)),
        (
            "SparseLoCo",
            lambda m: gt.SparseLoCo(m.parameters(), torch.optim.AdamW(m.parameters(), lr=1e-3), sync_every=2),
        ),
        (
            "SparseLoCo, outer_momentum=0.9",
            lambda m: gt.SparseLoCo(
                m.parameters(),
                torch.optim.AdamW(m.parameters(), lr=1e-3),
                sync_every=2,
                outer_momentum=0.9,
                nesterov=True,
            ),
        ),
    ):
        m = model(args.width, dtype)
        opt = build(m)
        x = torch.randint(0, 512, (16,))
        for _ in range(3):  # after a sync and a local step: every buffer exists
            opt.zero_grad()
            m(x).float().square().mean().backward()
            opt.step()
        base = nbytes(m.state_dict())
        state = opt.state_dict()
        # Per-parameter state (torch's "state": momentum, error, anchor, outer momentum, the inner
        # optimizer's "inner.*"), grouped by kind; then the dict parts of "gradwire" (the owner's residual).
        kinds: dict[str, dict] = {}
        for i, fields in state["state"].items():
            for k, v in fields.items():
                if isinstance(v, torch.Tensor) and v.ndim:
                    kinds.setdefault("inner" if k.startswith("inner.") else k, {})[f"{i}.{k}"] = v
        parts = {k: nbytes(v) for k, v in kinds.items()}
        parts.update({k: nbytes(v) for k, v in state["gradwire"].items() if isinstance(v, dict)})
        rows.append((label, nbytes(state), parts))

    numel = sum(p.numel() for p in model(args.width, dtype).parameters())
    print(f"model: {numel / 1e6:.2f} M parameters, {args.dtype}, state_dict {base:,} bytes\n")
    print("| optimizer | checkpoint bytes | × the model | its parts (× the model) |")
    print("|---|---:|---:|---|")
    for label, total, parts in rows:
        detail = ", ".join(f"{k} {v / base:.2f}" for k, v in parts.items() if v > 4096)
        print(f"| {label} | {total:,} | {total / base:.2f}× | {detail} |")


if __name__ == "__main__":
    main()
