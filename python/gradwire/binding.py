"""Frames bound to their run: one empty record named ``@run:<hash>`` (docs/FORMAT.md section 10).

A node's update frame for round ``r`` of run ``R`` carries, after its tensor records, a record named
``@run:`` followed by the 32 hex digits of :func:`run_binding` ``(R, r)`` (BLAKE2b-128 of the run id and
the round). It holds no values (identity codec, float32, shape ``(0,)``), so it costs about 70 bytes and
needs no change to the frame layout: every reader parses it as a record. The server refuses a frame
whose binding names another run or round (422 ``run_binding_mismatch``), so a frame captured from one
run — from the wire or from another run's published versions — is refused verbatim by every other run,
and by the same run in any other round. Receivers strip the record (:func:`split_binding`) before the
records are aggregated.

What it does not do: whoever holds a node token of a run can send that run any bytes, including another
run's records under a freshly computed binding. That is a crafted update like any other, and what bounds
it is the run's aggregation rule (``bounded_mean`` by default; docs/SERVER.md, "Rogue nodes").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from .errors import error
from .frame import Entry, Frame

__all__ = ["RUN_BINDING_PREFIX", "binding_entry", "run_binding", "split_binding", "strip_binding"]

#: The name of a binding record starts with this; the 32 hex digits of :func:`run_binding` follow.
RUN_BINDING_PREFIX = "@run:"
_IDENTITY = 0  # the identity codec's id (docs/FORMAT.md section 5.1)
_PERSON = b"gradwire-run-v1"


def run_binding(run_id: str, round: int) -> str:
    """BLAKE2b-128 (personalization ``gradwire-run-v1``) of the run id's UTF-8 bytes, a zero byte and the
    round as a little-endian u64, as 32 lowercase hex digits."""
    if not 0 <= int(round) < 1 << 64:
        raise ValueError(f"round must fit a u64, got {round}")
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(run_id.encode("utf-8") + b"\0" + int(round).to_bytes(8, "little"))
    return h.hexdigest()


def binding_entry(run_id: str, round: int) -> Entry:
    """The binding record of run ``run_id``'s round ``round``: append it to a frame's records."""
    return Entry(
        RUN_BINDING_PREFIX + run_binding(run_id, round),
        _IDENTITY,
        torch.float32,
        (0,),
        b"",
        {"data": np.zeros(0, dtype=np.float32)},
    )


def split_binding(entries: Sequence[Entry]) -> tuple[list[Entry], str | None]:
    """``(the other records, the binding's hex digits or None)``. :class:`FrameError` for more than one
    binding record or one that is not an empty float32 identity record named with 32 hex digits (kind
    ``invalid_run_binding``)."""
    rest: list[Entry] = []
    found: str | None = None
    for e in entries:
        if not e.name.startswith(RUN_BINDING_PREFIX):
            rest.append(e)
            continue
        digits = e.name[len(RUN_BINDING_PREFIX) :]
        if found is not None:
            raise error("invalid_run_binding", "a frame holds at most one @run binding record")
        if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
            raise error(
                "invalid_run_binding",
                f"binding record {e.name[:48]!r}: the name must be '@run:' and 32 lowercase hex digits",
            )
        if e.codec != _IDENTITY or e.dtype != torch.float32 or tuple(e.shape) != (0,):
            raise error(
                "invalid_run_binding",
                f"binding record {e.name!r} must be an empty float32 identity record of shape (0,)",
            )
        found = digits
    return rest, found


def strip_binding(frame: Frame) -> Frame:
    """``frame`` without its binding record (the same frame when it has none)."""
    rest, found = split_binding(frame.entries)
    if found is None:
        return frame
    return Frame(round=frame.round, sender=frame.sender, bundle=frame.bundle, entries=rest)
