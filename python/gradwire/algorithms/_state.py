"""Helpers shared by the node sides' ``state_dict`` / ``load_state_dict``."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..codecs import statedict as sd


def save_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies, in sorted name order."""
    return {n: tensors[n].detach().clone().contiguous() for n in sorted(tensors)}


def load_tensors(value: Any, what: str) -> dict[str, torch.Tensor]:
    """Float32 copies of ``{name: tensor}`` (devices kept as given); ``ValueError`` on a bad state."""
    value = sd.mapping(value, what)
    out = {}
    for n, t in value.items():
        t = sd.tensor(t, f"{what} {n!r}", floating=True)
        out[n] = t.detach().to(torch.float32).clone()
    return out


def check_floats(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    for n, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{what} {n!r} must be a floating-point tensor")
