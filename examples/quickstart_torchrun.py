"""The README's quick start, whole: torch.optim.AdamW swapped for gradwire.torch.SparseLoCo around it, on torchrun.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/quickstart_torchrun.py

(``python -m torch.distributed.run`` is torchrun itself; called through the venv's Python it finds gradwire
whether torch was installed into .venv or came from the system's Python.) Each rank trains the same small
classifier on its own samples; every 2 local steps the ranks exchange their compressed pseudo-gradients,
average them exactly and take the same outer step. Rank 0 prints the held-out loss, the bytes each way and
whether both ranks hold bit-identical weights.
"""

import torch
import torch.distributed as dist
from torch import nn

import gradwire.torch

dist.init_process_group("gloo")  # torchrun sets RANK and WORLD_SIZE; without this line gradwire refuses to start

torch.manual_seed(0)  # the same initial weights on every rank
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
teacher = nn.Linear(64, 8)  # what the samples' labels come from


def samples(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(64, 64, generator=g) for _ in range(n)]
    with torch.no_grad():
        return [(x, teacher(x).argmax(dim=1)) for x in xs]


inner = torch.optim.AdamW(model.parameters(), lr=1e-3)  # what you had
opt = gradwire.torch.SparseLoCo(model.parameters(), inner, sync_every=2)  # about 300× fewer bytes per step

rank = dist.get_rank()
data = samples(1 + rank, 48)  # each rank its own samples
held_out = samples(0, 4)
loss_fn = nn.functional.cross_entropy
for x, y in data:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()  # local AdamW steps; every sync_every steps the compressed exchange, the same weights everywhere

with torch.no_grad():
    loss = sum(loss_fn(model(x), y).item() for x, y in held_out) / len(held_out)
fp32 = 4 * sum(p.numel() for p in model.parameters())  # bytes of one dense fp32 gradient
agree = gradwire.torch.replicas_agree(model)  # every rank's weights hashed and compared
if rank == 0:
    print(f"{dist.get_world_size()} ranks, {opt.local_steps} local steps, {opt.syncs} syncs")
    print(f"held-out loss: {loss:.4f}")
    print(
        f"rank 0 sent {opt.bytes_sent / opt.local_steps:,.0f} bytes per local step "
        f"({fp32 * opt.local_steps / opt.bytes_sent:.0f}x fewer than fp32) and received "
        f"{opt.bytes_received / opt.local_steps:,.0f}"
    )
    print(f"replicas bit-identical: {agree}")
dist.barrier()  # every rank leaves the last collective before gloo is torn down
dist.destroy_process_group()
