"""The OpenMP wait policy of a server process, chosen before torch loads.

torch's CPU threads come from OpenMP (libgomp in the PyPI wheels). After each parallel region its
workers spin for a while before they sleep; with a pause instruction of ~140 cycles, libgomp's default
300,000 spins last several milliseconds. The round close alternates torch operations with Rust kernels
that run on their own threads (the exact DCT decode, top-k selection, BLAKE3), so on a machine with as
many cores as torch threads those kernels spend their first milliseconds sharing every core with
spinning workers. Measured on 2 cores (bench/close_vs_adamw.py): the downlink encode at 10 M parameters
takes 0.11-0.17 s with ``OMP_WAIT_POLICY=PASSIVE`` against 0.16-0.20 s without; one AdamW step is
unchanged (0.027 against 0.029 s).

libgomp reads the policy once, when it loads, so this must run before anything imports torch: the
entry points (``python -m gradwire_server``, ``gradwire``) call it first. A policy the user set is kept.
"""

from __future__ import annotations

import os
import sys

__all__ = ["prefer_passive_openmp"]


def prefer_passive_openmp() -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process (and its children) unless a policy is set or
    torch is already loaded. Returns the policy in force: ``"PASSIVE"``, the user's, or ``"default"``
    where torch loaded first."""
    chosen = os.environ.get("OMP_WAIT_POLICY")
    if chosen:
        return chosen.upper()
    if "torch" in sys.modules:
        return "default"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"
