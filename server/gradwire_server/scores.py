"""Validators' scores and the weight they give each update of a round (docs/SERVER.md, "Validators").

A validator posts, for a round, one score in [0, 1] per candidate update (by its sender). A node's score weight
is the median of the scores the run's validators gave it — one validator's score, or the middle of several, so
that one lying validator of three moves nothing. :func:`score_weights` computes it; the round engine multiplies
each update's weight by it at the round's close (:meth:`.transition.RunState.close`), and the weights are
committed with the version (:meth:`.store.Store.publish`) and replayed from there after a restart.

A round counts as scored when at least one validator posted scores for it before its score deadline; it closes
as soon as every validator scored every candidate it held when it became ready (:func:`scores_complete`; the
driver, :meth:`.driver.RoundDriver._ready`), so a candidate arriving later does not hold it, and one no
validator scored weighs 0 in a scored round; a round whose every candidate weighs 0 closes with the structural
rule, as an unscored one. Nothing here
reads anything a node sent: a node cannot raise its own weight.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

from .errors import Reason, Rejected

__all__ = ["check_scores", "score_weights", "scores_complete"]


def check_scores(scores: Mapping[int, float], candidates: Iterable[int], round: int) -> dict[int, float]:
    """``scores`` if every one is finite in [0, 1] and names a candidate of the round; else 422
    ``invalid_request`` naming the offending entries."""
    candidates = set(candidates)
    bad = {n: s for n, s in scores.items() if not (isinstance(s, (int, float)) and math.isfinite(s) and 0 <= s <= 1)}
    if bad:
        raise Rejected(Reason.INVALID_REQUEST, f"scores must be finite numbers in [0, 1]; got {bad}")
    strangers = sorted(set(scores) - candidates)
    if strangers:
        raise Rejected(
            Reason.INVALID_REQUEST,
            f"round {round} has no candidate update from node(s) {strangers} (its candidates: {sorted(candidates)})",
        )
    return {int(n): float(s) for n, s in scores.items()}


def score_weights(by_validator: Mapping[int, Mapping[int, float]], senders: Iterable[int]) -> dict[int, float] | None:
    """Each sender's score weight: the median of the scores the validators gave it, 0 where none scored it;
    ``None`` when no validator scored the round, or every weight is 0 (it closes with the structural rule)."""
    if not by_validator:
        return None
    out = {}
    for node in sorted(set(senders)):
        given = [scores[node] for scores in by_validator.values() if node in scores]
        out[node] = statistics.median(given) if given else 0.0
    # A mean of nothing is no version: a round whose every candidate scored 0 closes with the structural rule.
    return out if any(out.values()) else None


def scores_complete(
    by_validator: Mapping[int, Mapping[int, float]], validators: Iterable[int], senders: Iterable[int]
) -> bool:
    """Whether every validator of the run scored every one of ``senders`` (the candidates the round held when it
    became ready): the round can close at once."""
    validators, senders = list(validators), set(senders)
    return bool(validators) and all(senders <= set(by_validator.get(v, ())) for v in validators)
