"""The demo's report: a rich table of the runs side by side, led by the held-out gap to dense AdamW and the
compression each way, and each run as plain JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runs import DistributedResult

__all__ = ["dense_reference", "held_out_gap", "result_json", "results_table"]


def dense_reference(results: Sequence[DistributedResult]) -> DistributedResult | None:
    """The uncompressed run (fp32 both ways), if there is one: what the gaps are measured against."""
    return next((r for r in results if r.label.startswith("dense")), None)


def held_out_gap(result: DistributedResult, dense: DistributedResult | None) -> float | None:
    """``result``'s held-out loss relative to the dense run's (``+0.02`` is 2 % higher), or None."""
    if dense is None or not dense.test_loss > 0:
        return None
    return result.test_loss / dense.test_loss - 1.0


def results_table(results: Sequence[DistributedResult]):
    """The demo's rich table: one row per run."""
    from rich.table import Table

    first = results[0]
    dense = dense_reference(results)
    steps = max(r.steps for r in results)
    title = (
        f"{first.title} ({first.params:,} parameters), {first.workers} nodes, {steps} steps per node, "
        "through the server"
    )
    table = Table(
        title=title,
        caption="held-out: test loss and its gap to dense AdamW on the same steps and samples; "
        "× up / × down: fp32 model bytes ÷ bytes a node sent / received per step; rounds missed: "
        "rounds that closed without a node, over all nodes; s: seconds from the workers' start to "
        "the last version, the progress bar's clock",
    )
    for col in (
        "run",
        "held-out loss",
        "gap vs dense",
        "× up",
        "× down",
        "test acc",
        "bytes up/step",
        "bytes down/step",
        "in sync",
        "rounds missed",
        "s",
    ):
        table.add_column(col, justify="right")
    for r in results:
        gap = held_out_gap(r, dense)
        table.add_row(
            r.label,
            f"{r.test_loss:.3f}",
            "—" if gap is None or r is dense else f"{100 * gap:+.1f}%",
            f"{r.up_ratio:,.0f}",
            f"{r.down_ratio:,.0f}",
            f"{100 * r.test_accuracy:.1f}%",
            f"{r.up_per_node_step:,.0f}",
            f"{r.down_per_node_step:,.0f}",
            f"{sum(h == r.server_hash for h in r.node_hashes.values())}/{r.workers}",
            # Rounds a node joined late for (or closed without it): never hidden behind "in sync".
            f"{r.rounds_missed}",
            f"{r.seconds:.0f}",
        )
    return table


def result_json(r: DistributedResult) -> dict:
    """One run's result as plain JSON (what ``results.json`` holds)."""
    return {
        "label": r.label,
        "run_id": r.run_id,
        "workers": r.workers,
        "rounds": r.rounds,
        "steps": r.steps,
        "params": r.params,
        "losses": r.losses,
        "up_bytes": r.up_bytes,
        "down_bytes": r.down_bytes,
        "up_ratio": r.up_ratio,
        "down_ratio": r.down_ratio,
        "test_loss": r.test_loss,
        "test_accuracy": r.test_accuracy,
        "server_hash": r.server_hash,
        "node_hashes": {str(k): v for k, v in r.node_hashes.items()},
        "in_sync": r.in_sync,
        "joined": {str(k): v for k, v in r.joined.items()},
        "rounds_missed": r.rounds_missed,
        "state_loads": r.state_loads,
        "seconds": r.seconds,
        "total_seconds": r.total_seconds,
    }
