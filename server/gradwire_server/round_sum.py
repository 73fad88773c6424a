"""The open round's weighted sum, added to as each update is acknowledged, so that a round's close does not
start it when the last update arrives (issue 44, item 4).

The rule's coefficients ``cᵢ`` are known only at the close (the clip level is the round's median norm, the
direction check reads the whole round), but in most rounds they are one common factor ``s`` times each
update's own weight ``bᵢ`` (its staleness weight; 0 for a copy of an earlier update's records,
:func:`.aggregate.counted_once`). So each DCT record is added into its tensor's coefficients with ``bᵢ`` as
it is acknowledged (:func:`gradwire.dct.add_records`: one Rust pass, a record at a time, no atomics), and
the close only corrects the updates whose coefficient is not ``s·bᵢ`` — clipped, dropped, scored — and
scales: ``Σ cᵢ uᵢ = s · (Σ bᵢ uᵢ + Σ_corrected (cᵢ/s − bᵢ) uᵢ)`` (:meth:`RoundSum.finish`).

Updates are added in the order they were committed (the order of their rows, which the round's replay
reads back: :meth:`.store.Store.submissions_for`), so a close and its replay after a restart run the same
float32 operations in the same order and make the same bytes. A sum is built from the updates at the close
instead where none was kept (a replay, a restart, a sum broken by an error): the same operations.

A correction cancels what was added: ``(Σ + x) − x`` keeps float32's rounding of ``Σ + x``, which is
harmless for an update of the round's size and ruins the sum for one a thousand times larger (a node
sending ``1e15 ×`` an honest update). So an update is added only if its norm is at most
:data:`ADD_LIMIT_MULTIPLE` × the rule's cap on the clip level from earlier rounds (else it waits for the
close, which adds it once, at its final share); and a close that finds an added update more than
:data:`ADD_LIMIT_MULTIPLE` × the largest norm it keeps whole (the first rounds, before there is a cap) sums
the round again from zero at the final shares — the close of before, for that round only.

Tensors are summed here only where every record of the round is a float32 DCT record in one chunk plan
(the downlink's, for a run that re-encodes its aggregate in the coefficient domain; else the first
record's); any other tensor is left to the close's own path, as is every tensor of a coordinate-wise rule.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradwire.dct import ChunkPlan, parse_record
from gradwire.dct.domain import add_records
from gradwire.dct.layout import CODEC_ID
from gradwire.frame import Entry
from gradwire.sketch import SKETCH_DIM

from . import aggregate
from .aggregate import Update
from .replays import update_digest

__all__ = ["ADD_LIMIT_MULTIPLE", "RoundSum", "scale_and_corrections"]

#: An update is added as it arrives only up to this multiple of the clip level (module docstring): a
#: correction then cancels at most 16 × a kept update's size, a float32 rounding of about 10⁻⁶ of one.
ADD_LIMIT_MULTIPLE = 16.0


@dataclass
class _Buffer:
    shape: tuple[int, ...]
    plan: ChunkPlan
    coeffs: torch.Tensor  # flat (num_chunks · C,) float32


def large_round_bytes() -> int:
    """:data:`.aggregate.LARGE_ROUND_BYTES`, read when asked (tests change it)."""
    return aggregate.LARGE_ROUND_BYTES


def _float32(w: float) -> float:
    return float(torch.tensor(float(w), dtype=torch.float32))


def scale_and_corrections(base: Sequence[float], coeffs: Sequence[float]) -> tuple[float, list[tuple[int, float]]]:
    """``(s, [(i, eᵢ)])`` with ``Σ cᵢ uᵢ = s · (Σ bᵢ uᵢ + Σ eᵢ uᵢ)``: ``s`` the most common ratio ``cᵢ / bᵢ``
    (ties: the larger), ``eᵢ = cᵢ / s − bᵢ`` for every update whose coefficient is not ``s · bᵢ`` exactly.
    ``s`` is 0 when no update keeps a share of its own weight; then ``eᵢ = cᵢ`` on a sum started afresh."""
    if len(base) != len(coeffs):
        raise ValueError(f"got {len(coeffs)} coefficients for {len(base)} updates")
    s = _common_ratio(base, coeffs)
    if s == 0.0:
        return 0.0, [(i, float(c)) for i, c in enumerate(coeffs) if c != 0.0]
    return s, [(i, c / s - b) for i, (b, c) in enumerate(zip(base, coeffs)) if c != s * b]


def _common_ratio(base: Sequence[float], coeffs: Sequence[float]) -> float:
    """The most common ``cᵢ / bᵢ`` over the updates added with a weight (ties: the larger; 0 if none)."""
    ratios = Counter(c / b for b, c in zip(base, coeffs) if b != 0.0)
    return max(ratios.items(), key=lambda kv: (kv[1], kv[0]))[0] if ratios else 0.0


class RoundSum:
    """``Σ bᵢ uᵢ`` of a round's updates, tensor by tensor in the coefficient domain, in the order added.

    ``plan_of(entry)``: the chunk plan a tensor is summed in (a re-encoding run: the downlink codec's plan
    of the record's shape), or ``None`` to sum each tensor in its first record's plan (AdamW runs)."""

    def __init__(self, plan_of: Callable[[Entry], ChunkPlan] | None = None, limit: float = math.inf):
        self._plan_of = plan_of
        #: Updates of a larger norm are not added as they arrive (the close adds them at their share).
        self.limit = float(limit)
        self.buffers: dict[str, _Buffer] = {}
        #: Tensors not summed here: a record in another codec, dtype or plan.
        self.refused: set[str] = set()
        #: The updates added, in order, and the weight each was added with (``bᵢ``).
        self.updates: list[Update] = []
        self.base: list[float] = []
        self._digests: set[bytes] = set()
        #: The bytes of the records added (``Entry.nbytes``), which make the round a large one.
        self.nbytes = 0
        #: Set once :meth:`finish` has run or an add failed half-way: the sum is no longer ``Σ bᵢ uᵢ``.
        self.spent = False
        # The added updates' sketches (gradwire.sketch), one row each in the order added, so that the close
        # reads them in place; None once an update came without one (or under another key).
        self._sketch_key: bytes | None = None
        self._sketch_rows: np.ndarray | None = np.zeros((0, SKETCH_DIM))

    @classmethod
    def of(
        cls, updates: Sequence[Update], plan_of: Callable[[Entry], ChunkPlan] | None = None, limit: float = math.inf
    ) -> RoundSum:
        """The sum of ``updates`` added in their order, as a live round adds them."""
        rs = cls(plan_of, limit)
        for u in updates:
            rs.add(u)
        return rs

    def matches(self, updates: Sequence[Update]) -> bool:
        """Whether this sum holds exactly ``updates`` (these objects, in this order) and is unspent."""
        return (
            not self.spent and len(updates) == len(self.updates) and all(a is b for a, b in zip(updates, self.updates))
        )

    def add(self, update: Update) -> None:
        """Add ``update`` with its weight (0 if its records repeat an update added before)."""
        if self.spent:
            raise RuntimeError("this round's sum was spent; build another")
        digest = update.digest if update.digest is not None else update_digest(update.frame.entries, update.norm)
        weight = 0.0 if digest is not None and digest in self._digests else float(update.weight)
        if digest is not None:
            self._digests.add(digest)
        if not update.norm <= self.limit:
            weight = 0.0  # added by the close, once, at its share
        try:
            if weight != 0.0:
                self._add_records(update, _float32(weight))
        except BaseException:
            self.spent = True
            raise
        self.updates.append(update)
        self.base.append(weight)
        self.nbytes += update.record_bytes()
        self._keep_sketch(update)
        if self.nbytes > large_round_bytes():
            # A large round (its records only grow): its close reads records only to correct a few updates,
            # so the parses each update kept since validation (6–7 × its frame) go; those few are parsed again.
            for u in self.updates:
                u.prepared = None

    def _keep_sketch(self, update: Update) -> None:
        rows = self._sketch_rows
        if rows is None:
            return
        if update.sketch is None or self._sketch_key not in (None, update.sketch[0]):
            self._sketch_rows = None
            return
        self._sketch_key, sketch = update.sketch
        n = len(self.updates)
        if rows.shape[0] < n:
            grown = np.empty((max(64, 2 * rows.shape[0]), SKETCH_DIM))
            grown[: n - 1] = rows[: n - 1]
            self._sketch_rows = rows = grown
        rows[n - 1] = sketch

    def sketches(self, key: bytes) -> np.ndarray | None:
        """The added updates' sketches under ``key`` as one ``(updates, SKETCH_DIM)`` matrix (a view), or
        ``None`` if one came without a sketch under that key."""
        rows = self._sketch_rows
        if rows is None or self._sketch_key != key or not self.updates:
            return None
        return rows[: len(self.updates)]

    def _add_records(self, update: Update, w32: float) -> None:
        cache = update.prepared
        for entry in update.frame.entries:
            name = entry.name
            if name in self.refused:
                continue
            if entry.codec != CODEC_ID or entry.dtype != torch.float32:
                self._refuse(name)
                continue
            parsed = parse_record(entry, None, cache)
            buf = self.buffers.get(name)
            if buf is None:
                plan = parsed.plan if self._plan_of is None else self._plan_of(entry)
                if self.updates and any(w != 0.0 for w in self.base):
                    # Earlier updates sent no record of this tensor (the close refuses such a round) or it
                    # was refused: not summed here.
                    self._refuse(name)
                    continue
                buf = _Buffer(tuple(entry.shape), plan, torch.zeros(plan.num_chunks * plan.chunk_numel))
                self.buffers[name] = buf
            if parsed.plan != buf.plan or tuple(entry.shape) != buf.shape:
                self._refuse(name)
                continue
            add_records(buf.coeffs, [parsed], [w32])

    def _refuse(self, name: str) -> None:
        self.refused.add(name)
        self.buffers.pop(name, None)

    def finish(self, coeffs: Sequence[float], updates: Sequence[Update]) -> tuple[float, dict[str, _Buffer]]:
        """``(s, {name: buffer})`` with ``s · buffer = Σ cᵢ uᵢ`` of each tensor summed here (``updates``: the
        added ones, as the close has them — their parses; ``coeffs``: the rule's). Spends the sum."""
        if len(updates) != len(self.updates):
            raise ValueError(f"got {len(updates)} updates for a sum of {len(self.updates)}")
        self.spent = True
        base = self.base
        if self._cancels(base, coeffs, updates):
            for buf in self.buffers.values():
                buf.coeffs.zero_()
            base = [0.0] * len(base)
        s, corrections = scale_and_corrections(base, coeffs)
        if s == 0.0:
            for buf in self.buffers.values():
                buf.coeffs.zero_()
            s = 1.0
        for i, e in corrections:
            e32 = _float32(e)
            if e32 != 0.0:
                self._add_records_summed(updates[i], e32)
        return s, self.buffers

    @staticmethod
    def _cancels(base: Sequence[float], coeffs: Sequence[float], updates: Sequence[Update]) -> bool:
        """Whether a correction would cancel an added update more than :data:`ADD_LIMIT_MULTIPLE` × the
        largest update the round keeps at its whole share (then the close sums the round from zero)."""
        if not any(b != 0.0 for b in base):
            return False
        s = _common_ratio(base, coeffs)
        whole = [u.norm for b, c, u in zip(base, coeffs, updates) if b != 0.0 and c == s * b]
        if not whole:
            return True
        bound = ADD_LIMIT_MULTIPLE * max(whole)
        return any(b != 0.0 and c != s * b and not u.norm <= bound for b, c, u in zip(base, coeffs, updates))

    def _add_records_summed(self, update: Update, w32: float) -> None:
        """Add ``update``'s records of the tensors summed here (the others are the close's)."""
        for entry in update.frame.entries:
            buf = self.buffers.get(entry.name)
            if buf is not None:
                add_records(buf.coeffs, [parse_record(entry, None, update.prepared)], [w32])
