"""The main job, ``gradwire demo``: the same model trained through the server, side by side.

:func:`run_demo` starts the aggregation server on loopback (:class:`gradwire_server.launcher.LoopbackServer`)
unless given a running one, then for each run trains the same task from the same initial weights on N
worker processes (:func:`~gradwire_apps.demo.runs.run_distributed`), every node on its own shard, the same
number of steps and samples per node in every run:

- SparseLoCo (``algorithm="sparseloco"``, the headline): ``sync_every`` local AdamW steps per node, then the
  pseudo-gradient sent as a top-k DCT with 2-bit values and error feedback; the server re-encodes the
  round's exact mean with its own error feedback (``publish="aggregate"``) and publishes one frame, so
  what a node receives stays as small as what it sends whatever the node count;
- DeMo (``algorithm="demo"``): the top-k DCT of each node's decoupled momentum at 1 bit, the mean
  re-encoded the same way, everyone applies ``−lr·sign(mean)``;
- dense AdamW: fp32 gradients up, AdamW on the server over the global batch, fp32 diffs down;
- optionally Panthalia's path (``--runs panthalia``): DCT gradients up, AdamW on the server, DCT weight
  diff down.

The workers apply what the server publishes and check its weights hash after every version. At the end it
prints a table led by the held-out gap to dense AdamW and the compression each way
(:mod:`~gradwire_apps.demo.report`) and plots loss against steps and against the bytes a node sent and
received (:mod:`~gradwire_apps.demo.plot`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import install_hint
from .kernels import portable_kernels
from .plot import plot_distributed
from .report import result_json, results_table
from .runs import DistributedResult, codec_spec, run_distributed
from .settings import DEFAULT_RUNS, RUNS, DemoSettings
from .tasks import make_task

__all__ = ["DEFAULT_RUNS", "RUNS", "DemoSettings", "run_demo"]


def _plans(settings: DemoSettings) -> list[tuple[str, dict, dict | None, dict | None, int]]:
    """``(label, uplink, downlink or None for the algorithm's default, run config, versions)`` per run."""
    from gradwire.algorithms.sparseloco import sparseloco_codec_params

    identity = codec_spec("identity")
    dct = codec_spec("dct", chunk_shape=[settings.chunk, settings.chunk], topk=settings.topk)
    demo_codec = codec_spec(
        "dct",
        chunk_shape=[settings.chunk, settings.chunk],
        topk=settings.demo_topk,
        mode="tiles",
        index_coding="rice",
        value_bits=1,
    )
    sl_params = sparseloco_codec_params(settings.sync_every)
    if settings.sparseloco_topk is not None:
        # The demo's own k for every chunk (its tuned setting: the digits MLP's 64-wide layers cut into
        # chunks smaller than 64×64, which the library's proportional default would give fewer).
        sl_params.update(topk=settings.sparseloco_topk, topk_scaling="fixed")
    sl_codec = codec_spec("dct", **sl_params)
    sparseloco = {
        "algorithm": "sparseloco",
        "publish": "aggregate",
        "sparseloco": {
            "sync_every": settings.sync_every,
            "inner": {"lr": settings.inner_lr},
            "outer_lr": settings.outer_lr,
            "outer_momentum": settings.outer_momentum,
            "nesterov": settings.outer_momentum > 0,
        },
    }
    demo = {"algorithm": "demo", "publish": "aggregate", "demo": {"lr": settings.demo_lr, "beta": 0.999}}
    k = sl_params["topk"]
    plans = {
        "sparseloco": (
            f"SparseLoCo H={settings.sync_every} k={k}",
            sl_codec,
            sl_codec,
            sparseloco,
            settings.steps // settings.sync_every,
        ),
        "demo": (f"DeMo k={settings.demo_topk}", demo_codec, demo_codec, demo, settings.steps),
        "dense": ("dense AdamW", identity, identity, None, settings.steps),
        "panthalia": (f"Panthalia DCT k={settings.topk}", dct, dct, None, settings.steps),
    }
    return [plans[r] for r in settings.runs]


def run_demo(
    settings: DemoSettings,
    *,
    url: str | None = None,
    admin_token: str | None = None,
    console=None,
    progress: bool = True,
) -> list[DistributedResult]:
    """The runs on one server, then the table and the plot.

    Starts a server on loopback unless ``url`` (and ``admin_token``) name a running one. Writes
    ``<out_dir>/loss.png`` and ``<out_dir>/results.json``; returns the runs' results.
    """
    from rich.console import Console

    # Before this process's first torch kernel; the server and the workers inherit it (kernels.py).
    os.environ.update(portable_kernels())
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or logged: wide enough for the table on one line per run
            console = Console(width=160)
    if url is not None and not admin_token:
        raise ValueError("an existing server needs its admin token")
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plans = _plans(settings)
    task = make_task(settings.model, settings.hidden)

    def train_all(server_url: str, token: str) -> list[DistributedResult]:
        return [
            run_distributed(
                server_url,
                token,
                label=label,
                uplink=uplink,
                downlink=downlink,
                task=task,
                workers=settings.workers,
                rounds=versions,
                batch_size=settings.batch_size,
                lr=settings.lr,
                aggregation=settings.aggregation,
                seed=settings.seed,
                run_config=run_config,
                log_dir=out / "logs",
                progress=progress,
            )
            for label, uplink, downlink, run_config, versions in plans
        ]

    if url is None:
        try:
            from gradwire_server.launcher import LoopbackServer
        except ImportError as exc:
            raise RuntimeError(
                f"the aggregation server is not installed ({exc}): {install_hint(['gradwire_server'])}; "
                "`make demo` does it"
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
