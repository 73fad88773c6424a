"""The aggregation rules, in one place: how the senders' records of a round become one float32 tensor per
name. The server (AdamW, DeMo and SparseLoCo runs), every node applying a published version
(:mod:`gradwire.published`) and the torch.distributed optimizers all aggregate through this module.

The rules (:data:`RULES`, the one list of their names; :data:`DEFAULT_RULE` is every run's default):

- ``bounded_mean`` (the default): each update first scaled by ``cᵢ = min(1, level / normᵢ)``, then the
  weighted mean ``Σ wᵢ cᵢ uᵢ / Σ wᵢ``. The clip ``level`` is :data:`CLIP_MULTIPLE` (1.5) × the round's
  *lower* median norm (of two updates the smaller, so one node of two cannot raise it), capped at
  ``cap_factor`` × the median of the clip levels of the run's last ``cap_rounds`` rounds
  (:class:`NormHistory`), so that even a round made of one rogue update (``quorum`` 1) moves the weights
  no more than the recent rounds did. One node's influence on a round is then at most 1.5 median
  updates', and a run's step size can grow by at most ``cap_factor`` every few rounds. Where the
  senders' records are at hand (the server), an update that points against the rest of the round (its
  cosine with the clipped sum of the others negative and an outlier among the round's cosines:
  :func:`opposed_senders`) is dropped, at most a minority of the round: a flipped or
  sign-alternating update cannot pull the round backwards.
  In a run whose honest nodes are IID (a data assignment), each node's weight is then scaled by its trust,
  from the momentum of its deviations from the rounds' median (:mod:`gradwire.sender_history`): colluders
  inside the honest spread deviate the same way every round. A run's rule, its clip multiple (3 without an
  assignment, 1.5 with one) and all its state are one object, :class:`gradwire.rule.Rule`.
- ``mean``: the (staleness-)weighted mean ``Σ wᵢ uᵢ / Σ wᵢ``: no bound on what one node moves (a run
  with it says so in its status).
- ``clipped_mean``: each update first scaled by ``cᵢ = min(1, median_norm / normᵢ)`` (:func:`clip_factors`),
  the norms taken over the whole update (all tensors), then the weighted mean ``Σ wᵢ cᵢ uᵢ / Σ wᵢ``. A
  rogue update can then weigh no more than a median one.
- ``trimmed_mean``: per coordinate, drop the ``⌊trim_fraction · n⌋`` smallest and largest values and
  average the rest.
- ``median``: per coordinate, the middle value (the mean of the two middle ones when ``n`` is even).

Staleness weights enter the two means only; the coordinate-wise rules give each update one vote.
:func:`rule_weights` gives each sender's coefficient in a mean, :func:`trim_count` how many values a
coordinate-wise rule drops from each end, :func:`weights_and_trim` both as a published version records
them.

**The bit-exact path** (:func:`exact_mean`, :func:`exact_trimmed_mean`, :func:`exact_aggregate`): what the
server and every node compute for a DeMo/SparseLoCo version, and what the torch optimizers compute in rank
order, so that every process holds the same bits.

Why it is exact everywhere: each record is decoded with :func:`gradwire.decode_entry`, whose DCT decode
computes its inverse transform in integers held exactly in float64 (``gradwire.dct.decode_levels``) and
rounds only elementwise at the end, so a record decodes to the same float32 bits on any thread count,
BLAS or device. The decoded tensors are then combined by a fixed sequence of elementwise float32
operations — ``t_i * w_i`` (one correctly rounded multiply by the weight rounded to float32) and
``acc + t_i`` (one correctly rounded add), in the given sender order — with no reduction whose order a
library may choose, no fused multiply-add and no atomics. IEEE 754 fixes the result of each such
operation, so every process that runs :func:`exact_mean` on the same records gets the same bits. Where
the records' codec has a fused path (:func:`gradwire.frame.weighted_sum_fused`: float32 DCT records on
the CPU), it runs this same sequence chunk by chunk in one Rust pass, without writing each decoded tensor
out: the same bits, in less time.

(The transform-domain sum of :class:`gradwire.dct.DCTAccumulator` is faster but ends in one
float32 inverse transform, a matrix product whose rounding follows the BLAS and thread count: it is not
used by the exact path.)

:func:`exact_trimmed_mean` is the robust counterpart, coordinate by coordinate: drop the ``t`` smallest and
``t`` largest of the ``n`` decoded values, average the rest (``t = ⌈n/2⌉ − 1`` is the median). It is exact
for the same reasons: sorting returns the same values in the same order everywhere once ``-0.0`` is made
``+0.0`` (the only distinct floats that compare equal; decoded values are finite), the kept values are
summed in sorted order and the sum divided once by their count, each step one correctly rounded float32
operation.

**The transform-domain path** (:func:`transform_domain_sum`, which :func:`aggregate` uses for ``mean`` and
``clipped_mean``): the server's AdamW mode, where speed is what counts. It sums in the codec's domain where
the codec registered an accumulator (:mod:`gradwire.accumulate`): for the DCT, every sender's sparse
coefficients are added into one coefficient array and one inverse transform runs per tensor, so a round
costs the bytes received plus one transform, not senders × parameters. It is deterministic on one machine
(a fixed order, no atomics) but not bit-exact across BLAS builds or thread counts, which is fine: the
server is the only process that computes it (nodes receive its outcome as the published weight change,
never recompute it). The coordinate-wise rules have no sparse form; :func:`aggregate` computes them with
:func:`exact_trimmed_mean`, so an AdamW run's median or trimmed mean has the exact path's bits.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from . import _native
from .accumulate import entry_coefficients, entry_norm, make_accumulator
from .frame import Entry, decode_entries, decode_entry, weighted_sum_fused

__all__ = [
    "DEFAULT_RULE",
    "MAX_UPDATE_NORM",
    "NormHistory",
    "RULES",
    "UNBOUNDED_RULES",
    "WEIGHTED_RULES",
    "pick",
    "weighted_aggregate",
    "aggregate",
    "CLIP_MULTIPLE",
    "bounded_level",
    "check_rule",
    "clip_factors",
    "exact_aggregate",
    "exact_mean",
    "exact_trimmed_mean",
    "OPPOSED_MADS",
    "OPPOSED_MEDIANS",
    "opposed_senders",
    "sender_alignment",
    "rule_weights",
    "sender_weights",
    "transform_domain_sum",
    "trim_count",
    "update_norm",
    "weights_and_trim",
]

#: Every aggregation rule's name; :func:`check_rule` is the one place a name is checked against it.
RULES = ("bounded_mean", "mean", "clipped_mean", "trimmed_mean", "median")
#: The rule of a run that names none: it bounds one node's influence (module docstring).
DEFAULT_RULE = "bounded_mean"
#: The rules under which one node's update can move the aggregate without bound.
UNBOUNDED_RULES = ("mean",)
#: The rules that are a weighted mean of the senders' records (the others are coordinate-wise).
WEIGHTED_RULES = _MEANS = ("bounded_mean", "mean", "clipped_mean")
#: The largest update L2 norm an aggregate takes: above it a sum of float32 values is no longer safely
#: finite (10⁸ such updates still sum below float32's 3.4·10³⁸). No honest update comes near it.
MAX_UPDATE_NORM = 1e30


def check_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`RULES`, else ``ValueError``."""
    if rule not in RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; known: {', '.join(RULES)}")
    return rule


