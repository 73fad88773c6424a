"""The demo's plot: training loss against steps, and against the bytes one node sent and received, with each
run's held-out loss, under a title naming the model, the nodes and the runs (PNG)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runs import DistributedResult

__all__ = ["plot_distributed"]


def _smooth(values: Sequence[float], window: int = 8) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def plot_distributed(results: Sequence[DistributedResult], path: os.PathLike | str) -> None:
    """Three panels, one line per run: loss against steps, against the cumulative bytes one node sent, and
    against the cumulative bytes one node received."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    first = results[0]
    fig.suptitle(
        f"{first.title} ({first.params:,} parameters), {first.workers} nodes through the server: "
        + "; ".join(r.label for r in results),
        fontsize=11,
    )
    for r in results:
        loss = _smooth(r.losses)
        sent = list(accumulate(u / r.workers for u in r.up_bytes))
        received = list(accumulate(d / r.workers for d in r.down_bytes))
        label = f"{r.label} ({r.up_ratio:,.0f}× up, {r.down_ratio:,.0f}× down)"
        (line,) = axes[0].plot(range(1, len(loss) + 1), loss, label=label)
        axes[1].plot(sent, loss, label=label, color=line.get_color())
        axes[2].plot(received, loss, label=label, color=line.get_color())
        # The held-out loss the table reports, where each run ended: the measure that says who won.
        ends = ((axes[0], len(loss)), (axes[1], sent[-1] if sent else 0), (axes[2], received[-1] if received else 0))
        for ax, x in ends:
            ax.plot(
                [x],
                [r.test_loss],
                marker="*",
                markersize=12,
                color=line.get_color(),
                linestyle="none",
                label=f"{r.label}: held-out {r.test_loss:.3f}" if ax is axes[0] else None,
            )
    ylabel = "loss (line: training, 8-step mean; ★ held-out)"
    axes[0].set(xlabel="step (per node)", ylabel=ylabel, yscale="log")
    axes[1].set(xlabel="bytes one node sent", ylabel=ylabel, xscale="log", yscale="log")
    axes[2].set(xlabel="bytes one node received", ylabel=ylabel, xscale="log", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
