"""gradwire under PyTorch Lightning: ``DDPStrategy(ddp_comm_hook=…)``, and SparseLoCo or DeMo in a LightningModule.

    torchrun --nproc-per-node 2 examples/lightning_recipe.py --mode sparseloco
    torchrun --nproc-per-node 2 examples/lightning_recipe.py --mode hook  # AdamW, gradients through gradwire's DDP hook
    torchrun --nproc-per-node 2 examples/lightning_recipe.py --mode demo
    (without torchrun, Lightning starts the second process itself: python examples/lightning_recipe.py)

Lightning wraps the module in DistributedDataParallel; the strategy takes the comm hook (Lightning 2.6
registers it on CUDA devices only: on the CPU the module's ``on_fit_start`` registers it):

- ``--mode hook``: ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)`` with
  ``state, hook = gradwire.torch.ddp_hook(codec)``: every bucket's gradient compressed, averaged exactly.
- ``--mode sparseloco|demo``: the optimizer (from ``configure_optimizers``) exchanges compressed frames
  itself, so the hook is ``gradwire.torch.local_gradients_hook`` (DDP keeps each rank's own gradient;
  without it the optimizer's first step raises ``DenseAllReduceError``).

The script checks at the end that every rank holds bit-identical weights. Needs ``pip install lightning``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwire
import gradwire.torch as gt


class Regression(L.LightningModule):
    def __init__(self, mode: str, sync_every: int, comm_state, comm_hook):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.mode, self.sync_every = mode, sync_every
        self.comm_state, self.comm_hook = comm_state, comm_hook
        self.losses: list[float] = []

    def on_fit_start(self):
        # Lightning registers DDPStrategy's ddp_comm_hook on CUDA devices only (lightning 2.6); on the CPU it
        # is dropped silently and DDP all-reduces. The strategy has wrapped the model by now: register it here.
        ddp = self.trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel) and self.device.type != "cuda":
            ddp.register_comm_hook(self.comm_state, self.comm_hook)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.mode == "hook":
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        elif self.mode == "demo":
            opt = gt.DeMo(self.named_parameters(), lr=3e-3, beta=0.9)
        else:
            inner = torch.optim.AdamW(self.parameters(), lr=3e-3)
            opt = gt.SparseLoCo(self.named_parameters(), inner, sync_every=self.sync_every)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        return {"optimizer": opt, "lr_scheduler": sched}

    def on_train_end(self):
        opt = self.optimizers().optimizer
        if self.mode == "sparseloco" and opt.local_steps % opt.sync_every:
            opt.sync()  # the local steps since the last sync: one more outer step, so every rank ends identical


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 64, generator=g) / 8
    x = torch.randn(1024, 64, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x @ teacher))
    return torch.utils.data.DataLoader(data, batch_size=32)  # Lightning adds the DistributedSampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("hook", "demo", "sparseloco"), default="sparseloco")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sync-every", type=int, default=4)
    args = ap.parse_args()

    if args.mode == "hook":
        state, hook = gt.ddp_hook(gradwire.DCTCodec(chunk_shape=(64, 64), topk=32))
    else:
        state, hook = None, gt.local_gradients_hook
    strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=hook)
    module = Regression(args.mode, args.sync_every, state, hook)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader())

    agree = gt.replicas_agree(module)
    if trainer.is_global_zero:
        print(f"loss first {module.losses[0]:.5f} last {module.losses[-1]:.5f}")
        if state is not None:
            print(f"compression ratio vs fp32: {state.compression_ratio():.1f}x")
        else:
            opt = trainer.optimizers[0]
            steps = opt.steps if args.mode == "demo" else opt.local_steps
            numel = sum(p.numel() for p in module.parameters())
            print(f"compression ratio vs fp32: {4 * numel * steps / opt.bytes_sent:.1f}x")
        print(f"replicas bit-identical: {agree}")
    trainer.strategy.barrier()
    if not agree:
        raise SystemExit("replicas differ")


if __name__ == "__main__":
    main()
