"""gradwire under HF Accelerate: a DDP comm hook registered after ``prepare``, or DeMo / SparseLoCo as the optimizer.

    torchrun --nproc-per-node 2 examples/accelerate_recipe.py --mode hook  # AdamW, gradients via gradwire's DDP hook
    torchrun --nproc-per-node 2 examples/accelerate_recipe.py --mode sparseloco  # SparseLoCo, DDP's all-reduce off
    torchrun --nproc-per-node 2 examples/accelerate_recipe.py --mode demo
    (or: accelerate launch --num_processes 2 --cpu examples/accelerate_recipe.py --mode demo)

``accelerator.prepare`` wraps the model in DistributedDataParallel when there is more than one process.
Register the hook on what ``prepare`` returned, before the first forward:

- ``--mode hook``: any optimizer; ``gradwire.torch.ddp_hook(codec)`` compresses every bucket's gradient
  (DCT top-k with error feedback here) and averages the frames exactly.
- ``--mode demo|sparseloco``: gradwire's optimizers exchange compressed frames themselves, so DDP must
  not all-reduce: ``gradwire.torch.skip_ddp_all_reduce(model)`` registers ``local_gradients_hook``
  (without it their first step raises ``DenseAllReduceError``).

Gradient accumulation over two micro-batches with ``accelerator.accumulate``; the script checks at the
end that every rank holds bit-identical weights. Needs ``pip install accelerate``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

import gradwire
import gradwire.torch as gt


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def dataset(n: int = 1024) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 64, generator=g) / 8
    x = torch.randn(n, 64, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ teacher))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("hook", "demo", "sparseloco"), default="sparseloco")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=4)
    args = ap.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model()
    if args.mode == "hook":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    elif args.mode == "demo":
        opt = gt.DeMo(model.named_parameters(), lr=3e-3, beta=0.9)
    else:
        opt = gt.SparseLoCo(
            model.named_parameters(), torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every=args.sync_every
        )
    loader = torch.utils.data.DataLoader(
        dataset(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    hook_state = None
    if accelerator.num_processes > 1:  # prepare wrapped the model in DDP: its hook, before the first forward
        if args.mode == "hook":
            hook_state, hook = gt.ddp_hook(gradwire.DCTCodec(chunk_shape=(64, 64), topk=32))
            model.register_comm_hook(hook_state, hook)
        else:
            gt.skip_ddp_all_reduce(model)

    losses = []
    for _ in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
    inner_opt = opt.optimizer  # accelerate's AcceleratedOptimizer wraps ours
    if args.mode == "sparseloco" and inner_opt.local_steps % inner_opt.sync_every:
        inner_opt.sync()  # the local steps since the last sync: one more outer step, so every rank ends identical

    agree = gt.replicas_agree(model)
    if accelerator.is_main_process:
        print(f"loss first {losses[0]:.5f} last {losses[-1]:.5f}")
        if hook_state is not None:
            print(f"compression ratio vs fp32: {hook_state.compression_ratio():.1f}x")
        elif args.mode != "hook":
            numel = sum(p.numel() for p in model.parameters())
            steps = inner_opt.steps if args.mode == "demo" else inner_opt.local_steps
            print(f"compression ratio vs fp32: {4 * numel * steps / inner_opt.bytes_sent:.1f}x")
        print(f"replicas bit-identical: {agree}")
    accelerator.wait_for_everyone()
    dist.destroy_process_group()
    if not agree:
        raise SystemExit("replicas differ")


if __name__ == "__main__":
    main()
