"""Fewer ways to round: the demo's processes run torch's portable CPU kernels.

torch picks its CPU kernels by what the processor offers (AVX2, AVX-512) and MKL and oneDNN do the same;
the kernels differ in how they round (a sum over 16 lanes is not a sum over 8), so the same seed trained on
an AVX-512 machine and on an AVX2 one ends at different weights, and the demo's table differs in its last
digits (the README's once did). The demo's training is tiny, so it runs every process — the server, each
worker and its own final evaluation — on the kernels every x86-64 processor runs alike: ATen's baseline
(``ATEN_CPU_CAPABILITY=default``), MKL's conditional numerical reproducibility (``MKL_CBWR=COMPATIBLE``) and
oneDNN's SSE4.1 code (``ONEDNN_MAX_CPU_ISA=SSE41``). A variable already set is left as it is. The same torch
version is still needed for the same bits, and it is not enough: measured on 2026-12-02, one torch and one seed
gave different tables on two kinds of x86-64 processor, so the README's table names both
(scripts/docs_tables.py's ``cpu_fingerprint``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["PORTABLE_KERNELS", "portable_kernels"]

#: What each variable pins (read by torch, MKL and oneDNN before their first kernel runs).
PORTABLE_KERNELS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
}


def portable_kernels(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """:data:`PORTABLE_KERNELS`, less the variables ``environ`` (default ``os.environ``) already sets."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in PORTABLE_KERNELS.items() if not env.get(k)}
