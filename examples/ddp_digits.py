"""Train scikit-learn's digits MLP (or a small transformer) on 2–4 ranks, with gradwire on
torch.distributed (no server).

Each rank trains on its own share of the training data (``--model digits``: the images;
``--model transformer``: a stretch of Python's pydoc text for gradwire_apps.demo.tasks.CharTransformer).
``--algorithm ddp`` (default) wraps the model in DistributedDataParallel and exchanges gradients with
``--hook``: ``none`` (DDP's all-reduce),
``fp16`` (torch's hook), ``powersgd`` (gradwire's collective PowerSGD), ``torch-powersgd``, or any
gradwire codec by name (``dct``, ``3lc``, ``minmax``, ``topk``…) through ``gradwire.torch.ddp_hook``.
``--algorithm decentralized`` runs Bagua's low-precision decentralized SGD over a ring instead.

    torchrun --nproc-per-node 2 examples/ddp_digits.py --hook dct
    python examples/ddp_digits.py --spawn 2 --hook dct
    python examples/ddp_digits.py --spawn 3 --algorithm decentralized
    python examples/ddp_digits.py --spawn 2 --model transformer --hook powersgd --steps 100 --batch-size 8

At the end rank 0 prints steps per second, bytes each rank sent per step, the final training loss and
the test accuracy (transformer: next-character accuracy on held-out text) and how far apart the ranks'
parameters are (0 for every DDP hook).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import typer
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwire.torch as gt
from gradwire_apps.demo.tasks import digits_mlp, evaluate, load_digits
from gradwire_apps.progress import progress

app = typer.Typer(add_completion=False)


class DigitsTask:
    """The digits MLP on this rank's share of scikit-learn's digits; test accuracy on the held-out set."""

    def __init__(self, rank: int, world: int, seed: int, device: torch.device):
        self.data = load_digits(seed)
        mine = torch.arange(rank, len(self.data.y_train), world)  # this rank's share
        self.x, self.y = self.data.x_train[mine].to(device), self.data.y_train[mine].to(device)
        self.device = device
        torch.manual_seed(seed)
        self.model = digits_mlp().to(device)

    def loss(self, net: nn.Module, batch: int, g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, len(self.y), (batch,), generator=g).to(self.device)
        return nn.functional.cross_entropy(net(self.x[idx]), self.y[idx])

    def evaluate(self) -> tuple[float, float]:
        self.model.cpu()
        return evaluate(self.model, self.data)


class TransformerTask:
    """gradwire_apps.demo.tasks.CharTransformer on Python's pydoc text: each rank its own stretch of the first
    90 %, next-character loss and accuracy on fixed windows of the last 10 %."""

    def __init__(self, rank: int, world: int, seed: int, device: torch.device):
        from gradwire_apps.demo.tasks import CharTransformer, CharVocab, load_pydoc_text

        text = load_pydoc_text()
        tokens = CharVocab.of(text).encode(text)
        split = int(0.9 * tokens.numel())
        share = split // world
        self.train_tokens = tokens[rank * share : (rank + 1) * share]
        self.test_tokens = tokens[split:]
        self.device = device
        torch.manual_seed(seed)
        self.model = CharTransformer(len(CharVocab.of(text))).to(device)

    def loss(self, net: nn.Module, batch: int, g: torch.Generator) -> torch.Tensor:
        from gradwire_apps.demo.tasks import char_batch

        x, y = char_batch(self.train_tokens, batch, self.model.context, g)
        logits = net(x.to(self.device))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(self.device).reshape(-1))

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        from gradwire_apps.demo.tasks import char_batch

        self.model.cpu().eval()
        x, y = char_batch(self.test_tokens, 64, self.model.context, torch.Generator().manual_seed(12345))
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
        return loss, (logits.argmax(-1) == y).float().mean().item()


TASKS = {"digits": DigitsTask, "transformer": TransformerTask}


def train(rank: int, world: int, cfg: dict) -> dict:
    """One rank's training run; returns its summary (plain values)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    task = TASKS[cfg["model"]](rank, world, cfg["seed"], device)
    model = task.model
    decentralized = cfg["algorithm"] == "decentralized"
    if decentralized:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
        algo = gt.LowPrecisionDecentralized(model, opt)
        net, traffic = model, None
    else:
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        traffic = gt.register_hook(net, cfg["hook"])
        opt = torch.optim.AdamW(net.parameters(), lr=cfg["lr"])

    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    losses = []
    start = time.perf_counter()
    for _ in progress(
        range(cfg["steps"]), desc=f"{cfg['label']} rank {rank}", unit="step", enabled=rank == 0, leave=False
    ):
        loss = task.loss(net, cfg["batch_size"], g)
        opt.zero_grad()
        loss.backward()
        if decentralized:
            algo.step()
        else:
            opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start

    tail = torch.tensor([sum(losses[-20:]) / len(losses[-20:])], device=device)
    dist.all_reduce(tail)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    test_loss, accuracy = task.evaluate()
    return dict(
        steps_per_s=cfg["steps"] / elapsed,
        # The message each rank produces per step: what it puts into the collective, or its frame
        # (plus a length word) that each of its ring peers receives.
        bytes_per_step=algo.frame_bytes_per_step() + 8 if decentralized else traffic.bytes_per_step(),
        dense_bytes=4 * flat.numel(),
        final_loss=float(tail) / world,
        test_accuracy=accuracy,
        test_loss=test_loss,
        replica_spread=float((highest - lowest).max()),
    )


