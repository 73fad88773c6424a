"""Gradient exchanges by name, for command lines and comparisons: gradwire's and torch's side by side.

:func:`register_hook` puts one of them on a ``DistributedDataParallel`` model and returns a
:class:`RegisteredHook` that reports the bytes each rank contributes per step, counted the same way
for all: the elements a rank puts into the collectives, in bytes (for gradwire's codec hooks, the
padded frames and length words it all-gathers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from ..registry import codec_names
from .ddp_hook import GradwireHookState, ddp_hook
from .powersgd import PowerSGDState, powersgd_hook

__all__ = ["BUILTIN_HOOKS", "RegisteredHook", "hook_names", "register_hook"]

#: Names that are not gradwire codecs: DDP's own all-reduce, torch's fp16 hook, the two PowerSGDs.
BUILTIN_HOOKS = ("none", "fp16", "torch-powersgd", "powersgd")


def hook_names() -> tuple[str, ...]:
    """Every name :func:`register_hook` accepts: the built-ins, then every codec and policy :func:`gradwire.build_codec` knows.

    ``"powersgd"`` is the collective form (factors all-reduced); the frame codec of that name runs
    through :func:`gradwire.torch.ddp_hook` (``ddp_hook(gradwire.PowerSGD(...))``).
    """
    return BUILTIN_HOOKS + tuple(name for name in codec_names() if name not in BUILTIN_HOOKS)


@dataclass
class RegisteredHook:
    """A hook put on a model by :func:`register_hook`, with its traffic."""

    name: str
    state: Any
    dense_bytes: int  # one step's gradients, uncompressed
    element_size: int = 4  # bytes per gradient element

    def bytes_per_step(self) -> float:
        """Mean bytes this rank put into the collectives per finished step."""
        s = self.state
        if self.name == "none":
            return float(self.dense_bytes)
        if self.name == "fp16":
            return self.dense_bytes / self.element_size * 2
        if self.name == "torch-powersgd":
            # torch counts elements from its first compressed step; the warm-up steps send everything.
            compressed = s.total_numel_after_compression * self.element_size
            warmup = min(s.iter, s.start_powerSGD_iter) * self.dense_bytes
            return (compressed + warmup) / max(1, s.iter)
        if isinstance(s, PowerSGDState):
            return s.bytes_per_step()
        assert isinstance(s, GradwireHookState)
        return s.wire_bytes_per_step()

    def compression_ratio(self) -> float:
        return self.dense_bytes / max(1e-9, self.bytes_per_step())


def register_hook(
    model: DistributedDataParallel,
    name: str,
    process_group: dist.ProcessGroup | None = None,
    *,
    powersgd_rank: int = 2,
    start_iter: int = 2,
    **codec_params,
) -> RegisteredHook:
    """Put the exchange called ``name`` (see :func:`hook_names`) on ``model``.

    ``powersgd_rank`` and ``start_iter`` (dense warm-up iterations; torch's minimum is 2) apply to both
    PowerSGDs alike; ``codec_params`` go to the gradwire codec.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    dense = sum(p.numel() * p.element_size() for p in trainable)
    element = trainable[0].element_size()
    if name == "none":
        return RegisteredHook(name, None, dense, element)
    if name == "fp16":
        model.register_comm_hook(process_group, default_hooks.fp16_compress_hook)
        return RegisteredHook(name, process_group, dense, element)
    if name == "torch-powersgd":
        state = torch_powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=max(2, start_iter),
        )
        model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        return RegisteredHook(name, state, dense, element)
    if name == "powersgd":
        state = PowerSGDState(powersgd_rank, process_group=process_group, start_iter=start_iter)
        model.register_comm_hook(state, powersgd_hook)
        return RegisteredHook(name, state, dense, element)
    if name not in codec_names():
        raise ValueError(f"unknown hook {name!r}; known: {', '.join(hook_names())}")
    state, hook = ddp_hook(name, process_group, **codec_params)
    model.register_comm_hook(state, hook)
    return RegisteredHook(name, state, dense, element)
