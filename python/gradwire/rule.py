"""The aggregation rule of a run as one object: its name and settings, and all the state it keeps across
rounds — ``bounded_mean``'s clip-level history (:class:`~gradwire.aggregation.NormHistory`, the cap) and,
where it is on, its per-sender deviation histories (:class:`~gradwire.sender_history.SenderHistory`, the
trust). The server keeps one per run: it takes each round's coefficients from it (:meth:`Rule.coefficients`,
which reads the state and changes nothing), then steps it once, past the closed round (:meth:`Rule.step`),
from what the round's published version records, so that replaying the versions after a restart steps it
into the same state, bit for bit. :meth:`Rule.state_dict` is what a checkpoint stores.

What the default (``bounded_mean``) does depends on whether the run's honest nodes are IID by construction
(``honest_iid``: the run assigns its data, so what an honest node sends is knowable):

- **Without an assignment** (the default): every update is clipped to :func:`heterogeneous_clip_multiple`
  (``0.75 n`` for a round of ``n``, between 1.5 and 6) × the round's lower median norm, capped by the run's
  recent clip levels, and an update that points against the rest of its round as an outlier
  (:func:`~gradwire.aggregation.opposed_senders`, the lenient test), at most a minority of the round, keeps
  a share of its weight that falls from 1 just past the test's threshold to 0 at
  :data:`HETEROGENEOUS_OPPOSED_RAMP` (1.5) times it (:func:`~gradwire.aggregation.opposed_factors`): an honest
  node a little past it keeps its voice, a flip does not. Nothing down-weights a node for deviating
  persistently: an honest node on data of its own deviates persistently too, and no rule that sees only the
  updates can tell it from a colluder inside the spread (Karimireddy, He & Jaggi, ICLR 2022). Such a colluder
  is bounded (one node holds at most 3/7 of a round's clipped mass) but not silenced: a run without an
  assignment needs validators against it (docs/SERVER.md, "Robust aggregation").
- **With an assignment**: the clip at :data:`~gradwire.aggregation.CLIP_MULTIPLE` (1.5), direction outliers
  dropped, and each sender's weight scaled by its trust from its deviation history,
  in every mode (AdamW's included), so that a persistent deviation — which an IID honest node does not
  show — costs the sender its weight.
- **A round the validators scored** (``scored``): the scores weigh the updates; the trust steps aside, and the
  norm bound and the direction test stay (an update aimed at the validators — good on their data, against
  the rest of the round — is caught by both). Its histories still step, ready for a round that gets no score.

Every coefficient list is that of a weighted mean of the senders' own records (or a coordinate-wise rule's
trim), so a version stays bit-exact on every node (:func:`gradwire.aggregation.exact_aggregate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .aggregation import (
    CLIP_MULTIPLE,
    DEFAULT_RULE,
    OPPOSED_MEDIANS,
    WEIGHTED_RULES,
    NormHistory,
    check_rule,
    rule_weights,
    trim_count,
)
from .frame import Entry
from .sender_history import HISTORY_BETA, TRUST_MULTIPLE, SenderHistory, trusted_weights

__all__ = [
    "DEFAULT_SKETCH_KEY",
    "HETEROGENEOUS_CLIP_MULTIPLE",
    "HETEROGENEOUS_OPPOSED_RAMP",
    "Rule",
    "heterogeneous_clip_multiple",
]

#: ``bounded_mean``'s clip multiple (of the round's lower median norm) in a run without a data assignment.
#: An honest node on data of its own sends larger updates than the rest (on bench/heterogeneity.py's
#: minority row, 2 of 8 nodes on another input region: 3–4× the median norm, more in some rounds). Clipped
#: at :data:`~gradwire.aggregation.CLIP_MULTIPLE` (1.5) they lost half their weight, and their own data's
#: held-out loss rose 1.26× (DeMo) and 1.31× (AdamW) against the plain mean; at 3 DeMo's minority still got
#: 0.165 of the weight (its share: 0.25) and 1.12× the plain mean's loss on its data (6 seeds); at 6, 0.235
#: and 1.01×. The multiple for a round of ``n`` is ``0.75 n`` up to this (:func:`heterogeneous_clip_multiple`),
#: so that in every round one node holds at most 3/7 of its clipped mass (m / (m + n − 1)): at 6 in a round
#: of 4 a scaled rogue (tests/test_rogue_nodes.py) cost 6.5–10 % of held-out loss, at 3 under 5 %. With an
#: assignment (honest nodes IID: a larger update means nothing good) the clip stays at 1.5.
HETEROGENEOUS_CLIP_MULTIPLE = 6.0

#: Without a data assignment an update that points against the rest of its round keeps a share of its
#: weight that falls from 1 at the test's threshold to 0 at this many times it
#: (:func:`~gradwire.aggregation.opposed_factors`). On bench/heterogeneity.py's Dirichlet α = 0.1 row (nodes
#: of two or three classes: 1.06–1.28× the threshold in the rounds they are caught) the drop cost a node's
#: own data 1.12× (DeMo) and 1.16× (DeMo/agg) the plain mean's held-out loss (3 seeds); a flipped update is
#: twice the threshold in the median round, and bounded rather than dropped (at 1 median update) it cost a
#: SparseLoCo round of 4 4.3× the clean run's loss.
HETEROGENEOUS_OPPOSED_RAMP = 1.5


def heterogeneous_clip_multiple(n: int, most: float = HETEROGENEOUS_CLIP_MULTIPLE) -> float:
    """``bounded_mean``'s clip multiple for a round of ``n`` updates without a data assignment: ``0.75 n``,
    at least :data:`~gradwire.aggregation.CLIP_MULTIPLE` and at most ``most``."""
    return min(float(most), max(CLIP_MULTIPLE, 0.75 * n))


#: The sketches' key where none is given: public, so only for a rule no untrusted node submits to.
DEFAULT_SKETCH_KEY = b"gradwire.sketch/1"


class Rule:
    """A run's aggregation rule and its state (module docstring).

    ``name``: one of :data:`gradwire.aggregation.RULES`; ``trim_fraction``: the coordinate-wise rules';
    ``cap_factor``, ``cap_rounds``: ``bounded_mean``'s cap (:class:`NormHistory`); ``clip_multiple``: its
    clip (``None``: :func:`heterogeneous_clip_multiple` of each round's size without ``honest_iid``,
    :data:`CLIP_MULTIPLE` with it; a number: that, every round); ``opposed_ramp``: how a direction outlier
    loses its weight (:func:`~gradwire.aggregation.opposed_factors`; ``None``: :data:`HETEROGENEOUS_OPPOSED_RAMP`
    without ``honest_iid``, 1 (dropped) with it);
    ``history_beta``, ``trust_multiple``: its sender histories (:class:`SenderHistory`), kept only with ``honest_iid``.
    ``sketch_key``: the secret that keys the direction check's sketches (:mod:`gradwire.sketch`): a server
    passes one of its own (``gradwire_server.store.Store.sketch_key``); the default is public.
    """

    def __init__(
        self,
        name: str = DEFAULT_RULE,
        *,
        trim_fraction: float = 0.2,
        cap_factor: float = 3.0,
        cap_rounds: int = 8,
        clip_multiple: float | None = None,
        opposed_ramp: float | None = None,
        history_beta: float = HISTORY_BETA,
        trust_multiple: float = TRUST_MULTIPLE,
        honest_iid: bool = False,
        sketch_key: bytes | None = None,
    ):
        self.name = check_rule(name)
        self.trim_fraction = float(trim_fraction)
        self.honest_iid = bool(honest_iid)
        bounded = self.name == "bounded_mean"
        #: Whether the clip multiple follows each round's size (:func:`heterogeneous_clip_multiple`).
        self.clip_by_size = clip_multiple is None and not self.honest_iid
        if clip_multiple is None:
            clip_multiple = CLIP_MULTIPLE if self.honest_iid else HETEROGENEOUS_CLIP_MULTIPLE
        self.clip_multiple = float(clip_multiple)
        if opposed_ramp is None:
            opposed_ramp = 1.0 if self.honest_iid else HETEROGENEOUS_OPPOSED_RAMP
        if not (math.isfinite(opposed_ramp) and opposed_ramp >= 1.0):
            raise ValueError(f"opposed ramp must be a finite number >= 1, got {opposed_ramp!r}")
        self.opposed_ramp = float(opposed_ramp)
        self.norms: NormHistory | None = (
            NormHistory(cap_factor, cap_rounds, clip_multiple=clip_multiple) if bounded else None
        )
        self.senders: SenderHistory | None = (
            SenderHistory(history_beta, multiple=trust_multiple) if bounded and self.honest_iid else None
        )
        #: The key of the direction check's sketches (:mod:`gradwire.sketch`): secret to the server.
        self.sketch_key = DEFAULT_SKETCH_KEY if sketch_key is None else bytes(sketch_key)
        #: Closed rounds this rule was stepped past (since it was made or loaded): one per :meth:`step`.
        self.steps = 0

    @property
    def weighted(self) -> bool:
        """Whether the rule is a weighted mean of the records (else coordinate-wise: a trim)."""
        return self.name in WEIGHTED_RULES

    def round_clip_multiple(self, n: int) -> float:
        """The clip multiple of a round of ``n`` updates (module docstring)."""
        return heterogeneous_clip_multiple(n, self.clip_multiple) if self.clip_by_size else self.clip_multiple

    def cap(self) -> float:
        """The highest clip level this round may use (``inf`` for rules without a cap, or before any round)."""
        return math.inf if self.norms is None else self.norms.cap()

    def coefficients(
        self,
        senders: Sequence[int],
        weights: Sequence[float],
        norms: Sequence[float],
        records: Sequence[Sequence[Entry]] | None,
        scored: bool = False,
        alignment: Callable[[Sequence[float]], list[float]] | None = None,
    ) -> tuple[list[float], int]:
        """``(coefficients, trim)`` of the round about to close, from the state of the rounds before it
        (nothing is stepped). ``senders``: node ids; ``weights``: their (staleness, counted-once) weights;
        ``norms``: their update norms; ``records``: their records (the direction check reads them;
        ``None`` skips it; ``alignment``: how it reads the cosines, as
        :func:`~gradwire.aggregation.rule_weights` takes it). The weighted means give each sender its
        coefficient and trim 0; the coordinate-wise rules give the plain shares and their trim."""
        n = len(weights)
        if len(senders) != n or len(norms) != n:
            raise ValueError(f"got {len(senders)} senders and {len(norms)} norms for {n} weights")
        trim = trim_count(self.name, n, self.trim_fraction)
        if not self.weighted:
            total = sum(weights)
            return [w / total for w in weights], trim
        coeffs = rule_weights(
            self.name,
            weights,
            norms,
            self.cap(),
            records,
            OPPOSED_MEDIANS,
            self.round_clip_multiple(n),
            alignment,
            self.opposed_ramp,
        )
        if self.senders is not None and not scored:
            coeffs = trusted_weights(coeffs, weights, self.senders.trust(senders))
        return coeffs, trim

    def step(
        self,
        senders: Sequence[int],
        norms: Sequence[float],
        records: Sequence[Sequence[Entry]],
        coeffs: Sequence[float],
        history_sketches: Sequence | None = None,
    ) -> None:
        """Step the state past a closed round: its update ``norms`` (the cap's history) and, where kept, the
        senders' deviations from the round's reference, the senders its published ``coeffs`` counted. The
        one place the rule's state changes; once per closed round (closing and replaying alike).
        ``history_sketches``: each update's :func:`~gradwire.sender_history.history_sketch`, made as it arrived."""
        if self.norms is not None:
            self.norms.observe(norms, self.round_clip_multiple(len(norms)))
        if self.senders is not None:
            self.senders.observe(senders, records, coeffs, history_sketches)
        self.steps += 1

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state a checkpoint stores, under the keys a run's server state has always used
        (``aggregation``: the clip levels; ``senders``: the histories)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        if self.norms is not None:
            out["aggregation"] = self.norms.state_dict()
        if self.senders is not None:
            out["senders"] = self.senders.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (missing parts: a fresh state)."""
        if self.norms is not None:
            self.norms.load_state_dict(state.get("aggregation", {}))
        if self.senders is not None:
            self.senders.load_state_dict(state.get("senders", {}))

    def __repr__(self) -> str:
        return f"Rule({self.name!r}, honest_iid={self.honest_iid}, norms={self.norms!r}, senders={self.senders!r})"
