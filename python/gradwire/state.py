"""Model state on the wire and at rest: safetensors bytes, applying published updates, and the weights hash.

Nodes and the server must hold bit-identical weights. They get there by starting from the same state
and applying the same decoded updates with the same operation (:func:`apply_update`, an in-place fp32
add in name order); :func:`state_hash` lets a node check that it is in sync with the server.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, MutableMapping

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

__all__ = ["apply_update", "state_from_bytes", "state_hash", "state_to_bytes"]


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """A cheap hash of named tensors: BLAKE2b-128 over each name and its raw bytes, in name order.

    Equal hashes mean bit-identical tensors (same names, dtypes, shapes and bytes), whatever device
    they live on.
    """
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach()
        h.update(name.encode("utf-8") + b"\0" + str(t.dtype).encode() + repr(tuple(t.shape)).encode() + b"\0")
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def apply_update(state: MutableMapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> None:
    """``state[name] += update[name]`` in place, in name order; names and shapes must match exactly."""
    missing = set(update) - set(state)
    if missing:
        raise KeyError(f"update names tensors the state does not have: {sorted(missing)[:5]}")
    for name in sorted(update):
        dst, src = state[name], update[name]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"update for {name!r} has shape {tuple(src.shape)}, the state has {tuple(dst.shape)}")
        dst.add_(src.to(device=dst.device, dtype=dst.dtype))


def state_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """Named tensors as safetensors bytes (contiguous CPU copies)."""
    return _st_save({n: t.detach().contiguous().cpu() for n, t in state.items()})


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Named tensors from safetensors bytes; never unpickles anything."""
    try:
        return dict(_st_load(bytes(data)))
    except Exception as exc:  # safetensors raises its own SafetensorError for malformed headers
        raise ValueError(f"not a valid safetensors state: {exc}") from exc
