"""A whole training step of a GPT-2-shaped model with AdamW, gradwire's DeMo and gradwire's SparseLoCo, side by side.

The optimizer's cost as a share of what a training step costs anyway: forward, backward and the optimizer
step of a GPT-2-small-shaped model (124 M parameters: 12 layers, width 768, 12 heads, 1024 positions, the
50,257-token vocabulary, the output layer tied to the embedding) from random weights, on random tokens,
``--batch`` × ``--seq`` tokens per step, under bf16 autocast (``--autocast none`` for float32).

The model is ``transformers``' ``GPT2LMHeadModel`` built from a ``GPT2Config`` when ``transformers`` is
importable, else the same shapes written here (:class:`GPT2`: pre-LayerNorm blocks, causal
``scaled_dot_product_attention``, GELU MLP); the table says which ran.

Rows, each on its own copy of the same weights and batches, timed interleaved (every repeat runs each row in
turn, so all see the same load):

- **torch AdamW**: ``fused=True`` on a GPU, ``foreach=True`` on the CPU;
- **gradwire DeMo**: ``gradwire.torch.DeMo`` with its defaults, as a group of one (no process group: the
  exchange writes, reads and decodes its frames, no collective moves bytes);
- **gradwire DeMo, overlapped**: ``overlap=True``: each bucket's momentum step, encode and exchange start
  during the backward pass (:mod:`gradwire.torch.overlap`), on a side stream on a GPU and worker threads on
  the CPU;
- **gradwire SparseLoCo**: with an inner AdamW as above and its defaults (a sync every 8 steps): the mean
  step over whole cycles.

Per row: milliseconds per step (the fastest of ``--repeat``, as ``bench/timing.py`` takes it; SparseLoCo: of
whole cycles, per step), its ratio to
AdamW, and on a GPU the peak memory. The issue's target is printed as met / missed: the step with DeMo or
SparseLoCo ≤ 1.10× the step with AdamW (stretch 1.05×). And how much of the exchange the overlap hides:
``(DeMo − DeMo overlapped) / (DeMo − AdamW)``, the share of what DeMo adds to a step that no longer
delays it.

Usage: python bench/train_step.py [--device cuda] [--batch 8] [--seq 1024] [--repeat 3] [--rows adamw demo ...]
       [--layers 12 --width 768 --heads 12 --vocab 50257] [--autocast bf16|none]
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import gradwire.torch as gt


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2's shapes (the output layer tied to the token embedding); logits out."""

    def __init__(self, vocab: int, positions: int, layers: int, width: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def build_model(a) -> tuple[nn.Module, str]:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return GPT2(a.vocab, a.seq, a.layers, a.width, a.heads), "GPT-2 shapes written in bench/train_step.py"
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.width, n_layer=a.layers, n_head=a.heads)
    return GPT2LMHeadModel(cfg), "transformers GPT2LMHeadModel from a GPT2Config"


def _logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    return out.logits if hasattr(out, "logits") else out


def make_optimizer(row: str, model: nn.Module, device: torch.device):
    params = list(model.parameters())

    def adamw():
        if device.type == "cuda":
            return torch.optim.AdamW(params, lr=1e-4, fused=True)
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)

    if row == "adamw":
        return adamw()
    if row == "demo":
        return gt.DeMo(params, lr=1e-4)
    if row == "demo_overlap":
        return gt.DeMo(params, lr=1e-4, overlap=True)
    return gt.SparseLoCo(params, adamw())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Row:
    def __init__(self, row: str, base: nn.Module, device: torch.device, autocast: bool):
        self.row, self.device, self.autocast = row, device, autocast
        self.model = copy.deepcopy(base)
        self.opt = make_optimizer(row, self.model, device)
        self.cycle = self.opt.sync_every if row == "sparseloco" else 1
        self.ms: list[float] = []
        self.peak = 0
        self.loss = float("nan")

    def step(self, idx: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = _logits(self.model, idx[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = float(loss.detach())

    def timed(self, batches: list[torch.Tensor]) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        for i in range(self.cycle):
            self.step(batches[i % len(batches)])
        _sync(self.device)
        self.ms.append(1e3 * (time.perf_counter() - t0) / self.cycle)
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))


NAMES = {
    "adamw": "torch AdamW",
    "demo": "gradwire DeMo",
    "demo_overlap": "gradwire DeMo, overlapped",
    "sparseloco": "gradwire SparseLoCo, mean step",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (and the model's positions)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--autocast", choices=["bf16", "none"], default="bf16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--rows",
        nargs="+",
        choices=list(NAMES),
        default=list(NAMES),
        help="the rows to run (AdamW, the baseline, always runs)",
    )
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    torch.manual_seed(0)
    base, kind = build_model(a)
    base = base.to(device)
    numel = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen).to(device) for _ in range(8)]
    names = ["adamw"] + [r for r in NAMES if r in a.rows and r != "adamw"]
    rows = [Row(r, base, device, a.autocast == "bf16") for r in names]
    for r in rows:  # warm-up: a whole cycle each, state allocated, kernels chosen
        r.timed(batches)
        r.ms.clear()
    for _ in range(a.repeat):
        for r in rows:
            r.timed(batches)
            print(f"{r.row:12s} {r.ms[-1]:9.1f} ms / step", flush=True)
    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"the CPU ({torch.get_num_threads()} threads)"
    )
    base_ms = min(rows[0].ms)
    lines = [
        f"A training step on {where}, torch {torch.__version__}: {kind}, {numel / 1e6:.1f} M parameters, "
        f"batch {a.batch} × {a.seq} tokens, autocast {a.autocast}, fastest of {a.repeat} interleaved.",
        "",
        "| optimizer | ms / step | × AdamW | peak memory, MiB | loss after |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = min(r.ms)
        peak = f"{r.peak / 2**20:,.0f}" if device.type == "cuda" else "—"
        lines.append(f"| {NAMES[r.row]} | {ms:.1f} | {ms / base_ms:.3f} | {peak} | {r.loss:.3f} |")
    lines.append("")
    for r in rows[1:]:
        ratio = min(r.ms) / base_ms
        verdict = "met (stretch met)" if ratio <= 1.05 else "met" if ratio <= 1.10 else "missed"
        lines.append(
            f"target training step with {NAMES[r.row]} / with AdamW: {ratio:.3f}× (≤ 1.10×, stretch 1.05×) — {verdict}"
        )
    ms = {r.row: min(r.ms) for r in rows}
    if "demo" in ms and "demo_overlap" in ms:
        added = ms["demo"] - ms["adamw"]
        hidden = (ms["demo"] - ms["demo_overlap"]) / added if added > 0 else float("nan")
        lines.append(
            f"overlap: DeMo adds {added:.1f} ms to a step without overlap and "
            f"{ms['demo_overlap'] - ms['adamw']:.1f} ms with it: {100 * hidden:.0f} % of it hidden"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