def exact_mean(
    records: Sequence[Sequence[Entry]],
    weights: Sequence[float] | None = None,
    device=None,
) -> dict[str, torch.Tensor]:
    """``{name: Σ_i w_i · decode(records[i][name])}`` in float32, bit-identical wherever it runs.

    ``records[i]`` holds sender ``i``'s records, one per tensor name, the same names (and shapes) for
    every sender; ``weights`` defaults to ``1/n`` for ``n`` senders. Each weight is rounded to float32;
    the sum runs elementwise in the given sender order (``acc = t_0·w_0``, then ``acc = acc + t_i·w_i``).
    The result is keyed in the first sender's record order, on ``device`` (default: the CPU).
    ``ValueError`` if senders disagree on names or shapes, a sender repeats a name, or there are none.
    """
    weights = sender_weights(records, weights, "exact_mean")
    dev = torch.device("cpu") if device is None else torch.device(device)
    layout, per_sender = _by_name(records)

    w32 = [_float32(w) for w in weights]
    if _decodes_in_batches(dev):
        return _device_mean(list(layout), layout, per_sender, w32, dev)
    return {name: weighted_sum([mine[name] for mine in per_sender], w32, dev) for name in layout}


def _float32(w: float) -> float:
    """``w`` rounded to float32 once, so every device multiplies by the same number."""
    return float(torch.tensor(float(w), dtype=torch.float32))


