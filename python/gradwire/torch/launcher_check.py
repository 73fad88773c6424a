"""No silent single-rank training: a process that a launcher started as one of several ranks, with no process
group, is refused before it trains.

Without an initialized process group every gradwire exchange runs as a group of one (single-process code is
rank 0 of one). Under ``torchrun`` that is a trap: if the script never calls
``torch.distributed.init_process_group``, each rank trains alone, reports its syncs and bytes, and
:func:`~gradwire.torch.replicas_agree` compares nothing, while ``WORLD_SIZE=2`` sat in the environment all
along. :func:`refuse_single_rank_launch` is called at the first step of every gradwire optimizer, by
``replicas_agree`` and ``average_buffers``, and where ``LowPrecisionDecentralized`` is built, and raises
:class:`NoProcessGroupError` naming the call to add. At the first step, not at construction: the HF Trainer
recipe builds its optimizer before ``TrainingArguments`` initializes the group. (The DDP hooks need no check:
DDP itself cannot be built without a process group.)

What counts as "a launcher of several ranks": ``WORLD_SIZE`` above 1, or ``RANK`` or ``LOCAL_RANK`` above 0:
what ``torchrun`` (and ``torch.distributed.launch``, Accelerate, DeepSpeed, Lightning's launcher) set for
every rank. ``torchrun --nproc-per-node 1`` (``WORLD_SIZE=1``, ``RANK=0``) is a group of one and runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch.distributed as dist

__all__ = ["NoProcessGroupError", "launcher_ranks", "refuse_single_rank_launch"]

#: The variables a launcher sets per rank that say how many ranks there are, or that this is not the first.
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


class NoProcessGroupError(RuntimeError):
    """A launcher started this process as one of several ranks, but no process group is initialized: every
    rank would train alone."""


def launcher_ranks(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """The launcher variables of :data:`RANK_VARIABLES` that say this process is one of several ranks, with
    their values (empty when there is no launcher, or a launcher of one rank). A variable that is not an
    integer is ignored (it is not a launcher's)."""
    env = os.environ if environ is None else environ
    found: dict[str, int] = {}
    for name in RANK_VARIABLES:
        try:
            value = int(env.get(name, ""))
        except ValueError:
            continue
        if (name == "WORLD_SIZE" and value > 1) or (name != "WORLD_SIZE" and value > 0):
            found[name] = value
    return found


def refuse_single_rank_launch(who: str, process_group: dist.ProcessGroup | None = None, runs: str = "") -> None:
    """Raise :class:`NoProcessGroupError` when ``who`` (an optimizer at its first step, a check) is about to run as
    a group of one although a launcher started this process as one of several ranks; ``runs`` names what the
    group is needed for (default ``who``). A ``process_group`` given, or an initialized default group, passes."""
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        return
    found = launcher_ranks()
    if not found:
        return
    said = ", ".join(f"{k}={os.environ[k]}" for k in RANK_VARIABLES if k in found)
    raise NoProcessGroupError(
        f"{who}: a launcher started this process as one of several ranks ({said}), but no process group is "
        f"initialized, so every rank would train alone. Add `torch.distributed.init_process_group()` (or "
        f"`gradwire.torch.init_from_env()`) at the start of the script, before {runs or who}"
    )
