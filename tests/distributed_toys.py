"""Small models, data and checks shared by the tests that run real process groups.

Everything here is sized so a few ranks on two cores take well under a second per run: a two-layer
MLP on a fixed synthetic classification task (a random linear teacher), each rank its own shard.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch import nn

IN, HIDDEN, CLASSES = 32, 48, 8


class TwoLayer(nn.Module):
    """An MLP whose layers are declared in the opposite order to their use.

    DDP's first buckets follow declaration order, the rebuilt ones (after iteration 0) the order in
    which gradients become ready, so with small buckets the rebuild regroups parameters: the case the
    hooks' state must survive.
    """

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.body = nn.Linear(IN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TwoLayer()


def shard(rank: int, n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples of one fixed task: labels from a random linear teacher."""
    teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    x = torch.randn(n, IN, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def all_ranks_equal(t: torch.Tensor) -> bool:
    """Whether ``t`` is bit-identical on every rank."""
    parts = gather(t)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def checkpoint_roundtrip(obj):
    """``obj`` (a state dict) through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint on
    disk would go: what a resumed optimizer is given."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
