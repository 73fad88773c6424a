"""The server's view of the aggregation rules: a round's validated updates (:class:`Update`) handed to
:mod:`gradwire.aggregation`, which holds every rule (``bounded_mean``, ``mean``, ``clipped_mean``,
``trimmed_mean``, ``median``: docs/SERVER.md), their weights and both ways of computing them. Nothing here decides
anything: each function below is one call into the library.

- :func:`rule_aggregate` (AdamW runs, under the run's :class:`~gradwire.rule.Rule`) and :func:`aggregate` (a
  rule by name): the means in the codec's domain
  (:func:`gradwire.aggregation.transform_domain_sum`), the coordinate-wise rules bit-exact
  (:func:`gradwire.aggregation.exact_trimmed_mean`).
- :func:`published_weights` (DeMo and SparseLoCo runs): the ``(weights, trim)`` a published version
  records, applied with :func:`gradwire.aggregation.exact_aggregate` by the server and every node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from gradwire import aggregation
from gradwire.aggregation import RULES
from gradwire.dct import ParseCache
from gradwire.frame import Entry, Frame
from gradwire.rule import Rule
from gradwire.sender_history import HistorySketch
from gradwire.sketch import sketch_update, sketched_alignment

from .replays import update_digest

__all__ = [
    "RULES",
    "Update",
    "aggregate",
    "clip_factors",
    "counted_once",
    "large_round",
    "mean_weights",
    "published_weights",
    "round_alignment",
    "rule_aggregate",
    "update_sketch",
    "score_weighted",
]


@dataclass
class Update:
    """One node's validated update: its parsed bundle, its staleness weight and its L2 norm (and, for the
    algorithms that publish the nodes' frames, the bytes it came in)."""

    frame: Frame
    weight: float = 1.0
    norm: float = 0.0
    node_id: int = 0
    raw: bytes = b""
    sha256: str = ""
    #: Its records as validation parsed them (:mod:`.prepare`): the round's close starts from them.
    prepared: ParseCache | None = field(default=None, repr=False)
    #: :func:`.replays.update_digest` of its records, as validation computed it (``None``: not computed).
    digest: bytes | None = field(default=None, repr=False)
    #: ``(key, its count sketch under that key)`` (:mod:`gradwire.sketch`), as validation computed it.
    sketch: tuple[bytes, np.ndarray] | None = field(default=None, repr=False)
    #: The round it was sent for (a stale update's is older than the round it is counted in).
    round: int = 0
    #: Its sketch for the sender histories, made as it arrived (``gradwire.sender_history.history_sketch``).
    history_sketch: HistorySketch | None = field(default=None, repr=False)
    _record_bytes: int | None = field(default=None, repr=False, compare=False)

    def entries(self) -> dict[str, Entry]:
        return {e.name: e for e in self.frame.entries}

    def record_bytes(self) -> int:
        """The bytes of its records (``Entry.nbytes``), counted once."""
        if self._record_bytes is None:
            self._record_bytes = sum(e.nbytes() for e in self.frame.entries)
        return self._record_bytes


#: A round whose records take more bytes than this (all senders together) is a large round
#: (:func:`large_round`). Its close starts from what was done as each update arrived: the aggregate is the
#: round's running sum, in commit order (``gradwire_server.round_sum``), and the direction check reads the
#: updates' sketches (:mod:`gradwire.sketch`) instead of a pass over every record (at 1 MiB that pass costs
#: about one AdamW step of the model on two cores, and above it grows with the round: SparseLoCo, 10 M
#: parameters, 1.9 s at 64 nodes). A smaller round is closed from its records in (node id, round) order,
#: with the exact cosines: it costs little, and its result does not depend on the order its updates arrived
#: in, so two runs given the same updates publish the same bytes. A fixed function of the round's records,
#: so a replay takes the same path.
LARGE_ROUND_BYTES = 1 << 20


def large_round(updates: Sequence[Update]) -> bool:
    """Whether the round's records take more than :data:`LARGE_ROUND_BYTES` (module constant)."""
    return sum(u.record_bytes() for u in updates) > LARGE_ROUND_BYTES


def update_sketch(update: Update, key: bytes) -> np.ndarray:
    """``update``'s count sketch under ``key``: the one validation computed, or computed now."""
    if update.sketch is not None and update.sketch[0] == key:
        return update.sketch[1]
    return sketch_update(update.frame.entries, key)


def round_alignment(
    updates: Sequence[Update], key: bytes, sketches: np.ndarray | None = None
) -> Callable[[Sequence[float]], list[float]] | None:
    """How the round's direction check reads its cosines: from sketches in a :func:`large_round`
    (:func:`gradwire.sketch.sketched_alignment`, exact squared norms), else ``None`` (the exact pass).
    ``sketches``: the updates' sketches under ``key`` as one matrix, kept as they arrived (the round's
    running sum holds them), else each update's (:func:`update_sketch`)."""
    if not large_round(updates):
        return None
    if sketches is None or sketches.shape[0] != len(updates):
        sketches = [update_sketch(u, key) for u in updates]
    sq = [u.norm * u.norm for u in updates]
    return lambda coeffs: sketched_alignment(sketches, sq, coeffs)


