"""One line of docs/results/reliability.md: what was tried, what must hold, what was seen."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """``probe``: what was done (with its sizes); ``expected``: the bound that must hold; ``observed``: the
    measured figure, in the same units; ``passed``: whether ``observed`` is inside ``expected``."""

    probe: str
    expected: str
    observed: str
    passed: bool
