"""Checking a submitted update frame completely before it may touch any aggregate.

Order: structure and CRC (:func:`gradwire.read_frame` with the run's limits) → bundle, sender and round
→ the run binding (docs/FORMAT.md section 10) → tensor names and shapes equal to the model's → every record decodes (in
the codec's domain where it
can: the DCT's norm parses and checks every section without a dense decode) → finite values → the
update's L2 norm (float64, so finite values never read as infinite) under ``MAX_UPDATE_NORM`` (1e30, what
a float32 sum holds safely) and the run's ceiling. Any failure raises :class:`Rejected` with the reason of
docs/API.md; nothing here is ever unpickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from gradwire import FrameError, Limits, read_frame
from gradwire.accumulate import entry_norm
from gradwire.aggregation import MAX_UPDATE_NORM, update_norm
from gradwire.binding import run_binding, split_binding
from gradwire.frame import Entry, Frame

from .errors import Reason, Rejected

__all__ = ["ModelSpec", "validate_update"]

ModelSpec = Mapping[str, tuple[int, ...]]


def _record_norm(entry: Entry) -> float:
    """L2 norm of one record; raises Rejected for undecodable or non-finite records.

    A codec with a registered norm (the DCT) validates every section and computes the norm in its own
    domain, without a dense decode; its values are finite by construction once its sections passed (a
    NaN scale is a FrameError), unless a finite scale times a level leaves float32's range. Other codecs
    decode densely, and a NaN or infinity shows in the norm, which is summed in float64 so that finite
    float32 values never overflow it.
    """
    try:
        n = entry_norm(entry)
    except FrameError as exc:
        raise Rejected(Reason.BAD_FRAME, str(exc)) from None
    if not math.isfinite(n):
        raise Rejected(
            Reason.NON_FINITE,
            f"record {entry.name!r} decodes to NaN or infinite values (or to values "
            "beyond float32's range, about 3.4e38)",
        )
    return n


def _check_binding(frame: Frame, run_id: str | None, round: int, required: bool) -> Frame:
    """``frame`` without its run-binding record, once the binding is checked against ``run_id`` and ``round``."""
    try:
        rest, binding = split_binding(frame.entries)
    except FrameError as exc:
        raise Rejected(Reason.BAD_FRAME, str(exc)) from None
    if binding is None:
        if required and run_id is not None:
            raise Rejected(
                Reason.RUN_BINDING_MISSING,
                "this run takes only frames bound to it: add the record '@run:<binding>' (docs/FORMAT.md section 10)",
            )
        return frame
    if run_id is not None and binding != run_binding(run_id, round):
        raise Rejected(
            Reason.RUN_BINDING_MISMATCH,
            f"the frame is bound to another run or round (@run:{binding}), "
            f"not to run {run_id!r} round {round}: a frame is taken only by "
            "the run and round it was made for",
        )
    return Frame(round=frame.round, sender=frame.sender, bundle=frame.bundle, entries=rest)


def validate_update(
    body: bytes,
    spec: ModelSpec,
    *,
    node_id: int,
    round: int,
    max_frame_bytes: int,
    max_update_norm: float | None,
    model_record: str | None = None,
    run_id: str | None = None,
    require_binding: bool = False,
) -> tuple[Frame, float]:
    """The parsed frame and its L2 norm, or :class:`Rejected` naming what is wrong.

    ``model_record``: the name of the run's model record (runs with ``model_record``); the frame must then
    hold exactly that one record, 1-D float32 of the model's element count, instead of a record per tensor.

    ``run_id``: the run the frame was sent to. A frame's run-binding record (docs/FORMAT.md section 10) must
    name this run and ``round`` (``run_binding_mismatch``); a frame without one is refused only with
    ``require_binding`` (``run_binding_missing``). The frame returned holds the tensor records only.
    """
    max_elems = max((math.prod(s) for s in spec.values()), default=1)
    if model_record is not None:
        max_elems = sum(math.prod(s) for s in spec.values())
    # One record more than the model's tensors: the run binding.
    limits = Limits(
        max_frame_bytes=max_frame_bytes, max_entries=max(1, len(spec)) + 1, max_tensor_elements=max(1, max_elems)
    )
    try:
        frame = read_frame(body, limits=limits)
    except FrameError as exc:
        raise Rejected(Reason.BAD_FRAME, str(exc)) from None
    if not frame.bundle:
        raise Rejected(Reason.NOT_A_BUNDLE, "submit a bundle frame (flags bit 0 set) holding every parameter")
    if frame.sender != node_id:
        raise Rejected(Reason.SENDER_MISMATCH, f"frame sender {frame.sender} is not this token's node {node_id}")
    if frame.round != round:
        raise Rejected(Reason.ROUND_MISMATCH, f"frame round {frame.round} differs from the URL's round {round}")
    frame = _check_binding(frame, run_id, round, require_binding)
    got = {e.name: tuple(e.shape) for e in frame.entries}
    if model_record is not None:
        want = {model_record: (max_elems,)}
        if got != want or frame.entries[0].dtype != torch.float32:
            raise Rejected(
                Reason.TENSOR_MISMATCH,
                f"this run takes the whole model as one float32 record {model_record!r} of shape ({max_elems},) "
                f"(docs/FORMAT.md section 9); the frame holds {sorted(got)[:3]} "
                f"{'of other shapes or dtype' if set(got) == set(want) else ''}".rstrip(),
            )
    elif got != dict(spec):
        missing = sorted(set(spec) - set(got))
        extra = sorted(set(got) - set(spec))
        wrong = sorted(n for n in set(got) & set(spec) if got[n] != tuple(spec[n]))
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}")
        if extra:
            parts.append(f"unknown {extra[:5]}")
        if wrong:
            parts.append("shape of " + ", ".join(f"{n!r} is {got[n]}, the model's {tuple(spec[n])}" for n in wrong[:5]))
        raise Rejected(Reason.TENSOR_MISMATCH, "; ".join(parts))
    # The one norm function the server's replays use too (bounded_mean's clip levels depend on it).
    norm = update_norm(frame.entries, _record_norm)
    if not math.isfinite(norm):
        raise Rejected(Reason.NON_FINITE, "the update's norm is not finite")
    if norm >= MAX_UPDATE_NORM:
        # Finite, but beyond what a float32 sum holds safely: refused for what it is, not as NaN.
        raise Rejected(
            Reason.NORM_TOO_LARGE,
            f"update L2 norm {norm:.6g} is finite but at least {MAX_UPDATE_NORM:g}, "
            "beyond what float32 aggregation holds safely",
        )
    if max_update_norm is not None and norm > max_update_norm:
        raise Rejected(
            Reason.NORM_TOO_LARGE, f"update L2 norm {norm:.6g} exceeds the run's ceiling {max_update_norm:g}"
        )
    return frame, norm
