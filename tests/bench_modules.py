"""The benches as modules for the tests: ``bench/`` is a folder of scripts, not a package, and its scripts
import each other by name (``from demo_reference import …``), as a script's own folder on ``sys.path``
provides. :func:`load_bench` loads one from its file and registers it under that name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
#: The sibling scripts a bench imports by name (loaded first, as the script's own folder would provide them).
SIBLINGS = {
    "step_ops": ("demo_reference",),
    "optimizer_step": ("demo_reference",),
    "dct_codec": ("demo_reference",),
    "dct_indices": ("timing",),
    "kernels": ("timing",),
}


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module, registered under ``name`` (loaded once)."""
    for sibling in SIBLINGS.get(name, ()):
        load_bench(sibling)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]
