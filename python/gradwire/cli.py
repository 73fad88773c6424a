"""The ``gradwire`` command."""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gradwire: compressed gradient transport.")


@app.command()
def demo(
    steps: int = typer.Option(300, help="AdamW steps per run."),
    topk: int = typer.Option(32, help="DCT coefficients kept per chunk."),
    chunk: int = typer.Option(64, help="Chunk side: chunks are chunk×chunk."),
    seed: int = typer.Option(0),
    plot: Optional[str] = typer.Option("demo_out/loss.png", help="Where to write the loss plot ('' for none)."),
) -> None:
    """Train a small MLP on scikit-learn's digits twice: dense gradients, and DCT-compressed ones."""
    from rich.console import Console
    from rich.table import Table

    from .codecs import DCTCodec
    from .demo import load_digits, train_digits

    console = Console()
    data = load_digits(seed)
    runs = [
        train_digits(None, label="dense fp32", steps=steps, seed=seed, data=data),
        train_digits(DCTCodec(chunk_shape=(chunk, chunk), topk=topk), label=f"DCT k={topk}", steps=steps, seed=seed, data=data),
    ]
    base = runs[0].mean_bytes_per_step
    table = Table(title=f"digits MLP, {steps} AdamW steps")
    for col in ("run", "bytes/step", "vs dense", "final train loss", "test loss", "test accuracy"):
        table.add_column(col, justify="right")
    for r in runs:
        tail = r.losses[-20:]
        table.add_row(
            r.label,
            f"{r.mean_bytes_per_step:,.0f}",
            f"{base / r.mean_bytes_per_step:.1f}×",
            f"{sum(tail) / len(tail):.4f}",
            f"{r.test_loss:.4f}",
            f"{100 * r.test_accuracy:.1f}%",
        )
    console.print(table)
    if plot:
        _plot_runs(runs, plot)
        console.print(f"loss plot: {plot}")


def _plot_runs(runs, path: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        smooth = [sum(r.losses[max(0, i - 9) : i + 1]) / len(r.losses[max(0, i - 9) : i + 1]) for i in range(len(r.losses))]
        sent = 0
        cum = []
        for b in r.bytes_per_step:
            sent += b
            cum.append(sent)
        ax1.plot(smooth, label=r.label)
        ax2.plot(cum, smooth, label=r.label)
    ax1.set(xlabel="step", ylabel="training loss (10-step mean)", yscale="log")
    ax2.set(xlabel="bytes sent", ylabel="training loss (10-step mean)", xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