def weighted_sum(
    entries: Sequence[Entry], weights: Sequence[float], device=None, *, exact: bool = True
) -> torch.Tensor:
    """``Σ wᵢ · decode(entries[i])`` of one tensor's records, in the given order, float32: the one weighted
    sum of records (:func:`exact_mean` runs it per tensor, :func:`transform_domain_sum` is its inexact
    form, the DDP hook takes either).

    ``exact`` (the default): bit-identical wherever it runs — each weight rounded to float32, then
    ``acc = t_0·w_0`` and ``acc = acc + t_i·w_i`` elementwise (see the module docstring), in one pass by
    the records' codec where it offers one (its ``weighted_sum`` capability: the DCT's on the CPU), else
    record by record. ``exact=False``: in the codec's domain where it offers an accumulator (one inverse
    transform for the sum: fast, deterministic on one machine, not across BLAS builds or thread counts).
    """
    if not entries:
        raise ValueError("a weighted sum needs at least one record")
    if len(weights) != len(entries):
        raise ValueError(f"got {len(weights)} weights for {len(entries)} records")
    dev = torch.device("cpu") if device is None else torch.device(device)
    if not exact:
        acc = make_accumulator(entries[0], dev)
        for e, w in zip(entries, weights):
            acc.add(e, w)
        return acc.finish()
    w32 = [_float32(w) for w in weights]
    fused = weighted_sum_fused(entries, w32, dev)
    if fused is not None:
        return fused
    total: torch.Tensor | None = None
    scaled: torch.Tensor | None = None  # one product buffer, reused across records
    for e, w in zip(entries, w32):
        t = decode_entry(e, dev).to(torch.float32)
        if total is None:
            total = torch.mul(t, w)
            continue
        # The same two correctly rounded operations as total + t·w, into buffers this loop owns (a
        # decoded tensor may view its record's bytes, so it is never written).
        scaled = torch.mul(t, w, out=scaled) if scaled is not None else torch.mul(t, w)
        total.add_(scaled)
    return total


def _device_mean(names, layout, per_sender, w32: list[float], dev: torch.device) -> dict[str, torch.Tensor]:
    """:func:`exact_mean` on a GPU: the records of as many tensors as :data:`_GPU_DECODE_ELEMS` allows decoded
    together, then ``acc = t_0·w_0`` and ``acc = acc + t_i·w_i`` for all of them at once (``_foreach_`` ops:
    the same two once-rounded operations per element, so the same bits, in launches that do not grow with
    the number of tensors)."""
    out: dict[str, torch.Tensor] = {}
    at = 0
    while at < len(names):
        decoded: dict[tuple[int, str], torch.Tensor] = {}
        _gpu_decode_batch(names[at:], layout, per_sender, dev, decoded)
        taken = names[at : at + len({n for _, n in decoded})]
        acc: list[torch.Tensor] | None = None
        for i, w in enumerate(w32):
            ts = [decoded.pop((i, n)).to(torch.float32) for n in taken]
            if acc is None:
                acc = torch._foreach_mul(ts, w)
            else:
                torch._foreach_add_(acc, torch._foreach_mul(ts, w))
        out.update(zip(taken, acc))
        at += len(taken)
    return out


#: Decoded values (float32) :func:`exact_mean` holds at once when it decodes records together on a GPU.
_GPU_DECODE_ELEMS = 1 << 26


def _decodes_in_batches(dev: torch.device) -> bool:
    """Whether :func:`exact_mean` decodes several tensors' records at once: on a GPU (on the CPU the
    records' fused sums and the Rust decode of one record at a time are the fast path)."""
    return dev.type != "cpu"


def _gpu_decode_batch(
    names: Sequence[str], layout: Mapping[str, tuple[int, ...]], per_sender, dev: torch.device, into: dict
) -> None:
    """Decode every sender's records of the first of ``names`` (and of the next, while the decoded values
    stay under :data:`_GPU_DECODE_ELEMS`) together into ``into[(sender, name)]``."""
    taken: list[str] = []
    size = 0
    for name in names:
        n = math.prod(layout[name]) * len(per_sender)
        if taken and size + n > _GPU_DECODE_ELEMS:
            break
        taken.append(name)
        size += n
    keys = [(i, name) for name in taken for i in range(len(per_sender))]
    for key, t in zip(keys, decode_entries([per_sender[i][name] for i, name in keys], dev)):
        into[key] = t


def sender_weights(records: Sequence[Sequence[Entry]], weights: Sequence[float] | None, what: str) -> list[float]:
    """``weights`` checked against the senders of ``records`` (default ``1/n`` each); ``ValueError`` for no
    senders or another count of weights."""
    n = len(records)
    if n == 0:
        raise ValueError(f"{what} needs at least one sender's records")
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} senders")
    return list(weights)


