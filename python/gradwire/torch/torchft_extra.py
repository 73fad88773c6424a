"""torchft, the optional extra ``gradwire[torchft]``: imported here only, when fault tolerance is asked for.

Without torchft installed nothing in gradwire changes; :func:`torchft_modules` raises an ``ImportError`` that
names the install line.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

__all__ = ["TORCHFT_INSTALL", "torchft_modules"]

#: The install line for the extra.
TORCHFT_INSTALL = "pip install 'gradwire[torchft]'"


def torchft_modules(who: str) -> SimpleNamespace:
    """torchft's ``Manager``, ``ProcessGroupGloo``, ``CheckpointTransport`` and ``LighthouseServer``; ``who``
    (what needs them) is named in the ``ImportError`` when torchft is not installed."""
    try:
        manager = importlib.import_module("torchft.manager")
        process_group = importlib.import_module("torchft.process_group")
        transport = importlib.import_module("torchft.checkpointing.transport")
        coordination = importlib.import_module("torchft.coordination")
    except ImportError as exc:
        raise ImportError(f"{who} needs torchft, an optional extra: {TORCHFT_INSTALL} ({exc})") from exc
    return SimpleNamespace(
        Manager=manager.Manager,
        ProcessGroupGloo=process_group.ProcessGroupGloo,
        CheckpointTransport=transport.CheckpointTransport,
        LighthouseServer=coordination.LighthouseServer,
    )
