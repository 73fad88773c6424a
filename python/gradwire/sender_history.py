"""Each sender's history of deviations from its rounds, and the trust ``bounded_mean`` gives it: the
defence against colluders who stay inside the honest spread (ALIE, min-max, min-sum).

Why a history. Within one round an ALIE or min-max update cannot be told from an honest one: its norm and
its distance to the others are theirs (Baruch et al. 2019; Shejwalkar & Houmansadr 2021). What gives it away
is time. An honest update's deviation from its round's median, ``rᵢ = uᵢ − ū``, is mostly minibatch noise, new each
round; a colluder's points the same way round after round (ALIE's ``−σ`` is negative in every coordinate),
since that bias is the attack. So the server keeps, per sender, a momentum of its deviations,
``hᵢ ← β·hᵢ + rᵢ``: noise adds up as ``√(Σ β²ᵗ)`` = ``1/√(1−β²)`` rounds' worth, a steady bias as
``1/(1−β)``. At ``β = 0.9`` a colluder's ``‖hᵢ‖`` is 4.4× an honest one of the same per-round size (the
worker-momentum argument of Karimireddy, He & Jaggi, ICML 2021, applied at the server to the deviations
rather than to the updates, so that what is aggregated stays the senders' own updates and a version
stays a weighted mean of their records).

The trust (:meth:`SenderHistory.trust`, from the rounds before the one closing; :meth:`SenderHistory.observe`
then folds that round in, from what its published version records): with ``m`` the lower median of the
round's ``‖hᵢ‖``, a sender up to ``TRUST_MULTIPLE · m`` keeps its weight, one at twice that or more gets
none, and the weight falls linearly in between. At least half of every round (those at or below the median) keeps its
weight, so fewer than half
of the senders can never shut out the rest. An attacker that knows the rule and keeps its history under the
level must shrink its bias per round to about ``TRUST_MULTIPLE · √((1−β)/(1+β))`` ≈ 0.34 honest deviations
(``bench/attacks.py``'s ``adaptive`` attack does exactly that). The price: an honest node whose data differ
from the others' persistently, round after round, looks the same, so the server keeps histories only in
runs whose honest nodes are IID by construction (a data assignment: :class:`gradwire.rule.Rule`, which owns
and steps them; docs/SERVER.md, "Robust aggregation").

The deviations are kept as a count sketch (:func:`update_sketch`): :data:`SKETCH_BUCKETS` float64 numbers
per sender, whatever the model size; every coefficient of an update (the DCT's kept coefficients, in their
orthonormal basis, where every sender's records of a tensor share one, else the decoded values) is added
into one bucket with a sign, both fixed by a hash of its tensor and position. A sketch preserves inner
products and norms in expectation, which is all the score needs. Everything here is float64 in a fixed
order on the CPU: a restarted server replays a run's rounds through :meth:`SenderHistory.observe` and gets
the same trust, bit for bit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from .accumulate import Coefficients, entry_coefficients
from .frame import Entry
from .sketch import count_sketch

__all__ = [
    "HISTORY_BETA",
    "SKETCH_BUCKETS",
    "TRUST_MULTIPLE",
    "HistorySketch",
    "SenderHistory",
    "history_sketch",
    "trusted_weights",
    "update_sketch",
]

#: How much of a sender's past deviations each round keeps (``hᵢ ← β·hᵢ + rᵢ``).
HISTORY_BETA = 0.9
#: The numbers a sender's history takes, whatever the model's size.
SKETCH_BUCKETS = 1024
#: A sender whose history is up to this multiple of the round's lower median keeps its whole weight; at
#: twice it, none.
TRUST_MULTIPLE = 1.5


def update_sketch(records: Sequence[Entry], buckets: int = SKETCH_BUCKETS, dense: bool = False) -> np.ndarray:
    """A count sketch of one sender's update: float64[``buckets``]. Each coefficient (the records' codec
    coefficients, or with ``dense`` the decoded values) goes into bucket ``h mod buckets`` with sign ``±1``,
    ``h`` a hash of its tensor's name and position. Linear: the sketch of a weighted sum is the weighted sum
    of the sketches."""
    return _sketch([(e.name, entry_coefficients(e, dense=dense)) for e in records], buckets)


def _sketch(views: Sequence[tuple[str, Coefficients]], buckets: int) -> np.ndarray:
    """:func:`update_sketch` of records already read as ``(name, coefficients)``: the unkeyed
    :func:`gradwire.sketch.count_sketch` (a fixed hash, so a replay steps the histories to the same bits)."""
    return count_sketch(views, buckets)


class HistorySketch(NamedTuple):
    """An update's sketch for the sender histories, made once as it arrives (:func:`history_sketch`):
    the sketch of its records in their own coefficient bases, and those bases (``{name: (basis, size)}``),
    which decide whether a round can use it (every sender's the same: :meth:`SenderHistory.observe`)."""

    sketch: np.ndarray
    bases: dict


def history_sketch(views: Sequence[tuple[str, Coefficients]], buckets: int = SKETCH_BUCKETS) -> HistorySketch:
    """The :class:`HistorySketch` of an update's records read as ``(name, coefficients)``."""
    return HistorySketch(_sketch(views, buckets), {name: (v.basis, v.size) for name, v in views})


def _sketches_apply(sketches: Sequence[HistorySketch | None] | None, buckets: int, n: int) -> bool:
    if sketches is None or len(sketches) != n or any(s is None or s.sketch.shape != (buckets,) for s in sketches):
        return False
    first = sketches[0].bases
    return all(s.bases == first for s in sketches[1:])


def _round_views(records: Sequence[Sequence[Entry]]) -> list[list[tuple[str, Coefficients]]]:
    """Every sender's records as ``(name, coefficients)``, each record read once: the codec's coefficients
    where every sender's records of each tensor share one basis, else (one sender chunked otherwise) the
    decoded values of all of them."""
    views = [[(e.name, entry_coefficients(e)) for e in recs] for recs in records]
    first = dict(views[0])
    for mine in views[1:]:
        for name, view in mine:
            theirs = first.get(name)
            if theirs is None or view.basis != theirs.basis or view.size != theirs.size:
                return [[(e.name, entry_coefficients(e, dense=True)) for e in recs] for recs in records]
    return views


def trusted_weights(coeffs: Sequence[float], weights: Sequence[float], trust: Sequence[float]) -> list[float]:
    """A weighted mean's coefficients ``coeffs`` (``wᵢ cᵢ / Σ_kept wⱼ``, 0 for a sender the rule dropped)
    with each sender's staleness weight ``wᵢ`` scaled by its ``trust``: ``wᵢ tᵢ cᵢ / Σ_kept wⱼ tⱼ``, so the
    share an untrusted sender loses goes to the others."""
    kept = [i for i, a in enumerate(coeffs) if a > 0.0]
    before = sum(weights[i] for i in kept)
    after = sum(weights[i] * trust[i] for i in kept)
    if not kept or after <= 0.0:
        return list(coeffs)
    scale = before / after
    return [a * t * scale for a, t in zip(coeffs, trust)]


class SenderHistory:
    """A run's per-sender deviation momenta (module docstring). A run's :class:`gradwire.rule.Rule` keeps
    one where its honest nodes are IID, takes each round's trust from it (:meth:`trust`), folds the closed
    round in (:meth:`observe`), saves it with each checkpoint (:meth:`state_dict`) and replays it with the
    versions since, as it does :class:`~gradwire.aggregation.NormHistory`."""

    def __init__(self, beta: float = HISTORY_BETA, buckets: int = SKETCH_BUCKETS, multiple: float = TRUST_MULTIPLE):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"history beta must lie in [0, 1), got {beta!r}")
        if buckets < 1:
            raise ValueError(f"sketch buckets must be >= 1, got {buckets!r}")
        if not (math.isfinite(multiple) and multiple >= 1.0):
            raise ValueError(f"trust multiple must be a finite number >= 1, got {multiple!r}")
        self.beta = float(beta)
        self.buckets = int(buckets)
        self.multiple = float(multiple)
        self.memory: dict[int, np.ndarray] = {}

    def scores(self, senders: Sequence[int]) -> list[float]:
        """``‖hᵢ‖`` of each of ``senders`` (0 for one never seen)."""
        return [float(np.linalg.norm(self.memory[int(s)])) if int(s) in self.memory else 0.0 for s in senders]

    def trust(self, senders: Sequence[int]) -> list[float]:
        """Each sender's trust for the round about to close, from the histories of the rounds before it:
        1 up to ``multiple ×`` the lower median of the round's scores, 0 from twice that, linear between
        (1 for everyone in a round of fewer than 3: of two, nobody can tell who deviates)."""
        scores = self.scores(senders)
        if len(scores) < 3:
            return [1.0] * len(scores)
        level = self.multiple * statistics.median_low(scores)
        if level <= 0.0:
            return [1.0] * len(scores)
        return [1.0 if s <= level else max(0.0, 2.0 - s / level) for s in scores]

    def observe(
        self,
        senders: Sequence[int],
        records: Sequence[Sequence[Entry]],
        coeffs: Sequence[float],
        sketches: Sequence[HistorySketch | None] | None = None,
    ) -> None:
        """Fold a closed round into the histories: ``hᵢ ← β·hᵢ + (sketch(uᵢ) − ū)``, with ``ū`` the
        bucket-wise median of the sketches of the senders the round's published coefficients ``coeffs``
        counted (a sender of coefficient 0, dropped or counted once already, still has its deviation
        remembered, but is no part of the reference). The median, not the round's mean: colluders who are a
        quarter of the round pull a mean a quarter of the way towards themselves, and so hide a quarter of
        their deviation; a median, over a minority of them, hardly moves.

        ``senders``: the node ids, one per sender of ``records``. Only what a published version records is
        used, so a restarted server replays a verbatim version into the same histories. A node id twice in
        one round (two rounds' updates of one node closing together) folds both, in order. ``sketches``:
        each update's :func:`history_sketch`, made as it arrived; used where every sender's records share
        their bases (else, and where one is missing, the round's records are read here: the same numbers)."""
        if len(senders) != len(records) or len(coeffs) != len(records):
            raise ValueError(f"got {len(senders)} senders, {len(coeffs)} coefficients for {len(records)} updates")
        if not records:
            return
        if _sketches_apply(sketches, self.buckets, len(records)):
            sketches = [s.sketch for s in sketches]
        else:
            sketches = [_sketch(views, self.buckets) for views in _round_views(records)]
        counted = [s for a, s in zip(coeffs, sketches) if a > 0.0] or sketches
        reference = np.median(np.stack(counted), axis=0)
        for node, s in zip(senders, sketches):
            h = self.memory.get(int(node))
            deviation = s - reference
            self.memory[int(node)] = deviation if h is None else self.beta * h + deviation

    def state_dict(self) -> dict[str, torch.Tensor]:
        ids = sorted(self.memory)
        memory = np.stack([self.memory[i] for i in ids]) if ids else np.zeros((0, self.buckets), dtype=np.float64)
        return {"senders": torch.tensor(ids, dtype=torch.int64), "memory": torch.from_numpy(memory.copy())}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ids = state.get("senders")
        memory = state.get("memory")
        self.memory = {}
        if ids is None or memory is None:
            return
        if memory.ndim != 2 or memory.shape[0] != ids.numel() or memory.shape[1] != self.buckets:
            raise ValueError(
                f"a sender history of shape {tuple(memory.shape)} for {ids.numel()} senders and {self.buckets} buckets"
            )
        rows = memory.to(torch.float64).cpu().numpy()
        self.memory = {int(i): rows[j].copy() for j, i in enumerate(ids.tolist())}

    def __repr__(self) -> str:
        return f"SenderHistory(beta={self.beta}, buckets={self.buckets}, senders={len(self.memory)})"