def score_weighted(updates: Sequence[Update], score_weights: Mapping[int, float] | None) -> list[Update]:
    """``updates`` with each weight multiplied by its sender's score weight (a scored round: docs/SERVER.md,
    "Validators"; a sender without one weighs 0), or as they are (``None``: an unscored round)."""
    if score_weights is None:
        return list(updates)
    return [replace(u, weight=u.weight * score_weights.get(u.node_id, 0.0)) for u in updates]


def counted_once(updates: Sequence[Update]) -> list[float]:
    """The updates' staleness weights, with 0 for an update whose records repeat an earlier one's of the
    round (in the order given): a copy of another node's records counts once, whoever sent it first
    (:mod:`.replays` refuses a copy from another round at submission; a same-round copy cannot be refused
    there, as the copier may have come first). All-zero updates are left alone."""
    seen: set[bytes] = set()
    out = []
    for u in updates:
        digest = u.digest if u.digest is not None else update_digest(u.frame.entries, u.norm)
        out.append(0.0 if digest is not None and digest in seen else u.weight)
        if digest is not None:
            seen.add(digest)
    return out


def clip_factors(norms: Sequence[float]) -> list[float]:
    """:func:`gradwire.aggregation.clip_factors`: every update scaled to at most the median norm."""
    return aggregation.clip_factors(norms)


def mean_weights(updates: Sequence[Update], rule: str) -> list[float]:
    """Each update's coefficient in the ``mean`` or ``clipped_mean`` (:func:`gradwire.aggregation.rule_weights`)."""
    return aggregation.rule_weights(rule, [u.weight for u in updates], [u.norm for u in updates])


def published_weights(
    updates: Sequence[Update],
    rule: str | Rule,
    trim_fraction: float = 0.2,
    cap: float = math.inf,
    scored: bool = False,
    alignment: Callable[[Sequence[float]], list[float]] | None = None,
) -> tuple[list[float], int]:
    """``(weights, trim)`` for a published version of ``updates``: a run's :class:`~gradwire.rule.Rule`'s
    :meth:`~gradwire.rule.Rule.coefficients` (its state read, not stepped: the caller steps it once the
    round is closed; ``scored``: the validators scored the round; ``alignment``: how its direction check
    reads the cosines, :func:`round_alignment`), or for a rule's name
    :func:`gradwire.aggregation.weights_and_trim` (``cap``: ``bounded_mean``'s cap on the clip level)."""
    counted = counted_once(updates)
    norms = [u.norm for u in updates]
    records = [u.frame.entries for u in updates]
    if isinstance(rule, Rule):
        return rule.coefficients([u.node_id for u in updates], counted, norms, records, scored, alignment)
    return aggregation.weights_and_trim(rule, counted, norms, trim_fraction, cap, records)


def aggregate(
    updates: Sequence[Update],
    names: Sequence[str],
    rule: str = "mean",
    trim_fraction: float = 0.2,
    device: torch.device | None = None,
    cap: float = math.inf,
) -> dict[str, torch.Tensor]:
    """The aggregated float32 gradient ``{name: tensor}`` of ``updates`` under the rule named ``rule``
    (:func:`gradwire.aggregation.aggregate`), combined in the order given (the caller sorts them)."""
    counted = counted_once(updates)
    records = [u.frame.entries for u in updates]
    return aggregation.aggregate(records, names, rule, counted, [u.norm for u in updates], trim_fraction, device, cap)


def rule_aggregate(
    updates: Sequence[Update],
    names: Sequence[str],
    rule: Rule,
    device: torch.device | None = None,
    scored: bool = False,
    alignment: Callable[[Sequence[float]], list[float]] | None = None,
    summed: Callable[[Sequence[float]], dict[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float], list[list[Entry]]]:
    """A run's AdamW round: ``(gradient, coefficients, records of names)`` of ``updates`` under its
    :class:`~gradwire.rule.Rule` (read, not stepped: the caller steps it with the coefficients and
    records returned). The weighted means sum in the codec's domain, the coordinate-wise rules bit-exactly.
    ``alignment``: :func:`round_alignment`'s; ``summed(coeffs)``: the tensors a running sum of the round
    holds (:mod:`.round_sum`), the rest summed here."""
    if not updates:
        raise ValueError("nothing to aggregate")
    picked = aggregation.pick([u.frame.entries for u in updates], names)
    counted = counted_once(updates)
    norms = [u.norm for u in updates]
    coeffs, trim = rule.coefficients([u.node_id for u in updates], counted, norms, picked, scored, alignment)
    if not rule.weighted:
        return aggregation.exact_trimmed_mean(picked, trim, device), coeffs, picked
    grads = {} if summed is None else summed(coeffs)
    rest = [n for n in names if n not in grads]
    if rest:
        at = {n: j for j, n in enumerate(names)}
        rest_records = [[mine[at[n]] for n in rest] for mine in picked]
        grads.update(aggregation.weighted_aggregate(rest_records, rest, coeffs, device))
    return {n: grads[n] for n in names}, coeffs, picked
