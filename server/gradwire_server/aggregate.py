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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from gradwire import aggregation
from gradwire.aggregation import RULES
from gradwire.dct import ParseCache
from gradwire.frame import Entry, Frame
from gradwire.rule import Rule

from .replays import update_digest

__all__ = [
    "RULES",
    "Update",
    "aggregate",
    "clip_factors",
    "counted_once",
    "mean_weights",
    "published_weights",
    "rule_aggregate",
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

    def entries(self) -> dict[str, Entry]:
        return {e.name: e for e in self.frame.entries}


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
        digest = update_digest(u.frame.entries, u.norm)
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
) -> tuple[list[float], int]:
    """``(weights, trim)`` for a published version of ``updates``: a run's :class:`~gradwire.rule.Rule`'s
    :meth:`~gradwire.rule.Rule.coefficients` (its state read, not stepped: the caller steps it once the
    round is closed; ``scored``: the validators scored the round), or for a rule's name
    :func:`gradwire.aggregation.weights_and_trim` (``cap``: ``bounded_mean``'s cap on the clip level)."""
    counted = counted_once(updates)
    norms = [u.norm for u in updates]
    records = [u.frame.entries for u in updates]
    if isinstance(rule, Rule):
        return rule.coefficients([u.node_id for u in updates], counted, norms, records, scored)
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
) -> tuple[dict[str, torch.Tensor], list[float], list[list[Entry]]]:
    """A run's AdamW round: ``(gradient, coefficients, records of names)`` of ``updates`` under its
    :class:`~gradwire.rule.Rule` (read, not stepped: the caller steps it with the coefficients and
    records returned). The weighted means sum in the codec's domain, the coordinate-wise rules bit-exactly."""
    if not updates:
        raise ValueError("nothing to aggregate")
    picked = aggregation.pick([u.frame.entries for u in updates], names)
    counted = counted_once(updates)
    coeffs, trim = rule.coefficients([u.node_id for u in updates], counted, [u.norm for u in updates], picked, scored)
    if rule.weighted:
        return aggregation.weighted_aggregate(picked, names, coeffs, device), coeffs, picked
    return aggregation.exact_trimmed_mean(picked, trim, device), coeffs, picked
