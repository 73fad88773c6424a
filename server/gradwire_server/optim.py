"""AdamW on the fp32 master weights: bias-corrected moments, decoupled weight decay, lr schedule.

Written out (a few lines) rather than wrapping ``torch.optim.AdamW`` because the server needs a *pure*
step: it computes the target weights and the new moments without touching the current ones, publishes,
and only adopts the new state once it is durable. The arithmetic matches ``torch.optim.AdamW``
(``p ← p·(1 − lr·wd) − lr · m̂ / (√v̂ + eps)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from .config import OptimizerConfig

__all__ = ["AdamWState", "adamw_step", "lr_at"]


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
    def zeros_like(cls, params: Mapping[str, torch.Tensor]) -> "AdamWState":
        return cls({n: torch.zeros_like(p) for n, p in params.items()},
                   {n: torch.zeros_like(p) for n, p in params.items()}, 0)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{"exp_avg.<name>": …, "exp_avg_sq.<name>": …}`` for a safetensors file."""
        out = {f"exp_avg.{n}": t for n, t in self.exp_avg.items()}
        out.update({f"exp_avg_sq.{n}": t for n, t in self.exp_avg_sq.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], step: int, device=None) -> "AdamWState":
        m, v = {}, {}
        for key, t in tensors.items():
            kind, _, name = key.partition(".")
            (m if kind == "exp_avg" else v)[name] = t.to(device=device, dtype=torch.float32)
        return cls(m, v, step)


def adamw_step(
    cfg: OptimizerConfig,
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    state: AdamWState,
) -> tuple[dict[str, torch.Tensor], AdamWState]:
    """One AdamW step: ``(target weights, new state)``; ``params`` and ``state`` are left untouched."""
    step = state.step + 1
    lr = lr_at(cfg, step)
    beta1, beta2 = cfg.betas
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    targets, m_new, v_new = {}, {}, {}
    for name in sorted(params):
        p = params[name]
        g = grads[name].to(device=p.device, dtype=torch.float32)
        m = state.exp_avg[name].mul(beta1).add_(g, alpha=1.0 - beta1)
        v = state.exp_avg_sq[name].mul(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v / bc2).sqrt_().add_(cfg.eps)
        targets[name] = p.mul(1.0 - lr * cfg.weight_decay).addcdiv_(m, denom, value=-lr / bc1)
        m_new[name], v_new[name] = m, v
    return targets, AdamWState(m_new, v_new, step)
