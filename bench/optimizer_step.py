"""One optimizer step of gradwire's DeMo and SparseLoCo beside ``torch.optim.AdamW`` and DeMo's reference, on the
CPU or a GPU.

What a training job pays per step for the optimizer itself, on one rank: the gradients are given (random,
the same for every row), so the times hold no forward or backward pass. A one-rank process group
(gloo on the CPU, NCCL on a GPU) runs the optimizers' real exchange code (the sharded exchange by
default: pieces, exact mean, re-encoding, the frames), but with a single rank the collectives move
no data between processes, so the figures are the compute a step costs, not the network.

Models (``--models``):

- **linear**: width×width ``nn.Linear`` layers with biases (width 1024; 4096 from 50 M up), as many as make
  ``--params`` (10 M → 10.5 M parameters in 20 tensors);
- **many**: the many-tensor case, 48 layers of 256×256 with biases: 3.2 M parameters in 96 tensors;
- **mlp**: a 1 M-parameter MLP, 512 → 1024 → 512 (4 tensors).

Rows, each on its own copy of the same parameters and gradients:

- **torch AdamW (foreach)**: ``torch.optim.AdamW(params, lr, foreach=True)``, the baseline of the × AdamW column;
- **torch AdamW (fused)** (on a GPU only): ``fused=True``, the baseline of the × fused column;
- **DeMo reference**: bloc97/DeMo ``demo.py``'s ``DeMo`` rewritten op for op (``bench/demo_reference.py``),
  its defaults (top-32 of each 64×64 chunk), all-gathering through the same one-rank group;
- **gradwire DeMo**: ``gradwire.torch.DeMo`` with its defaults;
- **gradwire SparseLoCo, per step**: ``gradwire.torch.SparseLoCo`` with an inner ``torch.optim.AdamW`` of the
  baseline's kind (foreach on the CPU, fused on a GPU, where its target is taken against fused AdamW) and its
  defaults (a sync every 8 steps): the mean over a whole cycle of local steps and one sync;
- **gradwire SparseLoCo, the sync step**: the one step in 8 that encodes, exchanges and applies the outer step.

The rows are timed interleaved: each repeat steps every row once (SparseLoCo: its local steps, then its
sync step, timed apart), so all rows see the same machine load. Per row: milliseconds per step (the
median of ``--repeat`` after warm-up; ``--fastest`` takes the fastest instead, the least disturbed on a
shared machine as in ``bench/timing.py``; the device synchronized around each), its ratios to AdamW and to
the reference measured in the same run, and on a GPU the memory a row holds and allocates beyond its
parameters and gradients. The issue's targets are printed as met / missed lines. The table also goes to
``docs/results/optimizer-step.md``, dated (``--out``).

Usage: python bench/optimizer_step.py [--device cpu|cuda] [--params 10M,100M] [--models linear,many,mlp]
       [--repeat 5] [--fastest] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradwire.torch as gt
from demo_reference import DeMoReference

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "optimizer-step.md"
WIDTH = 1024
MODELS = ("linear", "many", "mlp")
SUFFIX = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9}


def parse_sizes(tokens: list[str]) -> list[float]:
    """``["10M,100M"]`` or ``["10e6", "1.1e6"]`` → parameter counts."""
    out = []
    for token in tokens:
        for t in filter(None, token.split(",")):
            out.append(float(t[:-1]) * SUFFIX[t[-1]] if t[-1] in SUFFIX else float(t))
    return out


def build_model(kind: str, params: float, device: torch.device) -> nn.Module:
    if kind == "linear":
        width = WIDTH if params < 50e6 else 4 * WIDTH
        layers = max(1, round(params / (width * width + width)))
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device)
    if kind == "many":
        return nn.Sequential(*(nn.Linear(256, 256) for _ in range(48))).to(device)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512)).to(device)
    raise ValueError(f"unknown model {kind!r}; one of {', '.join(MODELS)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(row: str, model: nn.Module):
    params = list(model.parameters())
    if row == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if row == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if row == "reference":
        return DeMoReference(params, lr=1e-3)
    if row == "demo":
        return gt.DeMo(params, lr=1e-3)
    if row == "sparseloco":
        # The inner AdamW is the baseline's own kind: foreach on the CPU, fused on a GPU.
        fused = params[0].device.type == "cuda"
        inner = torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
        return gt.SparseLoCo(params, inner)
    raise ValueError(row)


class Row:
    """One optimizer on its own copy of the model, warmed up; :meth:`time_once` times one step (or one
    SparseLoCo cycle: local steps and sync apart)."""

    def __init__(self, row: str, base: nn.Module, grads: list[torch.Tensor], device: torch.device):
        self.row, self.device = row, device
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.model = copy.deepcopy(base)
        for p, g in zip(self.model.parameters(), grads):
            p.grad = g.clone()
        held = sum(2 * p.numel() * p.element_size() for p in self.model.parameters())
        self.opt = make_optimizer(row, self.model)
        self.cycle = self.opt.sync_every if row == "sparseloco" else 1
        self.run(2 * self.cycle)  # warm-up: state allocated, the exchange set up, caches filled
        after = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.state_bytes = after - before - held
        self.peak_extra = 0
        self.ms: list[float] = []
        self.local_ms: list[float] = []
        self.sync_ms: list[float] = []

    def run(self, steps: int) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.opt.step()
        _sync(self.device)
        return time.perf_counter() - t0

    def time_once(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            resident = torch.cuda.memory_allocated(self.device)
        if self.row == "sparseloco":
            self.local_ms.append(1e3 * self.run(self.cycle - 1) / (self.cycle - 1))
            self.sync_ms.append(1e3 * self.run(1))
        else:
            self.ms.append(1e3 * self.run(1))
        if cuda:
            self.peak_extra = max(self.peak_extra, torch.cuda.max_memory_allocated(self.device) - resident)

    def result(self, fastest: bool = False) -> dict:
        pick = min if fastest else statistics.median
        out = dict(row=self.row)
        if self.row == "sparseloco":
            local, sync = pick(self.local_ms), pick(self.sync_ms)
            out.update(ms=(local * (self.cycle - 1) + sync) / self.cycle, sync_ms=sync, cycle=self.cycle)
        else:
            out["ms"] = pick(self.ms)
        if self.device.type == "cuda":
            out["extra_mib"] = (self.state_bytes + self.peak_extra) / 2**20
        if self.row == "reference":
            out["sent_per_step"] = self.opt.bytes_sent
        elif hasattr(self.opt, "bytes_sent"):
            steps = getattr(self.opt, "steps", 0) or getattr(self.opt, "local_steps", 0)
            out["sent_per_step"] = self.opt.bytes_sent / max(1, steps)
        return out


def rows_for(device: torch.device) -> list[str]:
    return ["adamw"] + (["adamw_fused"] if device.type == "cuda" else []) + ["reference", "demo", "sparseloco"]


def measure(kind: str, params: float, device: torch.device, repeat: int, fastest: bool = False) -> list[dict]:
    torch.manual_seed(0)
    base = build_model(kind, params, device)
    gen = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(p.shape, device=device, generator=gen) * 1e-3 for p in base.parameters()]
    rows = [Row(r, base, grads, device) for r in rows_for(device)]
    for _ in range(repeat):  # interleaved: every row sees the same load
        for r in rows:
            r.time_once()
    numel = sum(p.numel() for p in base.parameters())
    tensors = len(list(base.parameters()))
    out = []
    for r in rows:
        res = r.result(fastest)
        res.update(model=kind, numel=numel, tensors=tensors, param_bytes=4 * numel)
        out.append(res)
    del rows
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _rank(rank: int, world: int, args: dict) -> dict:
    device = torch.device(args["device"])
    if args["threads"]:
        torch.set_num_threads(args["threads"])
    cases = [(m, p) for m in args["models"] for p in (args["params"] if m == "linear" else [0])]
    results = []
    for kind, params in cases:
        rs = measure(kind, params, device, args["repeat"], args["fastest"])
        for r in rs:
            print(f"{kind:6s} {r['numel'] / 1e6:6.1f} M  {r['row']:12s} {r['ms']:9.2f} ms", flush=True)
        results += rs
    return dict(results=results, threads=torch.get_num_threads())


NAMES = {
    "adamw": "torch AdamW (foreach)",
    "adamw_fused": "torch AdamW (fused)",
    "reference": "DeMo reference (demo.py)",
    "demo": "gradwire DeMo",
    "sparseloco": "gradwire SparseLoCo, per step",
}


def _case(r: dict) -> tuple:
    return (r["model"], r["numel"])


def table(results: list[dict], device_name: str) -> list[str]:
    cuda = any("extra_mib" in r for r in results)
    fused = any(r["row"] == "adamw_fused" for r in results)
    head = (
        "| model | parameters | tensors | optimizer | ms / step | × AdamW |"
        + (" × fused AdamW |" if fused else "")
        + " × reference | sent B / step |"
        + (" memory beyond params+grads, MiB |" if cuda else "")
    )
    cols = head.count("|") - 1
    lines = [f"On {device_name}, one rank.", "", head, "|" + "|".join(["---:"] * cols) + "|"]
    base = {_case(r): r["ms"] for r in results if r["row"] == "adamw"}
    fbase = {_case(r): r["ms"] for r in results if r["row"] == "adamw_fused"}
    ref = {_case(r): r["ms"] for r in results if r["row"] == "reference"}

    def line(r: dict, name: str, ms: float, sent: str, mem: str) -> str:
        c = _case(r)
        cells = [r["model"], f"{r['numel'] / 1e6:.1f} M", str(r["tensors"]), name, f"{ms:.2f}", f"{ms / base[c]:.2f}"]
        if fused:
            cells.append(f"{ms / fbase[c]:.2f}")
        cells += [f"{ms / ref[c]:.2f}", sent]
        if cuda:
            cells.append(mem)
        return "| " + " | ".join(cells) + " |"

    for r in results:
        sent = f"{r['sent_per_step']:,.0f}" if "sent_per_step" in r else "—"
        mem = f"{r['extra_mib']:,.0f}" if "extra_mib" in r else ""
        lines.append(line(r, NAMES[r["row"]], r["ms"], sent, mem))
        if r["row"] == "sparseloco":
            lines.append(line(r, f"gradwire SparseLoCo, the sync step (1 in {r['cycle']})", r["sync_ms"], "", ""))
    return lines


def _verdict(what: str, value: float, limit: float, unit: str = "×") -> str:
    ok = value <= limit
    return f"target {what}: {value:.2f}{unit} (≤ {limit:g}{unit}) — {'met' if ok else 'missed'}"


def targets(results: list[dict], cuda: bool) -> list[str]:
    """The issue's targets this run measured, as met / missed lines."""
    by = {(_case(r), r["row"]): r for r in results}
    cases = sorted({_case(r) for r in results}, key=lambda c: (MODELS.index(c[0]), c[1]))
    out = []
    for c in cases:
        label = f"{c[0]} {c[1] / 1e6:.1f} M"
        demo, ref, adamw = by[(c, "demo")], by[(c, "reference")], by[(c, "adamw")]
        slo = by[(c, "sparseloco")]
        if not cuda:
            if c[0] in ("linear", "many"):
                out.append(_verdict(f"DeMo step / reference, {label}", demo["ms"] / ref["ms"], 1.0))
            out.append(_verdict(f"SparseLoCo mean step / AdamW, {label}", slo["ms"] / adamw["ms"], 1.5))
        else:
            fused = by[(c, "adamw_fused")]
            out.append(_verdict(f"DeMo step / reference, {label}", demo["ms"] / ref["ms"], 1.0))
            out.append(_verdict(f"DeMo step / fused AdamW, {label}", demo["ms"] / fused["ms"], 5.0))
            out.append(
                _verdict(f"SparseLoCo mean step / fused AdamW (its inner), {label}", slo["ms"] / fused["ms"], 1.2)
            )
            for row in ("demo", "sparseloco"):
                r = by[(c, row)]
                out.append(
                    _verdict(
                        f"{NAMES[row]} memory beyond params+grads / param bytes, {label}",
                        r["extra_mib"] * 2**20 / r["param_bytes"],
                        1.5,
                    )
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--params", nargs="+", default=["10M"], help="sizes of the linear model: 10M,100M or 10e6 100e6")
    ap.add_argument(
        "--models",
        default=None,
        help="comma-separated, of linear, many, mlp (default: all three on the CPU, linear on a GPU)",
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fastest", action="store_true", help="the fastest repeat per row, not the median")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    device = torch.device(a.device)
    models = (a.models or ("linear" if device.type == "cuda" else ",".join(MODELS))).split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; one of {', '.join(MODELS)}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    args = dict(
        device=a.device,
        params=parse_sizes(a.params),
        models=models,
        repeat=a.repeat,
        fastest=a.fastest,
        threads=a.threads,
    )
    (out,) = gt.spawn(_rank, 1, (args,), backend=backend, timeout_s=1800)
    results = out["results"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"the CPU ({out['threads']} threads)"
    statistic = "fastest" if a.fastest else "median"
    lines = table(results, f"{name}, torch {torch.__version__}, {statistic} of {a.repeat} interleaved")
    lines += [""] + targets(results, device.type == "cuda")
    print("\n".join(lines))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        "# One optimizer step beside torch.optim.AdamW and DeMo's reference\n\n"
        + f"Written by `bench/optimizer_step.py` on {datetime.date.today().isoformat()} "
        + f"(`{' '.join(['python', 'bench/optimizer_step.py', *sys.argv[1:]])}`).\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
