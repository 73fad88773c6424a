"""Each update's own work, done as it arrives and kept for its round's close (issue 44, item 4: the part that
does not depend on the aggregation rule).

An update is fetched (from the object store, where the server has one), hashed, parsed as hostile input and
its norm computed in the validation pool, one thread per core, the Rust kernels releasing the GIL
(:mod:`.submissions`). Parsing a DCT record — every section checked, its positions and coefficients
unpacked — was a third of a 64-node close, and the close did it again for every record. So validation runs
inside :func:`gradwire.dct.records_parsed_once`, the update keeps what it parsed
(:attr:`.aggregate.Update.prepared`), and the round's close starts from every update's parses
(:func:`close_parses`): its direction check, norms and aggregate read each record without parsing it again.

What is kept costs memory while the round is open: for a DCT record, its positions (int64), coefficients
(float32), levels (int16) and per-chunk scales: about 6 to 7 times its frame's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradwire.accumulate import entry_coefficients
from gradwire.capabilities import capabilities_of
from gradwire.dct import ParseCache, records_parsed_once
from gradwire.frame import Frame
from gradwire.sender_history import HistorySketch, history_sketch
from gradwire.sketch import SKETCH_DIM, count_sketch

from .aggregate import Update

__all__ = ["close_parses", "parsed_while", "sketches_of"]


def parsed_while(fn: Callable[[], tuple[Frame, float]]) -> tuple[tuple[Frame, float], ParseCache]:
    """``fn()`` (a validation: ``(frame, norm)``), then the frame's records read into their codec's domain
    as the close reads them (for a codec that has a sparse domain: its parse), and those parses, to keep
    with the update. Validation itself checks the sections without building them (its norm stays in
    NumPy, the cheap path for updates refused on the way); this builds them once, here in the pool."""
    with records_parsed_once() as parsed:
        frame, norm = fn()
        for entry in frame.entries:
            if capabilities_of(entry.codec).coefficients is not None:
                entry_coefficients(entry)
    return (frame, norm), parsed


def sketches_of(frame: Frame, parsed: ParseCache, key: bytes, histories: bool) -> tuple[tuple, HistorySketch | None]:
    """``((key, the frame's count sketch under key), its history sketch)``, read from the parses validation
    kept: what a large round's direction check reads of this update at its close (:mod:`gradwire.sketch`)
    and, with ``histories`` (the run keeps sender histories; else ``None``), what they fold in
    (:func:`gradwire.sender_history.history_sketch`), both from one read of its records' coefficients."""
    with records_parsed_once(parsed):
        views = [(e.name, entry_coefficients(e)) for e in frame.entries]
        keyed = (key, count_sketch(views, SKETCH_DIM, key))
        return keyed, history_sketch(views) if histories else None


def close_parses(updates: Sequence[Update]) -> ParseCache:
    """The parses a round's close starts from: every update's, kept since it arrived."""
    merged = ParseCache()
    for u in updates:
        if u.prepared is not None:
            merged.merge(u.prepared)
    return merged
