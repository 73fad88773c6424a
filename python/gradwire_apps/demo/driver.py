"""The main job, ``gradwire demo``: three ways to train the same model through the server, side by side.

:func:`run_demo` starts the aggregation server on loopback (:class:`gradwire_server.launcher.LoopbackServer`)
unless given a running one, then for each of three runs trains the same task from the same initial
weights on N worker processes (:func:`~gradwire_apps.demo.runs.run_distributed`):

- DeMo (``algorithm="demo"``): nodes send the top-k DCT of their decoupled momentum with 1-bit values and
  Rice-coded positions; the server publishes the round's frames and everyone applies ``−lr·sign(mean)``;
- Panthalia's path (``algorithm="adamw"``): DCT-compressed gradients up, AdamW on the server, the
  DCT-compressed weight diff down;
- the uncompressed baseline: fp32 gradients up, AdamW, fp32 diffs down.

The workers apply what the server publishes and check its weights hash after every round. At the end it prints a table (loss, accuracy,
bytes per round each way, compression; :mod:`~gradwire_apps.demo.report`) and plots loss against rounds
and against bytes sent (:mod:`~gradwire_apps.demo.plot`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .plot import plot_distributed
from .report import result_json, results_table
from .runs import DistributedResult, codec_spec, run_distributed
from .tasks import make_task

__all__ = ["DemoSettings", "run_demo"]


@dataclass
class DemoSettings:
    """The knobs of ``gradwire demo`` (defaults sized for a couple of minutes on two cores)."""

    model: str = "digits"
    workers: int = 4
    rounds: int = 150
    hidden: Optional[int] = None  # the task's default width
    batch_size: int = 32
    lr: float = 3e-3
    demo_lr: float = 1e-2
    demo_topk: int = 4
    topk: int = 32
    chunk: int = 32
    aggregation: str = "mean"
    seed: int = 0
    out_dir: str = "demo_out"


def run_demo(
    settings: DemoSettings,
    *,
    url: Optional[str] = None,
    admin_token: Optional[str] = None,
    console=None,
    progress: bool = True,
) -> list[DistributedResult]:
    """The three runs on one server, then the table and the plot.

    Starts a server on loopback unless ``url`` (and ``admin_token``) name a running one. Writes
    ``<out_dir>/loss.png`` and ``<out_dir>/results.json``; returns the runs' results.
    """
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or logged: wide enough for the table on one line per run
            console = Console(width=120)
    if url is not None and not admin_token:
        raise ValueError("an existing server needs its admin token")
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dct = codec_spec("dct", chunk_shape=[settings.chunk, settings.chunk], topk=settings.topk)
    identity = codec_spec("identity")
    demo_codec = codec_spec("dct", chunk_shape=[settings.chunk, settings.chunk], topk=settings.demo_topk,
                            mode="tiles", index_coding="rice", value_bits=1)
    demo_run = {"algorithm": "demo", "demo": {"lr": settings.demo_lr, "beta": 0.999}}
    plans = [
        (f"DeMo k={settings.demo_topk} 1-bit", demo_codec, identity, demo_run),
        (f"Panthalia DCT k={settings.topk}", dct, dct, None),
        ("fp32 dense", identity, identity, None),
    ]
    task = make_task(settings.model, settings.hidden)

    def train_all(server_url: str, token: str) -> list[DistributedResult]:
        return [
            run_distributed(
                server_url, token, label=label, uplink=uplink, downlink=downlink,
                task=task, workers=settings.workers, rounds=settings.rounds,
                batch_size=settings.batch_size, lr=settings.lr, aggregation=settings.aggregation,
                seed=settings.seed, run_config=run_config, log_dir=out / "logs", progress=progress,
            )
            for label, uplink, downlink, run_config in plans
        ]

    if url is None:
        try:
            from gradwire_server.launcher import LoopbackServer
        except ImportError as exc:
            raise RuntimeError(
                f"the aggregation server is not installed ({exc}): pip install 'gradwire[apps]' "
                "(from a gradwire checkout: pip install ./server; `make demo` does it)"
            ) from None
        # One thread for the server's torch: it shares the cores with every worker.
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with LoopbackServer(env=env) as server:  # SQLite and safetensors in a temporary directory
            console.print(f"server on {server.url} (data in {server.data_dir}); {settings.workers} workers per run")
            results = train_all(server.url, server.admin_token)
    else:
        results = train_all(url, admin_token)

    console.print(results_table(results))
    plot_path = out / "loss.png"
    plot_distributed(results, plot_path)
    (out / "results.json").write_text(json.dumps([result_json(r) for r in results], indent=2))
    console.print(f"loss plot: {plot_path}")
    return results
