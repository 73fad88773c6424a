"""Timing shared by the bench scripts: the fastest of repeated runs (the least disturbed on a shared machine)."""

from __future__ import annotations

import time


def timed(fn, repeat: int = 3):
    """``(fastest wall seconds of `repeat` calls, the last call's result)``."""
    fastest, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest, out


def best(fn, repeat: int) -> float:
    """Fastest wall seconds of ``repeat`` calls of ``fn``."""
    return timed(fn, repeat)[0]
