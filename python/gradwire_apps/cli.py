"""The ``gradwire`` command: ``gradwire demo`` (the distributed demo) and ``gradwire serve``.

Its dependencies come with the ``apps`` extra; without them :func:`main` says how to install them
instead of failing with a traceback.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional

from . import INSTALL_HINT

__all__ = ["build_app", "main"]

#: What ``gradwire demo`` needs beyond the command line itself (import names).
DEMO_MODULES = ("rich", "tqdm", "sklearn", "matplotlib", "gradwire_server")


def _missing(modules) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _server_hint() -> str:
    return f"{INSTALL_HINT} (gradwire-server is not on PyPI: from a gradwire checkout, pip install ./server)"


def build_app():
    """The typer application (needs typer, from the ``apps`` extra)."""
    import typer

    from .demo.settings import DEFAULT_RUNS, RUNS, DemoSettings

    app = typer.Typer(add_completion=False, no_args_is_help=True, help="gradwire: compressed gradient transport.")

    @app.command()
    def demo(
        model: str = typer.Option("digits", help="What to train: digits (MLP) or transformer (char LM on pydoc text)."),
        workers: int = typer.Option(8, min=1, help="Worker processes (nodes) per run."),
        steps: int = typer.Option(320, min=1, help="Training steps per node in every run (a multiple of --sync-every)."),
        runs: str = typer.Option(",".join(DEFAULT_RUNS), help=f"Which runs, comma-separated, of: {', '.join(RUNS)}."),
        sync_every: int = typer.Option(8, min=1, help="SparseLoCo: local steps per sync."),
        sparseloco_topk: int = typer.Option(256, min=1, help="SparseLoCo: DCT coefficients kept per 64×64 chunk, both ways."),
        inner_lr: float = typer.Option(1e-2, help="SparseLoCo: each node's local AdamW learning rate."),
        outer_lr: float = typer.Option(1.0, help="SparseLoCo: the outer step's learning rate."),
        outer_momentum: float = typer.Option(0.0, help="SparseLoCo: the outer Nesterov momentum (0: plain SGD)."),
        topk: int = typer.Option(32, min=1, help="Panthalia run: DCT coefficients kept per chunk, both ways."),
        demo_topk: int = typer.Option(4, min=1, help="DeMo run: DCT coefficients of the momentum sent per chunk."),
        demo_lr: float = typer.Option(1e-2, help="DeMo run: the sign step (best of bench/convergence.py's grid on every task)."),
        chunk: int = typer.Option(32, min=2, help="DCT chunk side of the DeMo and Panthalia runs: chunks are chunk×chunk."),
        lr: float = typer.Option(1e-2, help="Dense AdamW's learning rate (on the server)."),
        batch_size: int = typer.Option(32, min=1, help="Examples per node per step."),
        hidden: Optional[int] = typer.Option(None, min=1, help="Model width (MLP hidden units, transformer d_model)."),
        aggregation: str = typer.Option("mean", help="Aggregation rule: mean, clipped_mean, trimmed_mean or median."),
        seed: int = typer.Option(0),
        out: Path = typer.Option(Path("demo_out"), help="Where the plot, results.json and worker logs go."),
        url: Optional[str] = typer.Option(None, help="Use this running server instead of starting one on loopback."),
        admin_token: Optional[str] = typer.Option(None, envvar="GRADWIRE_ADMIN_TOKEN", help="Admin token of --url's server."),
        progress: bool = typer.Option(True, help="Draw a progress bar per run."),
    ) -> None:
        """Train a model on N worker processes through the aggregation server, compressed and not.

        Starts the server on loopback (unless --url), then runs the same training (same steps and samples per
        node) as SparseLoCo (local AdamW steps, a 2-bit top-k DCT pseudo-gradient up, the server's re-encoded
        mean down), DeMo (1-bit DCT momentum up, the re-encoded mean down) and dense AdamW (fp32 both ways),
        and prints the held-out loss, its gap to dense and the compression each way side by side, with a
        plot of loss against steps and against the bytes a node sent and received in OUT/loss.png.
        """
        missing = _missing(DEMO_MODULES if url is None else [m for m in DEMO_MODULES if m != "gradwire_server"])
        if missing:
            hint = _server_hint() if "gradwire_server" in missing else INSTALL_HINT
            typer.echo(f"gradwire demo needs {', '.join(missing)}, from the apps extra: {hint}", err=True)
            raise typer.Exit(code=2)
        try:
            settings = DemoSettings(
                model=model, workers=workers, steps=steps, hidden=hidden, batch_size=batch_size, lr=lr,
                sync_every=sync_every, sparseloco_topk=sparseloco_topk, inner_lr=inner_lr, outer_lr=outer_lr, outer_momentum=outer_momentum,
                demo_lr=demo_lr, demo_topk=demo_topk, topk=topk, chunk=chunk,
                runs=tuple(r.strip() for r in runs.split(",") if r.strip()), aggregation=aggregation, seed=seed,
                out_dir=str(out),
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        from .demo.driver import run_demo

        results = run_demo(settings, url=url, admin_token=admin_token, progress=progress)
        if not all(r.in_sync for r in results):
            raise typer.Exit(code=1)

    @app.command()
    def serve(
        host: Optional[str] = typer.Option(None, help="Address to listen on [GRADWIRE_HOST; default 127.0.0.1]."),
        port: Optional[int] = typer.Option(None, help="TCP port [GRADWIRE_PORT; default 8470]."),
        data_dir: Optional[Path] = typer.Option(None, help="SQLite and safetensors files [GRADWIRE_DATA_DIR]."),
        max_frame_bytes: Optional[int] = typer.Option(None, help="Default per-run frame ceiling [GRADWIRE_MAX_FRAME_BYTES]."),
        log_json: Optional[bool] = typer.Option(None, help="Structured JSON logs [GRADWIRE_LOG_JSON]."),
        log_level: Optional[str] = typer.Option(None, help="debug, info, warning or error [GRADWIRE_LOG_LEVEL]."),
    ) -> None:
        """Run the aggregation server (the separate gradwire-server distribution) until SIGTERM or Ctrl-C.

        Options fall back to GRADWIRE_* environment variables, then the server's defaults. The admin token
        is read from GRADWIRE_ADMIN_TOKEN only, or generated into DATA_DIR/admin_token.
        """
        try:
            import gradwire_server
            from gradwire_server.settings import ServerSettings
        except ImportError as exc:
            typer.echo(f"gradwire serve needs the aggregation server package ({exc}): {_server_hint()}", err=True)
            raise typer.Exit(code=2) from None
        given = dict(host=host, port=port, data_dir=data_dir, max_frame_bytes=max_frame_bytes, log_json=log_json,
                     log_level=log_level)
        # Only what was given on this command line: pydantic-settings fills the rest from the environment.
        settings = ServerSettings(**{k: v for k, v in given.items() if v is not None})
        gradwire_server.serve(settings)

    return app


def main() -> None:
    """The ``gradwire`` entry point."""
    if importlib.util.find_spec("gradwire_server") is not None:
        from gradwire_server.openmp import prefer_passive_openmp

        prefer_passive_openmp()  # before torch loads: `gradwire serve` closes rounds faster
    try:
        app = build_app()
    except ModuleNotFoundError as exc:
        if exc.name not in ("typer", "click", "rich"):
            raise
        print(f"gradwire: the command line needs {exc.name}, from the apps extra: {INSTALL_HINT}", file=sys.stderr)
        raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    main()
