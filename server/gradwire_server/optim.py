"""AdamW on the fp32 master weights: torch's own AdamW kernel, bias-corrected moments, decoupled weight
decay, lr schedule.

The server steps with ``torch.optim.adamw.adamw`` (the functional form of ``torch.optim.AdamW``), fused
where torch has a fused kernel for the device (CPU from torch 2.4, CUDA), else ``foreach``: one pass over
parameters, gradients and moments instead of the eight elementwise passes of the default for-loop, on
buffers that persist from round to round, so a round allocates nothing the size of the model.
:func:`adamw_step_` updates the moments in place and writes the stepped weights into a buffer the caller
owns (the master weights stay as they are: the server publishes ``target − master`` compressed);
:func:`adamw_step` is the same arithmetic on copies. Replaying a round after a restart runs this same
code, so it reproduces the moments bit for bit on the same device and thread count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as _torch_adamw

from .config import OptimizerConfig

__all__ = ["AdamWState", "adamw_step", "adamw_step_", "lr_at"]


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


#: Device types on which torch has a fused AdamW kernel.
_FUSED = {"cuda", "cpu"} if _torch_at_least(2, 4) else {"cuda"}


def lr_at(cfg: OptimizerConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warm-up, then constant or cosine to 0."""
    if cfg.warmup_rounds and step <= cfg.warmup_rounds:
        return cfg.lr * step / cfg.warmup_rounds
    if cfg.schedule == "cosine":
        assert cfg.total_rounds is not None
        span = max(1, cfg.total_rounds - cfg.warmup_rounds)
        progress = min(1.0, (step - cfg.warmup_rounds) / span)
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr


@dataclass
class AdamWState:
    """First and second moments per parameter and the number of steps taken."""

    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int = 0

    @classmethod
    def zeros_like(cls, params: Mapping[str, torch.Tensor]) -> AdamWState:
        return cls(
            {n: torch.zeros_like(p) for n, p in params.items()}, {n: torch.zeros_like(p) for n, p in params.items()}, 0
        )

    def clone(self) -> AdamWState:
        return AdamWState(
            {n: t.clone() for n, t in self.exp_avg.items()},
            {n: t.clone() for n, t in self.exp_avg_sq.items()},
            self.step,
        )

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{"exp_avg.<name>": …, "exp_avg_sq.<name>": …}`` for a safetensors file."""
        out = {f"exp_avg.{n}": t for n, t in self.exp_avg.items()}
        out.update({f"exp_avg_sq.{n}": t for n, t in self.exp_avg_sq.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], step: int, device=None) -> AdamWState:
        m, v = {}, {}
        for key, t in tensors.items():
            kind, _, name = key.partition(".")
            (m if kind == "exp_avg" else v)[name] = t.to(device=device, dtype=torch.float32)
        return cls(m, v, step)


def adamw_step_(
    cfg: OptimizerConfig,
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    state: AdamWState,
    out: MutableMapping[str, torch.Tensor],
) -> None:
    """One AdamW step in place: ``out[name]`` ← the stepped ``params[name]`` (``params`` untouched; ``out``
    holds preallocated buffers of the same shapes), ``state``'s moments and step advanced."""
    names = sorted(params)
    step = state.step + 1
    beta1, beta2 = cfg.betas
    targets = [out[n] for n in names]
    for n, t in zip(names, targets):
        t.copy_(params[n])
    device = targets[0].device
    gs = [grads[n].to(device=device, dtype=torch.float32) for n in names]
    # torch counts steps in one tensor per parameter and increments them itself.
    steps = [torch.tensor(float(state.step), device=device if device.type in _FUSED else "cpu") for _ in names]
    _torch_adamw(
        targets,
        gs,
        [state.exp_avg[n] for n in names],
        [state.exp_avg_sq[n] for n in names],
        [],
        steps,
        fused=device.type in _FUSED,
        foreach=None if device.type in _FUSED else True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr_at(cfg, step),
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        maximize=False,
    )
    state.step = step


def adamw_step(
    cfg: OptimizerConfig,
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    state: AdamWState,
) -> tuple[dict[str, torch.Tensor], AdamWState]:
    """One AdamW step on copies: ``(target weights, new state)``; ``params`` and ``state`` are left
    untouched. The same arithmetic as :func:`adamw_step_`."""
    new_state = state.clone()
    targets = {n: torch.empty_like(p) for n, p in params.items()}
    adamw_step_(cfg, params, grads, new_state, targets)
    return targets, new_state
