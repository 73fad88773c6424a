"""One optimizer step of gradwire's DeMo and SparseLoCo beside ``torch.optim.AdamW.step()``, on the CPU or a GPU.

What a training job pays per step for the optimizer itself, on one rank: the gradients are given (random,
the same for every row), so the times hold no forward or backward pass. A one-rank process group
(gloo on the CPU, NCCL on a GPU) runs the optimizers' real exchange code (the sharded exchange by
default: pieces, exact mean, re-encoding, the frames), but with a single rank the collectives move
no data between processes, so the figures are the compute a step costs, not the network.

Rows, on the same parameters:

- **torch AdamW**: ``torch.optim.AdamW(params, lr)`` (torch's default implementation for the device:
  ``foreach``), the baseline every ratio is taken against;
- **torch AdamW, fused** (on a GPU only): ``fused=True``;
- **DeMo**: ``gradwire.torch.DeMo`` with its defaults (a DCT top-k exchange at every step);
- **SparseLoCo, per step**: ``gradwire.torch.SparseLoCo`` with an inner ``torch.optim.AdamW`` and its
  defaults (a sync every 8 steps): the mean over a whole cycle of local steps and one sync;
- **SparseLoCo, the sync step**: the one step in 8 that encodes, exchanges and applies the outer step.

Per row: milliseconds per step (the median of ``--repeat`` timed steps or cycles after warm-up, the
device synchronized around each), its ratio to AdamW measured in the same run, and on a GPU the peak
memory a step allocates beyond the parameters and gradients (``torch.cuda.max_memory_allocated``).
The table also goes to ``bench/out/optimizer_step.md``.

Usage: python bench/optimizer_step.py [--device cpu|cuda] [--params 10e6 100e6] [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import gradwire.torch as gt

OUT = Path(__file__).resolve().parent / "out" / "optimizer_step.md"
WIDTH = 1024


def _model(params: float, device: torch.device) -> nn.Module:
    """Linear width×width layers with biases, as many as make about ``params`` parameters (at least one)."""
    width = WIDTH if params < 50e6 else 4 * WIDTH
    layers = max(1, round(params / (width * width + width)))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer(row: str, model: nn.Module):
    params = list(model.parameters())
    if row == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if row == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if row == "demo":
        return gt.DeMo(params, lr=1e-3)
    return gt.SparseLoCo(params, torch.optim.AdamW(params, lr=1e-3))


def _time_row(row: str, params: float, device: torch.device, repeat: int) -> dict:
    torch.manual_seed(0)
    model = _model(params, device)
    gen = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    opt = _optimizer(row, model)
    cycle = opt.sync_every if row == "sparseloco" else 1

    def run(steps: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        _sync(device)
        return time.perf_counter() - t0

    run(2 * cycle)  # warm-up: state allocated, the exchange set up, caches filled
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    out = dict(row=row, numel=sum(p.numel() for p in model.parameters()))
    if row == "sparseloco":
        # Local steps and the sync step timed apart, one cycle at a time.
        local, sync = [], []
        for _ in range(repeat):
            local.append(run(cycle - 1) / (cycle - 1))
            sync.append(run(1))
        out["ms"] = 1e3 * (statistics.median(local) * (cycle - 1) + statistics.median(sync)) / cycle
        out["sync_ms"] = 1e3 * statistics.median(sync)
        out["cycle"] = cycle
    else:
        out["ms"] = 1e3 * statistics.median(run(1) for _ in range(repeat))
    if device.type == "cuda":
        out["extra_mib"] = (torch.cuda.max_memory_allocated(device) - resident) / 2**20
        out["state_mib"] = resident / 2**20
    if hasattr(opt, "bytes_sent"):
        out["sent_per_step"] = opt.bytes_sent / max(1, _steps_taken(opt))
    del opt, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _steps_taken(opt) -> int:
    return getattr(opt, "steps", 0) or getattr(opt, "local_steps", 0)


def _rank(rank: int, world: int, args: dict) -> dict:
    device = torch.device(args["device"])
    if args["threads"]:
        torch.set_num_threads(args["threads"])
    rows = ["adamw"] + (["adamw_fused"] if device.type == "cuda" else []) + ["demo", "sparseloco"]
    results = []
    for params in args["params"]:
        for row in rows:
            r = _time_row(row, params, device, args["repeat"])
            r["params"] = params
            print(f"{params / 1e6:.0f} M  {row:12s} {r['ms']:9.2f} ms", flush=True)
            results.append(r)
    return dict(results=results, threads=torch.get_num_threads())


NAMES = {
    "adamw": "torch AdamW (foreach)",
    "adamw_fused": "torch AdamW (fused)",
    "demo": "gradwire DeMo",
    "sparseloco": "gradwire SparseLoCo, per step",
}


def table(results: list[dict], device_name: str) -> list[str]:
    cuda = any("extra_mib" in r for r in results)
    head = "| parameters | optimizer | ms / step | × AdamW | sent B / step |" + (" memory beyond params+grads, MiB |" if cuda else "")
    lines = [f"On {device_name}, one rank.", "", head, "|" + "---:|---|---:|---:|---:|" + ("---:|" if cuda else "")]
    base = {r["params"]: r["ms"] for r in results if r["row"] == "adamw"}
    for r in results:
        ratio = r["ms"] / base[r["params"]]
        sent = f"{r['sent_per_step']:,.0f}" if "sent_per_step" in r else "—"
        mem = f" {r['extra_mib']:,.0f} |" if cuda else ""
        lines.append(f"| {r['numel'] / 1e6:.1f} M | {NAMES[r['row']]} | {r['ms']:.2f} | {ratio:.2f} | {sent} |{mem}")
        if r["row"] == "sparseloco":
            sync = r["sync_ms"]
            lines.append(f"| {r['numel'] / 1e6:.1f} M | gradwire SparseLoCo, the sync step (1 in {r['cycle']}) "
                         f"| {sync:.2f} | {sync / base[r['params']]:.2f} | | {'|' if cuda else ''}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--params", type=float, nargs="+", default=[10e6])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    device = torch.device(a.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    args = dict(device=a.device, params=a.params, repeat=a.repeat, threads=a.threads)
    (out,) = gt.spawn(_rank, 1, (args,), backend=backend, timeout_s=1800)
    results = out["results"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"the CPU ({out['threads']} threads)"
    lines = table(results, f"{name}, torch {torch.__version__}")
    print("\n".join(lines))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("# One optimizer step beside torch.optim.AdamW (bench/optimizer_step.py)\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