def _report(cfg: dict, results: list[dict], world: int) -> None:
    table = Table(
        title=f"{cfg['label']} on {world} ranks, {cfg['steps']} steps",
        caption="bytes sent/step: what a rank puts into the collective per step"
        " (decentralized: its frame, which each ring peer receives)",
    )
    for col in ("rank", "steps/s", "bytes sent/step", "× smaller than fp32", "final loss", "test accuracy"):
        table.add_column(col, justify="right")
    for rank, r in enumerate(results):
        table.add_row(
            str(rank),
            f"{r['steps_per_s']:.1f}",
            f"{r['bytes_per_step']:,.0f}",
            f"{r['dense_bytes'] / r['bytes_per_step']:.1f}",
            f"{r['final_loss']:.4f}",
            f"{r['test_accuracy']:.3f}",
        )
    console = Console()
    console.print(table)
    console.print(f"largest difference between the ranks' parameters: {results[0]['replica_spread']:.3g}")


@app.command()
def main(
    hook: str = typer.Option("dct", help=f"gradient exchange: {', '.join(gt.hook_names())}"),
    algorithm: str = typer.Option("ddp", help="ddp or decentralized"),
    spawn: int = typer.Option(0, help="start this many local ranks (0: joined by torchrun)"),
    steps: int = typer.Option(300, help="optimizer steps"),
    batch_size: int = typer.Option(32, help="samples (digits) or 64-character windows (transformer) per rank per step"),
    lr: float = typer.Option(3e-3, help="AdamW learning rate"),
    model: str = typer.Option(
        "digits", help="digits (the MLP) or transformer (gradwire_apps.demo.tasks.CharTransformer)"
    ),
    seed: int = typer.Option(0),
    backend: str | None = typer.Option(None, help="gloo or nccl (default: nccl where GPUs are)"),
) -> None:
    if algorithm not in ("ddp", "decentralized"):
        raise typer.BadParameter("--algorithm must be ddp or decentralized")
    if algorithm == "ddp" and hook not in gt.hook_names():
        raise typer.BadParameter(f"--hook must be one of {', '.join(gt.hook_names())}")
    if model not in TASKS:
        raise typer.BadParameter(f"--model must be one of {', '.join(TASKS)}")
    label = "decentralized (MinMax uint8, ring)" if algorithm == "decentralized" else f"DDP, hook {hook}"
    label = f"{model}: {label}"
    cfg = dict(
        hook=hook, algorithm=algorithm, model=model, steps=steps, batch_size=batch_size, lr=lr, seed=seed, label=label
    )
    if spawn:
        results = gt.spawn(train, spawn, (cfg,), backend=backend, timeout_s=600)
        _report(cfg, results, spawn)
        return
    try:
        rank, world = gt.init_from_env(backend)
    except gt.NoLauncherError as exc:  # started without torchrun: a usage error, not a traceback
        print(f"{exc} (or start local ranks itself: --spawn 2)", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        result = train(rank, world, cfg)
        # Gather every rank's summary on all ranks as a fixed-size tensor (no pickled objects).
        keys = ("steps_per_s", "bytes_per_step", "dense_bytes", "final_loss", "test_accuracy", "replica_spread")
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        row = torch.tensor([float(result[k]) for k in keys], dtype=torch.float64, device=device)
        rows = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        if rank == 0:
            _report(cfg, [dict(zip(keys, r.cpu().tolist())) for r in rows], world)
        # Every rank leaves the last collective before any tears gloo down (gradwire.torch.launch makes
        # sure destroy_process_group() then really frees the group: see the note at its imports).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    app()
