"""Aggregation rules: a round's updates (bundle frames) → one gradient per parameter.

- ``mean``: the (staleness-)weighted mean. Summed in the codec's domain where the codec registered an
  accumulator (:mod:`gradwire.accumulate`): for the DCT, all nodes' sparse coefficients are added into one
  coefficient array and one inverse transform runs per parameter, so a round costs the bytes received
  plus one transform, not nodes × parameters.
- ``clipped_mean``: each update scaled by ``min(1, median_norm / norm)`` before the mean, the norms taken
  over the whole update (all parameters) in the codec's domain (:func:`gradwire.accumulate.entry_norm`).
  A rogue update can then weigh no more than a median one.
- ``trimmed_mean``: per coordinate, drop the ``floor(trim_fraction · n)`` largest and smallest values
  and average the rest. Decodes every update densely (order statistics have no sparse form).
- ``median``: per coordinate median (mean of the two middle values when n is even); dense too.

Staleness weights (late updates accepted under ``late_policy="staleness"``) enter the two means as
weights, ``Σ wᵢ cᵢ uᵢ / Σ wᵢ``; the coordinate-wise rules ignore them (each update is one vote).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from gradwire.accumulate import make_accumulator
from gradwire.algorithms import trim_count
from gradwire.frame import Entry, Frame, decode_entry

__all__ = ["RULES", "Update", "aggregate", "clip_factors", "mean_weights", "published_weights"]

RULES = ("mean", "clipped_mean", "trimmed_mean", "median")


@dataclass
class Update:
    """One node's validated update: its parsed bundle, its staleness weight and its L2 norm (and, for the
    algorithms that publish the nodes' frames, the bytes it came in)."""

    frame: Frame
    weight: float = 1.0
    norm: float = 0.0
    node_id: int = 0
    raw: bytes = b""
    sha256: str = ""

    def entries(self) -> dict[str, Entry]:
        return {e.name: e for e in self.frame.entries}


def clip_factors(norms: Sequence[float]) -> list[float]:
    """``min(1, median / norm)`` per update: every update is scaled to at most the median norm."""
    if not norms:
        return []
    med = statistics.median(norms)
    return [1.0 if n <= med or n == 0.0 else med / n for n in norms]


def mean_weights(updates: Sequence[Update], rule: str) -> list[float]:
    """Each update's coefficient in the ``mean`` or ``clipped_mean`` of ``updates``: ``wᵢ cᵢ / Σ wᵢ``."""
    if rule not in ("mean", "clipped_mean"):
        raise ValueError(f"rule {rule!r} is no weighted mean")
    clip = clip_factors([u.norm for u in updates]) if rule == "clipped_mean" else [1.0] * len(updates)
    total = sum(u.weight for u in updates)
    return [u.weight * c / total for u, c in zip(updates, clip)]


def published_weights(updates: Sequence[Update], rule: str, trim_fraction: float) -> tuple[list[float], int]:
    """``(weights, trim)`` for a published version of ``updates`` (DeMo, SparseLoCo): the weighted means
    put everything in the weights (trim 0); the coordinate-wise rules trim ``trim`` values from each end
    and ignore the weights, written as the plain shares for the record."""
    trim = trim_count(rule, len(updates), trim_fraction)
    if rule in ("mean", "clipped_mean"):
        return mean_weights(updates, rule), trim
    total = sum(u.weight for u in updates)
    return [u.weight / total for u in updates], trim


def _weighted_sum(entries: Sequence[Entry], weights: Sequence[float], device: Optional[torch.device]) -> torch.Tensor:
    acc = make_accumulator(entries[0], device)
    for e, w in zip(entries, weights):
        acc.add(e, w)
    return acc.finish()


def _stack_dense(entries: Sequence[Entry], device: Optional[torch.device]) -> torch.Tensor:
    return torch.stack([decode_entry(e, device).to(torch.float32) for e in entries])


def _trimmed_mean(stacked: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    n = stacked.shape[0]
    t = min(int(math.floor(trim_fraction * n)), (n - 1) // 2)
    if t == 0:
        return stacked.mean(dim=0)
    ordered, _ = torch.sort(stacked, dim=0)
    return ordered[t : n - t].mean(dim=0)


def _median(stacked: torch.Tensor) -> torch.Tensor:
    n = stacked.shape[0]
    ordered, _ = torch.sort(stacked, dim=0)
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) * 0.5


def aggregate(
    updates: Sequence[Update],
    names: Sequence[str],
    rule: str = "mean",
    trim_fraction: float = 0.2,
    device: Optional[torch.device] = None,
) -> dict[str, torch.Tensor]:
    """The aggregated float32 gradient ``{name: tensor}`` of ``updates`` under ``rule``.

    Updates are combined in the order given (the caller sorts them, e.g. by node id), so the result is
    deterministic. Every update must hold every name in ``names`` (the server validated that).
    """
    if rule not in RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; known: {', '.join(RULES)}")
    if not updates:
        raise ValueError("nothing to aggregate")
    per_update = [u.entries() for u in updates]
    out: dict[str, torch.Tensor] = {}
    if rule in ("mean", "clipped_mean"):
        coeffs = mean_weights(updates, rule)
        for name in names:
            out[name] = _weighted_sum([p[name] for p in per_update], coeffs, device)
        return out
    for name in names:
        stacked = _stack_dense([p[name] for p in per_update], device)
        out[name] = _trimmed_mean(stacked, trim_fraction) if rule == "trimmed_mean" else _median(stacked)
    return out
