"""Time to a target loss from logged held-out loss curves (no torch, no root: tested on its own).

A curve is the ``eval`` lines a node logged: ``(step, seconds of training clock, held-out loss)`` in
step order. The time to a target is the clock at the first evaluation whose loss is at or below it —
no interpolation between evaluations, so a row is never credited with a time it was not measured at.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    step: int
    seconds: float
    loss: float


def read_curve(path: Path) -> tuple[list[Point], dict]:
    """The ``eval`` points of a node's JSON-lines log, and its ``done`` line (``{}`` if it never ended)."""
    points, done = [], {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if event["event"] == "eval":
            points.append(Point(int(event["step"]), float(event["t"]), float(event["loss"])))
        elif event["event"] == "done":
            done = event
    return points, done


def final_loss(curve: Sequence[Point]) -> float:
    """The held-out loss at the last evaluation (the target the compressed rows must reach)."""
    if not curve:
        raise ValueError("an empty curve has no final loss")
    return curve[-1].loss


def time_to_loss(curve: Iterable[Point], target: float) -> Point | None:
    """The first point at or below ``target`` (None if the curve never gets there)."""
    if math.isnan(target):
        raise ValueError("the target loss is NaN")
    for p in curve:
        if p.loss <= target:
            return p
    return None


def speedup(baseline: Point | None, row: Point | None) -> float | None:
    """How many times sooner ``row`` reached the target than ``baseline`` (None if either never did)."""
    if baseline is None or row is None:
        return None
    if row.step == 0:
        raise ValueError("a row reached the target at step 0: it started there (the target is above the initial loss)")
    return baseline.seconds / row.seconds
