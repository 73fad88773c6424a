"""The demo's plot: training loss against steps, and against the bytes one node sent and received (PNG)."""

from __future__ import annotations

import os
from itertools import accumulate
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .runs import DistributedResult

__all__ = ["plot_distributed"]


def _smooth(values: Sequence[float], window: int = 8) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_distributed(results: Sequence[DistributedResult], path: os.PathLike | str) -> None:
    """Three panels, one line per run: loss against steps, against the cumulative bytes one node sent, and
    against the cumulative bytes one node received."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        loss = _smooth(r.losses)
        sent = list(accumulate(u / r.workers for u in r.up_bytes))
        received = list(accumulate(d / r.workers for d in r.down_bytes))
        label = f"{r.label} ({r.up_ratio:,.0f}× up, {r.down_ratio:,.0f}× down)"
        axes[0].plot(range(1, len(loss) + 1), loss, label=label)
        axes[1].plot(sent, loss, label=label)
        axes[2].plot(received, loss, label=label)
    ylabel = "training loss (8-step mean over nodes)"
    axes[0].set(xlabel="step (per node)", ylabel=ylabel, yscale="log")
    axes[1].set(xlabel="bytes one node sent", ylabel=ylabel, xscale="log", yscale="log")
    axes[2].set(xlabel="bytes one node received", ylabel=ylabel, xscale="log", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
