"""Averaging a module's floating-point buffers (BatchNorm's running statistics) across ranks.

DeMo and SparseLoCo keep the *parameters* of every rank bit-identical; buffers are not parameters: each
rank's BatchNorm updates its running mean and variance from its own batches, so they drift apart and
an evaluation on rank 0 sees other statistics than one on rank 1. :func:`average_buffers` all-reduces them
(they are small: two vectors per BatchNorm layer) — call it before evaluating or saving, or every
``sync_every`` steps with SparseLoCo. Under DDP with :func:`~gradwire.torch.local_gradients_hook`,
DDP's ``broadcast_buffers=True`` (its default) already copies rank 0's buffers to every rank at each
forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .launcher_check import refuse_single_rank_launch

__all__ = ["average_buffers"]


@torch.no_grad()
def average_buffers(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> int:
    """Replace every floating-point buffer of ``module`` by its mean over the ranks of ``process_group``
    (default: the default group); integer buffers (``num_batches_tracked``) are left as they are (every
    rank counts the same steps). One all-reduce per dtype and device. Returns the number of buffers
    averaged (0 without an initialized process group, or in a group of one); under a launcher of several ranks
    without a process group, :class:`~gradwire.torch.NoProcessGroupError`."""
    refuse_single_rank_launch("average_buffers", process_group, "average_buffers() averages them")
    if not dist.is_initialized():
        return 0
    world = dist.get_world_size(process_group)
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if world == 1 or not buffers:
        return 0
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in buffers:
        by_kind.setdefault((b.dtype, b.device), []).append(b)
    for group in by_kind.values():
        # One flat float32 vector per dtype and device: one collective, and no half-precision sums.
        flat = torch.cat([b.reshape(-1).to(torch.float32) for b in group])
        dist.all_reduce(flat, group=process_group)
        flat.div_(world)
        offset = 0
        for b in group:
            n = b.numel()
            b.copy_(flat[offset : offset + n].view_as(b))
            offset += n
    return len(buffers)
