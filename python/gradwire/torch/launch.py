"""Starting a process group: under ``torchrun`` (env://) or as local worker processes.

:func:`init_from_env` is what a script calls when ``torchrun`` started it. :func:`spawn` starts
``nprocs`` local ranks itself, rendezvousing through a file store in a private temporary directory
(no port to pick, no race for one), and hands back what each rank's function returned (JSON values,
written to files: nothing crosses between processes as a pickle).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is first
    # imported, and torch imports it lazily: through torch._dynamo, the first time an optimizer is built.
    # Imported after init_process_group, those defaults hold the default process group for the life of the
    # process, so destroy_process_group() cannot free it; gloo's worker threads then outlive the
    # interpreter's finalization, and one that drops its last collective's tensors there aborts the
    # process at exit ("terminate called without an active exception": about 1 two-machine torchrun job
    # in 25 on a loaded 2-core machine). Imported here, before any process group exists, they are None.
    import torch.distributed.nn.functional  # noqa: F401
except ImportError:  # a torch built without distributed support
    pass

__all__ = ["NoLauncherError", "default_backend", "init_from_env", "spawn"]

#: What torchrun (or any env:// launcher) sets for every rank.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class NoLauncherError(RuntimeError):
    """The process was started without a launcher: ``init_from_env`` has no rank or world to join."""


def default_backend() -> str:
    """``"nccl"`` where CUDA GPUs and NCCL are there, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _bind_device(backend: str, local_rank: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def init_from_env(backend: str | None = None, *, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…).

    Returns ``(rank, world_size)``. With NCCL the rank's GPU (``LOCAL_RANK``) becomes the current device.
    Raises :class:`NoLauncherError` naming the variables a launcher sets when they are missing.
    """
    missing = [v for v in LAUNCHER_VARIABLES if v not in os.environ]
    if missing:
        # Checked here: torch would otherwise fail deep in its rendezvous with "RANK expected".
        script = sys.argv[0] if sys.argv and sys.argv[0] else "script.py"
        raise NoLauncherError(
            f"{', '.join(missing)} not set: this process was not started by a launcher. Run it "
            f"under torchrun, e.g. `torchrun --nproc-per-node 2 {script}`"
        )
    backend = backend or default_backend()
    _bind_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    backend: str,
    workdir: str,
    timeout_s: float,
    args: Sequence[Any],
) -> None:
    _bind_device(backend, rank)
    # Ranks share the machine's cores: as torchrun does (OMP_NUM_THREADS=1), keep their thread pools
    # from oversubscribing it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        backend,
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world, *args)
        if result is not None:
            Path(workdir, f"result{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    start_method: str | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` local ranks of a fresh process group.

    Returns each rank's return value (JSON-serializable, or ``None``), in rank order. A rank that raises
    makes this raise (the others are terminated). ``start_method`` defaults to ``"fork"`` (fast: no
    re-import) unless CUDA is in use, where it is ``"spawn"``; with ``"spawn"``, ``fn`` must be
    importable by name. ``timeout_s`` bounds every collective.
    """
    backend = backend or default_backend()
    if start_method is None:
        start_method = "spawn" if backend == "nccl" or torch.cuda.is_initialized() else "fork"
    if start_method == "fork":
        # DistributedDataParallel imports torch._dynamo on first use, seconds of work; done once here,
        # every forked rank inherits it instead of paying again.
        importlib.import_module("torch._dynamo")
    workdir = tempfile.mkdtemp(prefix="gradwire-pg-")
    try:
        mp.start_processes(
            _worker,
            args=(fn, nprocs, backend, workdir, timeout_s, tuple(args)),
            nprocs=nprocs,
            join=True,
            start_method=start_method,
        )
        results = []
        for rank in range(nprocs):
            path = Path(workdir, f"result{rank}.json")
            results.append(json.loads(path.read_text()) if path.exists() else None)
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