def _by_name(records: Sequence[Sequence[Entry]]) -> tuple[dict[str, tuple[int, ...]], list[dict[str, Entry]]]:
    """The first sender's ``{name: shape}`` (in its record order) and each sender's ``{name: entry}``;
    ``ValueError`` if senders disagree on names or shapes or one repeats a name."""
    layout: dict[str, tuple[int, ...]] = {}
    for e in records[0]:
        if e.name in layout:
            raise ValueError(f"sender 0 sent tensor {e.name!r} twice")
        layout[e.name] = tuple(e.shape)
    per_sender: list[dict[str, Entry]] = []
    for i, recs in enumerate(records):
        mine: dict[str, Entry] = {}
        for e in recs:
            if e.name in mine:
                raise ValueError(f"sender {i} sent tensor {e.name!r} twice")
            mine[e.name] = e
        if set(mine) != set(layout):
            missing = sorted(set(layout) - set(mine))[:5]
            extra = sorted(set(mine) - set(layout))[:5]
            raise ValueError(
                f"sender {i} disagrees with sender 0 on the tensor names (missing {missing}, extra {extra})"
            )
        for name, e in mine.items():
            if tuple(e.shape) != layout[name]:
                raise ValueError(f"sender {i} sent {name!r} with shape {tuple(e.shape)}, sender 0 with {layout[name]}")
        per_sender.append(mine)
    return layout, per_sender


def trim_count(rule: str, n: int, trim_fraction: float = 0.0) -> int:
    """How many values :func:`exact_trimmed_mean` drops from each end for ``rule`` over ``n`` senders:
    ``"mean"`` / ``"clipped_mean"`` none, ``"trimmed_mean"`` ``⌊trim_fraction · n⌋`` (at most
    ``⌈n/2⌉ − 1``, so one value is always kept), ``"median"`` ``⌈n/2⌉ − 1`` (the middle value, or the
    mean of the two middle ones)."""
    if n < 1:
        raise ValueError(f"need at least one sender, got {n}")
    if check_rule(rule) in _MEANS:
        return 0
    if rule == "trimmed_mean":
        if not 0.0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must lie in [0, 0.5), got {trim_fraction}")
        return min(math.floor(trim_fraction * n), (n - 1) // 2)
    return (n - 1) // 2  # median


def exact_trimmed_mean(records: Sequence[Sequence[Entry]], trim: int, device=None) -> dict[str, torch.Tensor]:
    """``{name: per-coordinate mean of the decoded values left after dropping the trim smallest and the
    trim largest}`` in float32, bit-identical wherever it runs (see the module docstring).

    ``records`` as for :func:`exact_mean`; ``0 <= 2·trim < n``. ``trim = 0`` is the unweighted mean of the
    sorted values (not :func:`exact_mean`'s sender order, so not always its bits).
    """
    n = len(records)
    if n == 0:
        raise ValueError("exact_trimmed_mean needs at least one sender's records")
    if not 0 <= 2 * trim < n:
        raise ValueError(f"cannot drop {trim} values from each end of {n}: need 0 <= 2·trim < n")
    dev = torch.device("cpu") if device is None else torch.device(device)
    layout, per_sender = _by_name(records)
    kept = n - 2 * trim
    out: dict[str, torch.Tensor] = {}
    for name in layout:
        stacked = torch.stack([decode_entry(mine[name], dev).to(torch.float32) for mine in per_sender])
        stacked = torch.add(stacked, 0.0)  # -0.0 + 0.0 = +0.0: no two kept values compare equal yet differ
        ordered = torch.sort(stacked, dim=0).values[trim : n - trim]
        acc = ordered[0].clone()
        for i in range(1, kept):
            acc = torch.add(acc, ordered[i])
        out[name] = acc if kept == 1 else torch.div(acc, float(kept))
    return out


def exact_aggregate(
    records: Sequence[Sequence[Entry]],
    weights: Sequence[float] | None = None,
    trim: int = 0,
    device=None,
) -> dict[str, torch.Tensor]:
    """What a published version applies: :func:`exact_mean` with ``weights`` when ``trim`` is 0, else
    :func:`exact_trimmed_mean` (which ignores the weights)."""
    if trim:
        return exact_trimmed_mean(records, trim, device)
    return exact_mean(records, weights, device)


# -- the rules' weights --------------------------------------------------------------------------


def clip_factors(norms: Sequence[float], level: float | None = None) -> list[float]:
    """``min(1, level / norm)`` per update: every update is scaled to at most ``level`` (default: the
    median norm; an update of norm 0 keeps factor 1)."""
    if not norms:
        return []
    if level is None:
        level = statistics.median(norms)
    return [1.0 if n <= level or n == 0.0 else level / n for n in norms]


#: ``bounded_mean`` clips to this multiple of the round's lower median norm. At 1.0 about half of the
#: honest updates of every round are shrunk, which cost SparseLoCo on ``gradwire demo`` (8 nodes) held-out
#: loss 0.075 against the plain mean's 0.063; at 1.5 (and 2) it is 0.063, while one node still moves a
#: round by at most 1.5 median updates.
CLIP_MULTIPLE = 1.5


def bounded_level(norms: Sequence[float], cap: float = math.inf, multiple: float = CLIP_MULTIPLE) -> float:
    """``bounded_mean``'s clip level: ``multiple`` (:data:`CLIP_MULTIPLE`) × the round's lower median norm
    (the smaller middle value when the count is even, so half of a round cannot raise it), at most ``cap``
    (:meth:`NormHistory.cap`)."""
    if not norms:
        raise ValueError("bounded_level needs at least one norm")
    return min(multiple * statistics.median_low(norms), cap)


def update_norm(entries: Iterable[Entry], record_norm: Callable[[Entry], float] = entry_norm) -> float:
    """An update's L2 norm over all its records, ``√Σ record_norm(e)²`` in float64 (the server's
    validation and its replays compute it here, so they agree to the bit). Float32 values cannot
    overflow it: a non-finite norm means non-finite values."""
    return math.sqrt(sum(_square(record_norm(e)) for e in entries))


def _square(x: float) -> float:
    return x * x


class NormHistory:
    """The clip levels of a run's last ``rounds`` rounds under ``bounded_mean``: the cap on the next
    round's level is ``factor`` × their median (none before the first round).

    The server keeps one per run, steps it once per closed round (:meth:`observe`, after the round's
    weights were taken with :meth:`cap`), saves it with every checkpoint (:meth:`state_dict`) and
    replays it with the versions since, so a restarted run clips exactly as an uninterrupted one.
    A level of 0 (a round of all-zero updates) is not remembered: it would cap every later round to 0.
    """

    def __init__(self, factor: float, rounds: int, levels: Iterable[float] = (), clip_multiple: float = CLIP_MULTIPLE):
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"cap factor must be a finite number >= 1, got {factor!r}")
        if rounds < 1:
            raise ValueError(f"cap rounds must be >= 1, got {rounds!r}")
        if not (math.isfinite(clip_multiple) and clip_multiple > 0.0):
            raise ValueError(f"clip multiple must be a finite number > 0, got {clip_multiple!r}")
        self.factor = float(factor)
        self.rounds = int(rounds)
        self.clip_multiple = float(clip_multiple)
        self.levels: list[float] = [float(x) for x in levels][-self.rounds :]

    def cap(self) -> float:
        """The highest clip level the next round may use (``inf`` while no level is remembered)."""
        return self.factor * statistics.median(self.levels) if self.levels else math.inf

    def observe(self, norms: Sequence[float], multiple: float | None = None) -> float:
        """Remember the clip level of a round with update ``norms`` (call after :meth:`cap` was used for
        its weights; ``multiple``: the round's clip multiple, default this history's); returns that level."""
        level = bounded_level(norms, self.cap(), self.clip_multiple if multiple is None else multiple)
        if level > 0.0 and math.isfinite(level):
            self.levels = (self.levels + [level])[-self.rounds :]
        return level

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"levels": torch.tensor(self.levels, dtype=torch.float64)}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        levels = state.get("levels")
        self.levels = [] if levels is None else [float(x) for x in levels.reshape(-1).tolist()][-self.rounds :]

    def __repr__(self) -> str:
        return f"NormHistory(factor={self.factor}, rounds={self.rounds}, levels={self.levels})"


