"""The demo's plot: training loss against rounds and against bytes one node sent and received (PNG)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .runs import DistributedResult

__all__ = ["plot_distributed"]


def _smooth(values: Sequence[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_distributed(results: Sequence[DistributedResult], path: os.PathLike | str) -> None:
    """Loss against rounds and against bytes one node sent and received, one line per run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        loss = _smooth(r.losses)
        per_node = [(u + d) / r.workers for u, d in zip(r.up_bytes, r.down_bytes)]
        cumulative, total = [], 0.0
        for b in per_node:
            total += b
            cumulative.append(total)
        ax1.plot(range(len(loss)), loss, label=r.label)
        ax2.plot(cumulative, loss, label=r.label)
    ax1.set(xlabel="round", ylabel="training loss (5-round mean over nodes)", yscale="log")
    ax2.set(xlabel="bytes one node sent + received", ylabel="training loss (5-round mean over nodes)", xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
