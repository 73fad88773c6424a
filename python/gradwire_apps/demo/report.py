"""The demo's report: a rich table of the runs side by side, and each run as plain JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .runs import DistributedResult

__all__ = ["result_json", "results_table"]


def results_table(results: Sequence[DistributedResult]):
    """The demo's rich table: one row per run."""
    from rich.table import Table

    first = results[0]
    title = f"{first.title} ({first.params:,} parameters), {first.workers} nodes, {first.rounds} rounds through the server"
    table = Table(title=title, caption="bytes: per node per round; ×: raw fp32 model bytes ÷ those bytes")
    for col in ("run", "train loss", "test loss", "test acc", "bytes up", "bytes down", "× up", "× down", "in sync", "s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.label,
            f"{r.final_train_loss():.3f}",
            f"{r.test_loss:.3f}",
            f"{100 * r.test_accuracy:.1f}%",
            f"{r.up_per_node_round:,.0f}",
            f"{r.down_per_node_round:,.0f}",
            f"{r.dense_bytes / max(1.0, r.up_per_node_round):.1f}",
            f"{r.dense_bytes / max(1.0, r.down_per_node_round):.1f}",
            f"{sum(h == r.server_hash for h in r.node_hashes.values())}/{r.workers}",
            f"{r.seconds:.0f}",
        )
    return table


def result_json(r: DistributedResult) -> dict:
    """One run's result as plain JSON (what ``results.json`` holds)."""
    return {
        "label": r.label, "run_id": r.run_id, "workers": r.workers, "rounds": r.rounds, "params": r.params,
        "losses": r.losses, "up_bytes": r.up_bytes, "down_bytes": r.down_bytes, "test_loss": r.test_loss,
        "test_accuracy": r.test_accuracy, "server_hash": r.server_hash,
        "node_hashes": {str(k): v for k, v in r.node_hashes.items()}, "in_sync": r.in_sync,
        "joined": {str(k): v for k, v in r.joined.items()},
        "rounds_missed": r.rounds_missed, "state_loads": r.state_loads, "seconds": r.seconds,
    }
