"""The HF Trainer's checkpoints of a gradwire optimizer, resumable on every rank.

The Trainer saves ``optimizer.state_dict()`` from rank 0 alone and, with ``resume_from_checkpoint``, loads
that one file on every rank. A gradwire optimizer's state is per rank (its momenta or error buffers; with
``exchange="sharded"`` the owner's error feedback too), so rank 0's file alone cannot resume rank 1.
:class:`FullOptimizerState`, a Trainer callback, rewrites the file after each save with
:meth:`~gradwire.torch.DeMo.full_state_dict`: every rank's share, gathered by a collective that every rank
runs (``on_save`` runs on every rank, after rank 0 wrote the file). On resume each rank's
``load_state_dict`` takes its own share, so the run continues as it was saved.

    trainer = Trainer(..., optimizers=(opt, None), callbacks=[FullOptimizerState()])

Needs ``transformers`` (imported here, so ``import gradwire.torch`` does not need it).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["FullOptimizerState", "OPTIMIZER_FILE"]

#: The Trainer's name for the optimizer's file in a checkpoint folder (transformers' ``OPTIMIZER_NAME``).
OPTIMIZER_FILE = "optimizer.pt"
#: Its checkpoint folders: ``<output_dir>/checkpoint-<global step>`` (transformers' ``PREFIX_CHECKPOINT_DIR``).
CHECKPOINT_PREFIX = "checkpoint"


def gradwire_optimizer(optimizer: Any) -> Any | None:
    """The gradwire optimizer inside ``optimizer`` (the Trainer hands over Accelerate's wrapper), or ``None``."""
    seen = 0
    while optimizer is not None and not hasattr(optimizer, "full_state_dict") and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if hasattr(optimizer, "full_state_dict") else None


class FullOptimizerState(TrainerCallback):
    """After every checkpoint the Trainer writes, replace its ``optimizer.pt`` with the optimizer's full state
    dict (every rank's share), so that ``resume_from_checkpoint`` resumes every rank (module docstring)."""

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        opt = gradwire_optimizer(optimizer)
        if opt is None:
            return control
        full = opt.full_state_dict()  # collective: every rank is here
        folder = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        path = os.path.join(folder, OPTIMIZER_FILE)
        if args.should_save and os.path.exists(path):  # the rank that wrote it, where it was written
            tmp = path + ".gradwire-tmp"
            torch.save(full, tmp)
            os.replace(tmp, path)  # a crash mid-write leaves the Trainer's own file, not half of ours
        return control