#: ``bounded_mean`` drops an update whose cosine with the rest of its round is negative and more than
#: ``OPPOSED_MADS`` median absolute deviations below the round's median cosine (:func:`opposed_senders`).
#: On ``gradwire demo`` (8 honest nodes) the bare sign test (cosine < 0) dropped 69 of 320 SparseLoCo
#: updates and 574 of 2,560 DeMo ones — late in training honest updates are mostly noise and point every
#: way — and cost SparseLoCo's held-out loss 0.063 → 0.078; at 3 MADs it drops 10 and 108 of them, and
#: still caught bench/attacks.py's flipped DeMo rogue in 40 rounds of 40 (at 4 MADs: 38).
OPPOSED_MADS = 3.0
#: ... and more than ``OPPOSED_MEDIANS`` times as opposed to the rest as the round's median update is aligned
#: with it. A flipped update in a round of 4 points against the rest 2–3× as strongly as an honest one points
#: with it (3× when honest updates are nearly orthogonal), while honest updates that are mostly noise have
#: cosines of either sign around a small median: on bench/convergence.py's digits (4 nodes, SparseLoCo) the
#: spread test alone dropped an honest update at cosine −0.023 against a median of 0.017, which cost 5 % of
#: held-out loss.
OPPOSED_MEDIANS = 2.0


