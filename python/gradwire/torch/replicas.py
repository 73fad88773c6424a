"""Whether every rank holds the same weights, bit for bit: what DeMo, SparseLoCo and gradwire's DDP hook
promise, checked in one all-gather of a 32-byte digest per rank.

Each rank hashes the raw bytes of its parameters (any dtype, bf16 included; an FSDP2 ``DTensor`` by its
gathered full tensor, a collective every rank must join), and the digests are compared. The examples and
recipes end with it; a training script can call it before saving a checkpoint.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from .collectives import comm_device
from .launcher_check import refuse_single_rank_launch

__all__ = ["replicas_agree"]


def replicas_agree(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> bool:
    """True when every rank of ``process_group`` (default: the default group) holds bit-identical
    parameters in ``module`` (True without an initialized process group: one rank agrees with itself).

    Never True for ranks it did not compare: a process that a launcher started as one of several ranks
    (``WORLD_SIZE`` > 1) with no process group raises :class:`~gradwire.torch.NoProcessGroupError`."""
    refuse_single_rank_launch("replicas_agree", process_group, "replicas_agree() compares the ranks")
    digest = hashlib.sha256()
    for p in module.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    if not (dist.is_available() and dist.is_initialized()):
        return True
    mine = torch.tensor(list(digest.digest()), dtype=torch.uint8, device=comm_device(process_group))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(parts, mine, group=process_group)
    return all(torch.equal(parts[0], p) for p in parts)
