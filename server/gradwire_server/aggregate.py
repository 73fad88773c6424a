"""The server's view of the aggregation rules: a round's validated updates (:class:`Update`) handed to
:mod:`gradwire.aggregation`, which holds every rule (``bounded_mean``, ``mean``, ``clipped_mean``,
``trimmed_mean``, ``median``: docs/SERVER.md), their weights and both ways of computing them. Nothing here decides
anything: each function below is one call into the library.

- :func:`aggregate` (AdamW runs): the two means in the codec's domain
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
from gradwire.sender_history import SenderHistory, trusted_weights

from .replays import update_digest

__all__ = [
    "RULES",
    "Update",
    "aggregate",
    "clip_factors",
    "counted_once",
    "mean_weights",
    "published_weights",
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
    rule: str,
    trim_fraction: float,
    cap: float = math.inf,
    history: SenderHistory | None = None,
) -> tuple[list[float], int]:
    """``(weights, trim)`` for a published version of ``updates`` (:func:`gradwire.aggregation.weights_and_trim`;
    ``cap``: ``bounded_mean``'s cap on the clip level; ``history``: its senders' deviation histories, stepped
    past this round here, whose trust scales each weight: :mod:`gradwire.sender_history`)."""
    counted = counted_once(updates)
    weights, trim = aggregation.weights_and_trim(
        rule, counted, [u.norm for u in updates], trim_fraction, cap, [u.frame.entries for u in updates]
    )
    return _trusted(updates, counted, weights, history), trim


def _trusted(
    updates: Sequence[Update], counted: Sequence[float], coeffs: list[float], history: SenderHistory | None
) -> list[float]:
    """``coeffs`` with each sender's trust from ``history`` (stepped past this round), or as they are."""
    if history is None:
        return coeffs
    senders = [u.node_id for u in updates]
    coeffs = trusted_weights(coeffs, counted, history.trust(senders))
    history.observe(senders, [u.frame.entries for u in updates], coeffs)
    return coeffs


def aggregate(
    updates: Sequence[Update],
    names: Sequence[str],
    rule: str = "mean",
    trim_fraction: float = 0.2,
    device: torch.device | None = None,
    cap: float = math.inf,
    history: SenderHistory | None = None,
) -> dict[str, torch.Tensor]:
    """The aggregated float32 gradient ``{name: tensor}`` of ``updates`` under ``rule``
    (:func:`gradwire.aggregation.aggregate`), combined in the order given (the caller sorts them);
    ``history`` as for :func:`published_weights` (the server's AdamW runs keep none: transition.py)."""
    counted = counted_once(updates)
    records = [u.frame.entries for u in updates]
    if history is None or rule not in aggregation.WEIGHTED_RULES:
        # Without histories (AdamW runs) the direction check is the spread test alone, which holds an
        # IPM pair at −4× the honest mean (1.019× the clean run at 2 of 8, against 1.109× with the lenient
        # test); with them, the histories catch what the lenient test lets through.
        return aggregation.aggregate(
            records, names, rule, counted, [u.norm for u in updates], trim_fraction, device, cap, opposed_medians=0.0
        )
    coeffs = aggregation.rule_weights(rule, counted, [u.norm for u in updates], cap, aggregation.pick(records, names))
    return aggregation.weighted_aggregate(records, names, _trusted(updates, counted, coeffs, history), device)