def rule_weights(
    rule: str,
    weights: Sequence[float],
    norms: Sequence[float] | None = None,
    cap: float = math.inf,
    records: Sequence[Sequence[Entry]] | None = None,
    opposed_medians: float = OPPOSED_MEDIANS,
    clip_multiple: float = CLIP_MULTIPLE,
    alignment: Callable[[Sequence[float]], list[float]] | None = None,
    opposed_ramp: float = 1.0,
) -> list[float]:
    """Each sender's coefficient in a weighted-mean rule: ``wᵢ cᵢ / Σ wᵢ``, from the senders'
    (staleness) ``weights`` and, for ``clipped_mean`` and ``bounded_mean``, their update ``norms``
    (``cᵢ`` from :func:`clip_factors`: to the median norm, or to :func:`bounded_level` with ``cap``;
    1 for ``mean``). ``ValueError`` for a coordinate-wise rule.

    ``bounded_mean`` given the senders' ``records`` also bounds the updates that point against the rest
    (:func:`opposed_senders`): each keeps the share of its weight :func:`opposed_factors` gives it with
    ``opposed_ramp`` (1, the default: none, the drop), and the sum runs over the weights kept.
    ``alignment``: how the direction check reads the senders' cosines for given coefficients (default
    :func:`sender_alignment` of ``records``; the server's large rounds: :func:`gradwire.sketch.sketched_alignment`).
    """
    if check_rule(rule) not in _MEANS:
        raise ValueError(f"rule {rule!r} is no weighted mean")
    if rule == "mean":
        clip = [1.0] * len(weights)
    else:
        if norms is None or len(norms) != len(weights):
            raise ValueError(f"{rule} needs one norm per sender ({len(weights)}), got {norms!r}")
        clip = clip_factors(norms, bounded_level(norms, cap, clip_multiple) if rule == "bounded_mean" else None)
    total = sum(weights)
    coeffs = [w * c / total for w, c in zip(weights, clip)]
    if rule != "bounded_mean" or records is None:
        return coeffs
    # The direction test reads the round through updates clipped at no more than CLIP_MULTIPLE: a flipped
    # update clipped at a larger multiple pulls the honest updates' cosines with the rest below 0 and hides
    # itself among them (a flipped 1e15 update in a round of 4, clip 3: 1.37× the clean run's held-out loss).
    probe = coeffs
    if clip_multiple > CLIP_MULTIPLE:
        level = bounded_level(norms, cap, CLIP_MULTIPLE)
        probe = [w * c / total for w, c in zip(weights, clip_factors(norms, level))]
    kept = opposed_factors(records, probe, opposed_medians, alignment, opposed_ramp)
    if all(f == 1.0 for f in kept):
        return coeffs
    total = sum(w * f for w, f in zip(weights, kept))
    return [w * c * f / total for w, c, f in zip(weights, clip, kept)]


def sender_alignment(records: Sequence[Sequence[Entry]], coeffs: Sequence[float]) -> list[float]:
    """The cosine of each sender's update ``uᵢ`` (all its records) with ``Σ_{j≠i} coeffsⱼ uⱼ``, the
    rest of the round; 0 where either is zero.

    Inner products are taken in each codec's orthonormal coefficient space where all senders' records
    of a tensor share one (:func:`gradwire.accumulate.entry_coefficients`: the DCT's kept coefficients,
    without a dense decode), else on the decoded tensors; sums in float64. Deterministic on one
    machine; only the server computes it (the weights it publishes carry the outcome).
    """
    n = len(records)
    if len(coeffs) != n:
        raise ValueError(f"got {len(coeffs)} coefficients for {n} senders")
    _, per_sender = _by_name(records)
    dot = [0.0] * n  # <u_i, S> with S = Σ_j a_j u_j
    sq = [0.0] * n  # |u_i|²
    views_by_name = []
    for name in per_sender[0]:
        views = [entry_coefficients(mine[name]) for mine in per_sender]
        if any(v.basis != views[0].basis or v.size != views[0].size for v in views[1:]):
            views = [entry_coefficients(mine[name], dense=True) for mine in per_sender]
        views_by_name.append(views)
    weights64 = np.asarray([float(a) for a in coeffs], dtype=np.float64)
    dense_views = []
    for views in views_by_name:
        if any(v.idx is None for v in views):
            dense_views.append(views)
            continue
        # Sparse records (the DCT's kept coefficients): the sum and the products in one native pass over
        # a cache-sized window of positions (about 7x faster than index_add_/index_select/index_fill_ on
        # SparseLoCo's 10 M close).
        d, q = _native.sparse_alignment(
            [
                (
                    np.ascontiguousarray(v.idx.cpu().numpy(), dtype=np.int64),
                    np.ascontiguousarray(v.values.cpu().numpy(), dtype=np.float64),
                )
                for v in views
            ],
            weights64,
            views[0].size,
        )
        for i in range(n):
            dot[i] += d[i]
            sq[i] += q[i]
    # Dense views: one zeroed buffer for every tensor.
    total_buf = torch.zeros(max((v[0].size for v in dense_views), default=0), dtype=torch.float64)
    for views in dense_views:
        total = total_buf[: views[0].size]
        for a, v in zip(coeffs, views):
            if a == 0.0:
                continue
            if v.idx is None:
                total.add_(v.values, alpha=a)
            else:
                total.index_add_(0, v.idx, v.values, alpha=a)
        for i, v in enumerate(views):
            mine = total if v.idx is None else total.index_select(0, v.idx)
            dot[i] += float(torch.dot(v.values, mine))
            sq[i] += float(torch.dot(v.values, v.values))
        if any(v.idx is None for v in views):
            total.zero_()
        else:
            for v in views:
                total.index_fill_(0, v.idx, 0.0)
    s_sq = sum(float(a) * d for a, d in zip(coeffs, dot))  # |S|² = Σ_j a_j <u_j, S>
    out = []
    for i in range(n):
        a = float(coeffs[i])
        rest_dot = dot[i] - a * sq[i]  # <u_i, S - a_i u_i>
        rest_sq = max(0.0, s_sq - 2.0 * a * dot[i] + a * a * sq[i])
        denom = math.sqrt(sq[i]) * math.sqrt(rest_sq)
        out.append(rest_dot / denom if denom > 0.0 and math.isfinite(denom) else 0.0)
    return out


