"""Train a small causal transformer with FSDP2 inside each replica group and SparseLoCo across them (HSDP).

    torchrun --nproc-per-node 4 examples/fsdp_sparseloco_torchrun.py                 # 2 replicas x 2 shards
    python examples/fsdp_sparseloco_torchrun.py --spawn 4                            # the same, no torchrun
    torchrun --nproc-per-node 8 examples/fsdp_sparseloco_torchrun.py --replicas 4    # 4 replicas x 2 shards
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/fsdp_sparseloco_torchrun.py --replicas 2                            # a replica per machine

The ranks form a (replicate, shard) device mesh: ranks ``r·S … r·S + S − 1`` are replica group ``r``
(consecutive ranks, so with one group per machine FSDP's traffic stays on the machine). FSDP's
``fully_shard`` runs over each group's own 1-D shard mesh: it shards the weights, all-gathers them for
forward and backward and reduce-scatters the gradients, all inside the group. Across groups nothing
dense moves: SparseLoCo's ``process_group`` is the mesh's replicate group, so every ``--sync-every``
steps each rank sends its own shard's compressed pseudo-gradient to the ranks holding the same shard
in the other groups. After each sync every replica holds bit-identical weights; the script checks the
gathered weights at the end and prints the loss, the bytes this rank sent, and the ratio against the
fp32 all-reduce of its shard that native HSDP would run every step.

CPU ranks use gloo; with CUDA GPUs (one per rank) the script uses NCCL and the ranks' GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 and 2.5
    from torch.distributed._composable.fsdp import fully_shard

import gradwire.torch as gt
from gradwire.torch import replicas_agree
from gradwire.torch.dtensor import local_tensor

VOCAB, SEQ = 256, 32


class TinyGPT(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batch(seed: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of a fixed rule (each token is twice the previous one plus its position, mod 256):
    a model learns it quickly, and every rank draws its own starting tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (size,), generator=g)]
    for i in range(SEQ):
        tokens.append((2 * tokens[-1] + i) % VOCAB)
    seq = torch.stack(tokens, dim=1).to(device)
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2, help="replica groups (the world size must be a multiple)")
    ap.add_argument("--steps", type=int, default=64, help="local steps (a multiple of --sync-every)")
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--spawn", type=int, default=0, help="start this many local ranks (0: joined by torchrun)")
    args = ap.parse_args()
    if args.steps % args.sync_every:
        raise SystemExit("--steps must be a multiple of --sync-every (replicas agree after a sync)")
    world = args.spawn or int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.replicas:
        raise SystemExit(f"the world size {world} is not a multiple of --replicas {args.replicas}")

    if args.spawn:
        agree = all(gt.spawn(train, args.spawn, (args,), timeout_s=600))
    else:
        try:
            rank, world = gt.init_from_env()
        except gt.NoLauncherError as exc:  # started without torchrun: a usage error, not a traceback
            print(f"{exc}", file=sys.stderr)
            raise SystemExit(2) from None
        agree = train(rank, world, args)
        # Every rank leaves the last collective before any tears the group down (else one can abort at exit).
        dist.barrier()
        dist.destroy_process_group()
    if not agree:
        raise SystemExit("replicas differ")


def train(rank: int, world: int, args: argparse.Namespace) -> bool:
    """One rank's run; whether every rank gathered the same weights at the end."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyGPT(args.width, args.layers).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])  # FSDP inside the replica group only
    fully_shard(model, mesh=mesh["shard"])

    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    opt = gt.SparseLoCo(
        model.parameters(),
        inner,
        sync_every=args.sync_every,
        outer_lr=0.7,
        outer_momentum=0.9,
        nesterov=True,  # DiLoCo's outer step
        process_group=mesh.get_group("replicate"),
    )

    x, y = batch(rank + 1, args.batch, device)
    held_out = batch(10_000, 64, device)
    for step in range(args.steps):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if rank == 0 and step == 0:
            print(f"step    0  loss {loss.item():.4f}", flush=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % args.sync_every == 0:
            print(f"step {step + 1:4d} (sync {opt.syncs})  loss before sync {loss.item():.4f}", flush=True)

    with torch.no_grad():
        final = nn.functional.cross_entropy(model(held_out[0]).flatten(0, 1), held_out[1].flatten()).item()
    model.reshard()  # a forward without backward leaves the root's weights gathered: back to the shards
    shard_numel = sum(local_tensor(p).numel() for p in model.parameters())
    dense = 4 * shard_numel * args.steps  # native HSDP: this rank's fp32 shard all-reduced every step
    agree = replicas_agree(model)
    if rank == 0:
        print(f"mesh: {args.replicas} replicas x {world // args.replicas} shards, backend {dist.get_backend()}")
        print(f"held-out loss (synced weights): {final:.4f}")
        print(
            f"bytes sent by rank 0: {opt.bytes_sent} ({opt.bytes_sent / max(1, opt.syncs):.0f} per sync), "
            f"received: {opt.bytes_received}"
        )
        print(f"compression ratio vs fp32 per local step: {dense / max(1, opt.bytes_sent):.1f}x")
        print(f"replicas bit-identical: {agree}", flush=True)
    dist.barrier()
    return agree


if __name__ == "__main__":
    main()