def opposed_senders(
    records: Sequence[Sequence[Entry]],
    coeffs: Sequence[float],
    medians: float = OPPOSED_MEDIANS,
    alignment: Callable[[Sequence[float]], list[float]] | None = None,
) -> list[bool]:
    """Which senders ``bounded_mean`` drops: those whose update points against the rest of the round, as an
    outlier among the round's updates.

    With ``cᵢ`` each sender's :func:`sender_alignment`, ``m`` their median and ``d`` the median of
    ``|cᵢ − m|``: sender ``i`` is dropped if ``cᵢ < min(0, m − OPPOSED_MADS·d, −medians·|m|)`` (``medians``:
    :data:`OPPOSED_MEDIANS` where the server also weighs nodes by their histories; 0, the spread test alone,
    where it does not: AdamW runs), the most opposed first and
    at most a minority, ``(n − 1) // 2`` of ``n`` (with 2 senders nobody can tell who is right, so none is).
    ``alignment(coeffs)`` gives the cosines (default: :func:`sender_alignment` of ``records``).

    A flipped update (``−u``), however scaled, points against the honest ones by about as much as they
    point with each other, far below their spread, and is dropped; so is the negative half of an update
    alternating in sign to poison a momentum or an error buffer. (Its pull also lowers the honest
    updates' cosines, often below 0, which is why the test is against the round's spread and not the
    sign of the median.) Honest updates that are mostly noise point every way, within the spread.
    """
    return [f < 1.0 for f in opposed_factors(records, coeffs, medians, alignment)]


def opposed_factors(
    records: Sequence[Sequence[Entry]],
    coeffs: Sequence[float],
    medians: float = OPPOSED_MEDIANS,
    alignment: Callable[[Sequence[float]], list[float]] | None = None,
    ramp: float = 1.0,
) -> list[float]:
    """The share of its weight each sender keeps against :func:`opposed_senders`' test: 1 for the senders it
    does not catch; for those it does (cosine ``cᵢ`` below the threshold ``b < 0``), ``(ramp − cᵢ/b) / (ramp − 1)``
    clamped to [0, 1], so an update just past the threshold keeps most of its weight and one ``ramp`` times as
    opposed keeps none; ``ramp`` 1: none at all (the drop).

    A flipped update points against the rest 1.2–4× as strongly as the threshold (22 rounds of
    tests/test_rogue_nodes.py's flipped SparseLoCo rogue in a round of 4: twice it in the median round); an
    honest node of two or three classes past it in some rounds (bench/heterogeneity.py's Dirichlet α = 0.1
    row), 1.06–1.28×."""
    if ramp < 1.0 or not math.isfinite(ramp):
        raise ValueError(f"opposed ramp must be a finite number >= 1, got {ramp!r}")
    n = len(records)
    limit = (n - 1) // 2
    if limit == 0:
        return [1.0] * n
    cos = sender_alignment(records, coeffs) if alignment is None else alignment(coeffs)
    mid = statistics.median(cos)
    spread = statistics.median(abs(c - mid) for c in cos)
    # Against the rest OPPOSED_MEDIANS times as strongly as the round's median update points with it: in a
    # round of a few nodes the spread of their cosines can be tiny, and an honest update that is mostly
    # noise (its cosine a little below 0) would otherwise be an outlier (bench/convergence.py's digits).
    below = min(0.0, mid - OPPOSED_MADS * spread, -medians * abs(mid))
    worst = sorted((c, i) for i, c in enumerate(cos) if c < below)[:limit]
    out = [1.0] * n
    for c, i in worst:
        out[i] = 0.0 if ramp == 1.0 or below == 0.0 else min(1.0, max(0.0, (ramp - c / below) / (ramp - 1.0)))
    return out


def weights_and_trim(
    rule: str,
    weights: Sequence[float],
    norms: Sequence[float] | None = None,
    trim_fraction: float = 0.0,
    cap: float = math.inf,
    records: Sequence[Sequence[Entry]] | None = None,
) -> tuple[list[float], int]:
    """``(weights, trim)`` for a published version (DeMo, SparseLoCo; :func:`exact_aggregate` applies
    them): the weighted means put everything in the weights (:func:`rule_weights`, trim 0); the
    coordinate-wise rules trim :func:`trim_count` values from each end and ignore the weights, written
    as the plain shares ``wᵢ / Σ wᵢ`` for the record. ``records``: the senders' records, with which
    ``bounded_mean`` drops opposed updates (:func:`rule_weights`)."""
    trim = trim_count(rule, len(weights), trim_fraction)
    if rule in _MEANS:
        return rule_weights(rule, weights, norms, cap, records), trim
    total = sum(weights)
    return [w / total for w in weights], trim


# -- the transform-domain path (the server's AdamW mode) -------------------------------------------


def transform_domain_sum(
    entries: Sequence[Entry], weights: Sequence[float], device: torch.device | None = None
) -> torch.Tensor:
    """``Σ wᵢ · decode(entries[i])`` of one tensor's records, summed in the codec's domain where it
    declared an accumulator (:func:`gradwire.accumulate.make_accumulator`), in the given order:
    :func:`weighted_sum` with ``exact=False``. Fast, deterministic on one machine, not bit-exact across
    BLAS or thread counts (see the module docstring)."""
    if not entries:
        raise ValueError("transform_domain_sum needs at least one record")
    return weighted_sum(entries, weights, device, exact=False)


def aggregate(
    records: Sequence[Sequence[Entry]],
    names: Sequence[str],
    rule: str = "mean",
    weights: Sequence[float] | None = None,
    norms: Sequence[float] | None = None,
    trim_fraction: float = 0.0,
    device: torch.device | None = None,
    cap: float = math.inf,
    opposed_medians: float = OPPOSED_MEDIANS,
) -> dict[str, torch.Tensor]:
    """``{name: aggregate}`` of the senders' ``records`` under ``rule``, for each of ``names`` in that
    order (the server's AdamW mode; ``opposed_medians``: :func:`opposed_senders`'s).

    ``records[i]`` holds sender ``i``'s records, at least one for each of ``names``; ``weights`` are the
    senders' (staleness) weights (default 1 each) and ``norms`` their update norms (``clipped_mean`` and
    ``bounded_mean``, whose level is at most ``cap``). The weighted means run :func:`transform_domain_sum`
    with :func:`rule_weights`;
    ``trimmed_mean`` and ``median`` run :func:`exact_trimmed_mean` with :func:`trim_count`'s trim (the
    weights ignored). Senders are combined in the order given, so the caller fixes the result.
    """
    check_rule(rule)
    n = len(records)
    if n == 0:
        raise ValueError("nothing to aggregate")
    if weights is None:
        weights = [1.0] * n
    elif len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} senders")
    picked = pick(records, names)
    if rule in _MEANS:
        return weighted_aggregate(
            picked, names, rule_weights(rule, weights, norms, cap, picked, opposed_medians), device
        )
    return exact_trimmed_mean(picked, trim_count(rule, n, trim_fraction), device)


def weighted_aggregate(
    records: Sequence[Sequence[Entry]],
    names: Sequence[str],
    coeffs: Sequence[float],
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """``{name: Σ coeffsᵢ · recordᵢ}`` for each of ``names``, summed in the codec's domain
    (:func:`transform_domain_sum`): a weighted rule's aggregate once its coefficients are known."""
    picked = pick(records, names)
    return {name: transform_domain_sum([mine[j] for mine in picked], coeffs, device) for j, name in enumerate(names)}


def pick(records: Sequence[Sequence[Entry]], names: Sequence[str]) -> list[list[Entry]]:
    """Each sender's records of ``names``, in that order; ``ValueError`` if a sender lacks one."""
    out: list[list[Entry]] = []
    for i, recs in enumerate(records):
        mine = {e.name: e for e in recs}
        missing = [name for name in names if name not in mine]
        if missing:
            raise ValueError(f"sender {i} sent no record of {missing[:5]}")
        out.append([mine[name] for name in names])
    return out
